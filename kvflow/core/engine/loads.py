"""Loads from L2 tiers into L1 objects, shared by prefetch and retrieve.

A load job covers consecutive chunk positions, each with one key per rank. Keys L1
holds need nothing; a key another job is loading is waited for, never loaded twice;
every other key held by a tier gets an invisible L1 object (reserved like a store's,
so eviction cannot take it) and a tier load into it. Positions settle in order:
while every earlier position landed, a position whose keys all landed is kept
(committed to L1 with write-back on, else staged for a retrieve to claim); from the
first gap on (a miss, a failed or corrupt load) loaded objects are discarded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, cast

from kvflow.core.engine.ops import Op
from kvflow.core.engine.writethrough import TierCounters
from kvflow.core.tiers.base import HostTier, ObjectKey, StorageTier, WritePlan
from kvflow.events import Event, EventBus, EventType

log = logging.getLogger("kvflow.l2")

#: staged objects (write-back off) no retrieve claimed within this many seconds are freed
STAGE_TTL_S = 60.0

#: where a key was found: "l1", an L2 tier's name, or None (nowhere)
Residency = dict[ObjectKey, str | None]


class Slot:
    """One key being loaded into its reserved L1 object by its owner job.

    Lock rule: `loaded` and `staged_at` are read and written under the loader's lock;
    the other fields are set at construction and never change (`final` is a Future,
    thread-safe on its own).
    """

    __slots__ = ("final", "key", "loaded", "nbytes", "owner", "plan", "staged_at", "tier")

    def __init__(self, key: ObjectKey, nbytes: int, tier: StorageTier, plan: WritePlan, owner: Job):
        self.key = key
        self.nbytes = nbytes
        self.tier = tier
        self.plan = plan
        self.owner = owner
        self.loaded: bool | None = None  # the tier's answer
        self.final: Future[bool] = Future()  # kept (True) or discarded (False)
        self.staged_at: float | None = None

    @property
    def obj(self) -> Any:
        return self.plan.new[0][1]


#: a position's entry per rank: True (in L1), False (nowhere, no room) or a Slot
Entry = bool | Slot


class Job:
    """A load of consecutive chunk positions; `finals[i]` tells whether position i landed.

    Lock rule: `rows`, `finals` and `l1_pins` are built in `Loader.start` before the job
    is shared and never change after. The counters and `next`, `gap`, `finished`,
    `kept_keys` are written under the loader's lock until the job finishes, and frozen
    after: `on_done` and later readers read them without it (the lock that set `finished`
    orders those writes before them). `finals` and `done` are Futures, thread-safe.
    """

    def __init__(self, reason: str, session_id: str | None, on_done: Callable[[Job], None]):
        self.reason = reason
        self.session_id = session_id
        self.on_done = on_done
        self.rows: list[list[Entry]] = []
        self.finals: list[Future[bool]] = []
        self.next = 0
        self.gap = False
        self.finished = False
        self.kept = self.discarded = self.kept_bytes = 0
        #: keys of this job's own loads that the tiers answered well
        self.loaded = 0
        #: keys committed to L1 (write-back on), for WRITE_BACK's `keys`
        self.kept_keys: list[ObjectKey] = []
        self.l1_pins: list[ObjectKey] = []
        self.done: Future[None] = Future()

    def landed_prefix(self) -> int:
        """Positions from the first that landed, among those settled so far."""
        n = 0
        for final in self.finals:
            if not final.done() or not final.result():
                break
            n += 1
        return n


class Loader:
    """Runs load jobs against the L2 tiers; keeps the slots in flight and the staged ones.

    Lock rule: `_lock` guards `_slots`, the slots' and jobs' mutable fields (see Slot and
    Job), the `loaded` / `load_failures` counters of `counters` (written only here, under
    it; `Tiering.describe` reads them racily: ints, each read whole, shown as a status
    snapshot), and `_contains_failures` with `_failing`. It is held for bookkeeping only,
    never while a tier is waited for; L1's lock may be taken under it (never the reverse).
    """

    def __init__(
        self,
        l1: HostTier,
        tiers: Sequence[StorageTier],
        bus: EventBus,
        counters: dict[str, TierCounters],
        *,
        write_back: bool,
        timeout_s: float,
    ) -> None:
        self._l1 = l1
        self._tiers = tiers
        self._bus = bus
        self._counters = counters
        self.write_back = write_back
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._slots: dict[ObjectKey, Slot] = {}
        #: per tier: `contains` calls of `residency` that failed or timed out (status)
        self._contains_failures = {t.name: 0 for t in tiers}
        #: per tier failing its `contains` calls now: failures since it last answered
        self._failing: dict[str, int] = {}

    # -- where keys are -----------------------------------------------------------------

    def residency(self, keys: Sequence[ObjectKey]) -> Residency:
        """Which tier holds each key: L1 first, then each L2 tier in order, each answer
        awaited at most the L2 timeout (an answer that does not come is a miss)."""
        found: Residency = dict.fromkeys(keys)
        in_l1 = self._l1.contains(keys).result()
        todo = [k for k, hit in zip(keys, in_l1, strict=True) if not hit]
        for k, hit in zip(keys, in_l1, strict=True):
            if hit:
                found[k] = "l1"
        with self._lock:  # keys being loaded count as where they come from
            for k in todo:
                slot = self._slots.get(k)
                if slot is not None:
                    found[k] = slot.tier.name
        todo = [k for k in todo if found[k] is None]
        deadline = time.monotonic() + self.timeout_s
        for tier in self._tiers:
            if not todo:
                break
            try:
                answer = tier.contains(todo).result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # a slow, hung or failing tier: its keys are misses now
                self._contains_failed(tier, exc)
                continue
            self._contains_answered(tier)
            for k, hit in zip(todo, answer, strict=True):
                if hit:
                    found[k] = tier.name
            todo = [k for k in todo if found[k] is None]
        return found

    def _contains_failed(self, tier: StorageTier, exc: Exception) -> None:
        """Count a `contains` call that failed or timed out; log the first of a streak."""
        with self._lock:
            self._contains_failures[tier.name] += 1
            streak = self._failing[tier.name] = self._failing.get(tier.name, 0) + 1
        if streak == 1:
            log.warning(
                "l2_contains_failed: tier %r did not answer which keys it holds (%s: %s); "
                "its keys count as misses until it does (status l2.tiers.%s.contains_failures)",
                tier.name, type(exc).__name__, exc or "timed out", tier.name,
            )  # fmt: skip

    def _contains_answered(self, tier: StorageTier) -> None:
        """A `contains` call answered: log the end of a failure streak, if any."""
        with self._lock:
            streak = self._failing.pop(tier.name, 0)
        if streak:
            log.warning(
                "l2_contains_recovered: tier %r answers again after %d failed calls",
                tier.name, streak,
            )  # fmt: skip

    def contains_failures(self) -> dict[str, int]:
        """Per tier, `contains` calls that failed or timed out since start (for status)."""
        with self._lock:
            return dict(self._contains_failures)

    # -- jobs -------------------------------------------------------------------------------

    def start(
        self,
        rows: Sequence[Sequence[ObjectKey]],
        nbytes: Sequence[int],
        *,
        reason: str,
        session_id: str | None,
        on_done: Callable[[Job], None],
        residency: Residency | None = None,
    ) -> Job:
        """Start loading chunk positions `rows` (key i of a row needs `nbytes[i]` bytes).

        Positions after the first one that cannot land (a key nowhere, no L1 room) are
        not loaded at all: they could never be written back.
        """
        self.sweep()
        keys = [k for row in rows for k in row]
        where = residency if residency is not None else self.residency(keys)
        tiers = {t.name: t for t in self._tiers}
        job = Job(reason, session_id, on_done)
        loads: dict[str, list[Slot]] = {}
        borrowed: list[Slot] = []
        evicted = [0, 0]
        evicted_keys: list[ObjectKey] = []
        with self._lock:
            for row in rows:
                entries: list[Entry] = []
                for i, key in enumerate(row):
                    entry = self._entry(
                        key, nbytes[i], where.get(key), tiers, job, evicted, evicted_keys
                    )
                    entries.append(entry)
                    if isinstance(entry, Slot):
                        if entry.owner is job:
                            loads.setdefault(entry.tier.name, []).append(entry)
                        else:
                            borrowed.append(entry)
                job.rows.append(entries)
                job.finals.append(Future())
                if False in entries:
                    break
        if evicted[0]:
            attrs = {"chunks": evicted[0], "bytes": evicted[1], "keys": evicted_keys}
            self._bus.publish(Event(EventType.L1_EVICT, 0, session_id, None, attrs))
        for name, slots in loads.items():
            self._submit(tiers[name], slots, job)
        for slot in borrowed:
            slot.final.add_done_callback(lambda _f: self._advance(job))
        self._advance(job)
        return job

    def _entry(
        self,
        key: ObjectKey,
        nbytes: int,
        where: str | None,
        tiers: dict[str, StorageTier],
        job: Job,
        evicted: list[int],
        evicted_keys: list[ObjectKey],
    ) -> Entry:
        """A key's entry in a new job (under the lock): reuse a slot, or reserve and own one."""
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        if where == "l1":
            # held against eviction (by this job's own reservations too) until the job ends
            if self._l1.pin([key]):
                job.l1_pins.append(key)
                return True
            return False  # evicted since the question was asked
        tier = tiers.get(where) if where is not None else None
        if tier is None:
            return False
        plan = self._l1.prepare_write([key], nbytes)
        evicted[0] += plan.evicted_chunks
        evicted[1] += plan.evicted_bytes
        evicted_keys.extend(cast(list[ObjectKey], plan.evicted_keys))
        if not plan.covered:
            return False  # no room in L1
        if not plan.new:
            return True  # a store wrote it meanwhile
        slot = Slot(key, nbytes, tier, plan, job)
        self._slots[key] = slot
        return slot

    def _submit(self, tier: StorageTier, slots: list[Slot], job: Job) -> None:
        """One tier load for these slots; its answer settles them and advances the job."""
        total = sum(s.nbytes for s in slots)
        attrs = {"tier": tier.name, "chunks": len(slots), "bytes": total, "reason": job.reason}
        op = Op(self._bus, EventType.L2_LOAD_START, job.session_id, attrs)
        op.publish_start()
        views = self._l1.views([s.obj for s in slots])
        try:
            future = tier.load([s.key for s in slots], [views[i] for i in range(len(slots))])
        except Exception as exc:
            future = Future()
            future.set_exception(exc)
        future.add_done_callback(lambda f: self._loaded(f, tier, slots, job, op))

    def _loaded(
        self, future: Future[list[bool]], tier: StorageTier, slots: list[Slot], job: Job, op: Op
    ) -> None:
        counters = self._counters[tier.name]
        try:
            answers = [bool(a) for a in future.result()]
            if len(answers) != len(slots):
                raise ValueError(f"tier {tier.name!r} answered {len(answers)} of {len(slots)} keys")
            error: BaseException | None = None
        except Exception as exc:
            answers, error = [False] * len(slots), exc
        good = sum(answers)
        with self._lock:
            for slot, ok in zip(slots, answers, strict=True):
                slot.loaded = ok
            job.loaded += good
            counters.loaded += good
            counters.load_failures += len(slots) - good
        result = {
            "loaded_chunks": good,
            "loaded_bytes": sum(s.nbytes for s, ok in zip(slots, answers, strict=True) if ok),
            "failed_chunks": len(slots) - good,
        }
        if error is None:
            op.end(**result)
        else:
            op.fail(error, **result)
        self._advance(job)

    def _state(self, entry: Entry, job: Job) -> bool | None:
        """Whether an entry landed (None: not known yet)."""
        if isinstance(entry, bool):
            return entry
        if entry.owner is job:
            return entry.loaded
        return entry.final.result() if entry.final.done() else None

    def _advance(self, job: Job) -> None:
        """Settle the job's positions that can be settled, in order (thread-safe)."""
        settled: list[tuple[Future[bool], bool]] = []
        with self._lock:
            while job.next < len(job.rows):
                row = job.rows[job.next]
                states = [self._state(e, job) for e in row]
                if None in states:
                    break
                landed = not job.gap and all(states)
                for entry in row:
                    if isinstance(entry, Slot) and entry.owner is job:
                        settled.append((entry.final, landed))
                        self._settle(entry, job, landed)
                job.gap = job.gap or not landed
                settled.append((job.finals[job.next], landed))
                job.next += 1
            finished = job.next == len(job.rows) and not job.finished
            job.finished = job.finished or finished
        for future, value in settled:
            future.set_result(value)
        if finished:
            self._l1.unpin(job.l1_pins)
            job.done.set_result(None)
            job.on_done(job)

    def _settle(self, slot: Slot, job: Job, keep: bool) -> None:
        """Keep (commit or stage) or discard an owned slot (under the lock)."""
        if keep and self.write_back:
            self._l1.commit(slot.plan)
            del self._slots[slot.key]
            job.kept_keys.append(slot.key)
        elif keep:
            slot.staged_at = time.monotonic()
        else:
            self._l1.abort(slot.plan)
            del self._slots[slot.key]
        if keep:
            job.kept += 1
            job.kept_bytes += slot.nbytes
        elif slot.loaded:
            job.discarded += 1

    # -- staged objects (write-back off) -------------------------------------------------

    def claim(self, keys: Sequence[ObjectKey]) -> list[Slot]:
        """Take the staged slots of the leading keys (the caller reads, then `discard`s)."""
        out: list[Slot] = []
        with self._lock:
            for key in keys:
                slot = self._slots.get(key)
                if slot is None or slot.staged_at is None:
                    break
                del self._slots[key]
                out.append(slot)
        return out

    def discard(self, slots: Sequence[Slot]) -> None:
        """Free claimed slots' L1 objects."""
        for slot in slots:
            self._l1.abort(slot.plan)

    def sweep(self, max_age_s: float = STAGE_TTL_S) -> int:
        """Free staged objects no retrieve claimed in `max_age_s`; returns how many."""
        limit = time.monotonic() - max_age_s
        with self._lock:
            stale = [
                s for s in self._slots.values() if s.staged_at is not None and s.staged_at <= limit
            ]
            for slot in stale:
                del self._slots[slot.key]
                self._l1.abort(slot.plan)
        return len(stale)

    def wait_prefix(self, job: Job, timeout: float) -> int:
        """Positions from the first that landed, waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        n = 0
        for final in job.finals:
            try:
                if not final.result(timeout=max(0.0, deadline - time.monotonic())):
                    break
            except FutureTimeout:
                break
            n += 1
        return n

    def in_flight(self) -> dict[str, int]:
        """Keys loading and keys staged right now."""
        with self._lock:
            staged = sum(1 for s in self._slots.values() if s.staged_at is not None)
            return {"loading": len(self._slots) - staged, "staged": staged}
