"""The engine's L2 side: write-through, lookups over every tier, prefetch, retrieve's loads.

`Tiering` composes the write-through (`writethrough.py`) and the loader (`loads.py`)
and keeps what `status()` shows per tier; the cache engine calls it only when L2
tiers are configured, so an L1-only engine runs exactly as before.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.core.config import PREFETCH_SHARE
from kvflow.core.engine.loads import Job, Loader, Residency, Slot
from kvflow.core.engine.ops import Op
from kvflow.core.engine.writethrough import TierCounters, WriteThrough
from kvflow.core.tiers.base import DescribedTier, HostTier, ObjectKey, StorageTier
from kvflow.events import Event, EventBus, EventType

#: finished prefetches whose state stays queryable
KEEP_PREFETCHES = 1024


class Prefetch:
    """One prefetch's state, as `prefetch_state` reports it.

    Lock rule: `job`, `finished` and the counters are written and read under the
    tiering's lock (`describe` is called under it), so a prefetch reported done has its
    final counts; the other fields never change after construction.
    """

    def __init__(
        self, prefetch_id: str, model_name: str, *, chunks: int, tokens: int, chunk_size: int,
        skipped: int,
    ) -> None:  # fmt: skip
        self.prefetch_id = prefetch_id
        self.model_name = model_name
        self.chunks = chunks
        self.tokens = tokens
        self.chunk_size = chunk_size
        self.skipped = skipped  # chunk positions past PREFETCH_SHARE of L1, not prefetched
        self.job: Job | None = None
        self.finished = False
        self.loaded = self.written_back = self.discarded = 0

    def describe(self) -> dict[str, Any]:
        """The state (under the tiering's lock); landed_tokens from the job's Futures."""
        job = self.job
        landed = job.landed_prefix() * self.chunk_size if job is not None else 0
        return {
            "prefetch_id": self.prefetch_id,
            "state": "done" if self.finished else "running",
            "model_name": self.model_name,
            "chunks": self.chunks,
            "tokens": self.tokens,
            "landed_tokens": landed,
            "loaded_chunks": self.loaded,
            "written_back_chunks": self.written_back,
            "discarded_chunks": self.discarded,
            "skipped_chunks": self.skipped,
        }


@dataclass
class Fetched:
    """What a retrieve's L2 step found: objects to read in key order; of those the L1
    objects pinned (release after reading) and the staged slots claimed (discard after
    reading); how many came from an L2 tier rather than L1. Lock rule: none; it belongs
    to the retrieve that fetched it."""

    objs: list[Any]
    pinned: list[Any]
    staged: list[Slot]
    from_l2: int


class Tiering:
    """L2 tiers behind L1, in their configured order.

    Lock rule: `_lock` guards `_ids`, `_prefetches` (and each Prefetch's mutable
    fields), `prefetch_totals`, `streamed` and the `hit_chunks` counters, written only
    here. The other TierCounters fields are written under the loader's lock (`loaded`,
    `load_failures`) and by the write-through (`stored`, `store_failures`); `describe`
    reads every counter racily for status: ints, each read whole, no consistency between
    them promised. `tiers`, `chunk_size`, `counters` (the dict), `writes` and `loader`
    are set in __init__ and never reassigned; the last two have locks of their own.
    """

    def __init__(
        self,
        l1: HostTier,
        tiers: Sequence[StorageTier],
        bus: EventBus,
        *,
        chunk_size: int,
        write_back: bool,
        timeout_s: float,
        backlog_wait_s: float,
    ) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or "l1" in names:
            raise ValueError(f"L2 tiers need distinct names other than 'l1', got {names}")
        self.tiers = list(tiers)
        self.chunk_size = chunk_size
        self._l1 = l1
        self._bus = bus
        self.counters = {t.name: TierCounters() for t in tiers}
        self.writes = WriteThrough(l1, self.tiers, bus, self.counters, wait_s=backlog_wait_s)
        self.loader = Loader(
            l1, self.tiers, bus, self.counters, write_back=write_back, timeout_s=timeout_s
        )
        self._order = {"l1": 0, **{name: i + 1 for i, name in enumerate(names)}}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._prefetches: OrderedDict[str, Prefetch] = OrderedDict()
        self.prefetch_totals = {
            "requests": 0, "loaded": 0, "written_back": 0, "discarded": 0, "skipped": 0,
        }  # fmt: skip
        # stores and retrieves larger than L1 could take at once (they streamed through it)
        self.streamed = {"stores": 0, "store_chunks": 0, "retrieves": 0, "retrieve_chunks": 0}

    @property
    def write_back(self) -> bool:
        return self.loader.write_back

    # -- lookup ---------------------------------------------------------------------------

    def hit_rows(
        self, rows: Sequence[Sequence[ObjectKey]]
    ) -> tuple[int, dict[str, int], Residency]:
        """Consecutive positions of `rows` every key of which some tier holds.

        Returns (positions hit, hit positions per tier — the slowest tier each needed —,
        where each key is).
        """
        where = self.loader.residency([k for row in rows for k in row])
        by_tier: dict[str, int] = {}
        n = 0
        for row in rows:
            places = [where[k] for k in row]
            if None in places:
                break
            slowest = max(places, key=lambda p: self._order[p or "l1"]) or "l1"
            by_tier[slowest] = by_tier.get(slowest, 0) + 1
            n += 1
        with self._lock:
            for name, hits in by_tier.items():
                if name != "l1":
                    self.counters[name].hit_chunks += hits
        return n, by_tier, where

    # -- prefetch --------------------------------------------------------------------------

    def prefetch(
        self,
        rows: Sequence[Sequence[ObjectKey]],
        nbytes: Sequence[int],
        *,
        model_name: str,
        trigger: str,
        session_id: str | None,
        residency: Residency,
    ) -> str:
        """Load the L2 keys of `rows` (every key held somewhere) into L1; returns its id.

        Only the positions that fit in PREFETCH_SHARE of L1 are loaded; the state and the
        END event count the others as `skipped_chunks`."""
        fit = _fitting_rows(nbytes, len(rows), int(self._l1.capacity_bytes * PREFETCH_SHARE))
        record = self._new_prefetch(model_name, rows[:fit], residency, rows[fit:])
        attrs = {
            "model_name": model_name,
            "world_size": len(rows[0]) if rows else 1,
            "chunks": record.chunks,
            "tokens": record.tokens,
            "trigger": trigger,
            "skipped_chunks": record.skipped,
        }
        op = Op(self._bus, EventType.PREFETCH_START, session_id, attrs)
        op.publish_start()
        job = self.loader.start(
            rows[:fit], nbytes, reason="prefetch", session_id=session_id,
            on_done=lambda job: self._prefetched(record, job, op), residency=residency,
        )  # fmt: skip
        with self._lock:
            record.job = job
        return record.prefetch_id

    def _new_prefetch(
        self, model_name: str, rows: Sequence[Sequence[ObjectKey]], residency: Residency,
        skipped_rows: Sequence[Sequence[ObjectKey]],
    ) -> Prefetch:  # fmt: skip
        """A prefetch's record, counted and kept queryable (the oldest beyond
        KEEP_PREFETCHES forgotten)."""
        with self._lock:
            record = Prefetch(
                f"pf-{next(self._ids)}", model_name, chunks=_in_l2(rows, residency),
                tokens=len(rows) * self.chunk_size, chunk_size=self.chunk_size,
                skipped=_in_l2(skipped_rows, residency),
            )  # fmt: skip
            self.prefetch_totals["requests"] += 1
            self.prefetch_totals["skipped"] += record.skipped
            self._prefetches[record.prefetch_id] = record
            while len(self._prefetches) > KEEP_PREFETCHES:
                self._prefetches.popitem(last=False)
        return record

    def _prefetched(self, record: Prefetch, job: Job, op: Op) -> None:
        """A prefetch's job finished: its record and the totals counted, WRITE_BACK, END."""
        written_back = job.kept if self.write_back else 0
        with self._lock:
            record.loaded, record.written_back = job.loaded, written_back
            record.discarded = job.discarded
            record.finished = True
            totals = self.prefetch_totals
            totals["loaded"] += job.loaded
            totals["written_back"] += written_back
            totals["discarded"] += job.discarded
        self._publish_write_back(job)
        op.end(
            loaded_chunks=job.loaded,
            written_back_chunks=written_back,
            discarded_chunks=job.discarded,
            skipped_chunks=record.skipped,
        )

    def prefetch_state(self, prefetch_id: str) -> dict[str, Any] | None:
        """A prefetch's state (None when the id is unknown or long forgotten)."""
        with self._lock:
            record = self._prefetches.get(prefetch_id)
            return None if record is None else record.describe()

    # -- retrieve ----------------------------------------------------------------------------

    def fetch(self, keys: Sequence[ObjectKey], nbytes: int, session_id: str | None) -> Fetched:
        """Bring the leading `keys` that L1 misses back from L2, waiting at most the timeout."""
        return self.finish_fetch(self.start_fetch(keys, nbytes, session_id), keys)

    def start_fetch(self, keys: Sequence[ObjectKey], nbytes: int, session_id: str | None) -> Job:
        """Start loading the `keys` L1 misses (a retrieve's window); `finish_fetch` collects."""
        return self.loader.start(
            [[k] for k in keys], [nbytes], reason="retrieve", session_id=session_id,
            on_done=self._publish_write_back,
        )  # fmt: skip

    def finish_fetch(self, job: Job, keys: Sequence[ObjectKey]) -> Fetched:
        """The leading keys of a `start_fetch` that landed, waiting at most the timeout."""
        landed = self.loader.wait_prefix(job, self.loader.timeout_s)
        fetched = Fetched([], [], [], 0)
        if self.write_back:  # one pin of the run: recency refreshed head last, like any read
            fetched.pinned = self._l1.pin_prefix(keys[:landed])
            fetched.objs = list(fetched.pinned)
        else:
            for key in keys[:landed]:
                slots = self.loader.claim([key])
                got = [slots[0].obj] if slots else self._l1.pin_prefix([key])
                if not got:
                    break  # evicted again meanwhile: the prefix ends here
                (fetched.staged if slots else fetched.pinned).extend(slots or got)
                fetched.objs.append(got[0])
        fetched.from_l2 = sum(row[0] is not True for row in job.rows[: len(fetched.objs)])
        return fetched

    def _publish_write_back(self, job: Job) -> None:
        if self.write_back and (job.kept or job.discarded):
            attrs = {
                "kept": job.kept,
                "discarded": job.discarded,
                "bytes": job.kept_bytes,
                "reason": job.reason,
                "keys": job.kept_keys,
            }
            self._bus.publish(Event(EventType.WRITE_BACK, 0, job.session_id, None, attrs))

    # -- status and shutdown ------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Per-tier usage and counters, prefetch totals, what is in flight (for status)."""
        tiers: dict[str, dict[str, Any]] = {}
        contains_failures = self.loader.contains_failures()
        for tier in self.tiers:
            tiers[tier.name] = {
                **tier.stats(),
                **self.counters[tier.name].as_dict(),
                "contains_failures": contains_failures[tier.name],
            }
            if isinstance(tier, DescribedTier):  # e.g. the disk tier's paths and their usage
                tiers[tier.name]["detail"] = tier.describe()
        with self._lock:
            prefetch = dict(self.prefetch_totals)
            streamed = dict(self.streamed)
        return {
            "tiers": tiers,
            "write_back": self.write_back,
            "timeout_s": self.loader.timeout_s,
            "prefetch": prefetch,
            "streamed": streamed,
            "write_through": self.writes.totals(),
            "in_flight": {**self.loader.in_flight(), "write_through": self.writes.pending()},
        }

    def count_streamed(self, kind: str, chunks: int) -> None:
        """A store or retrieve ("stores", "retrieves") streamed `chunks` through L1."""
        with self._lock:
            self.streamed[kind] += 1
            self.streamed[f"{kind[:-1]}_chunks"] += chunks

    def close(self, timeout: float) -> None:
        """Let pending writes finish (bounded), close the tiers, free staged objects."""
        self.writes.drain(timeout)
        for tier in self.tiers:
            tier.close()
        self.loader.sweep(0.0)


def _in_l2(rows: Sequence[Sequence[ObjectKey]], residency: Residency) -> int:
    """Keys of `rows` that an L2 tier holds (neither in L1 nor nowhere)."""
    return sum(1 for row in rows for k in row if residency.get(k) not in (None, "l1"))


def _fitting_rows(nbytes: Sequence[int], n_rows: int, budget: int) -> int:
    """How many rows (one object of nbytes[i] per rank i) fit in `budget` bytes (at least
    one: a single row never overflows L1, registration checked that)."""
    per_row = max(1, sum(nbytes))
    return min(n_rows, max(1, budget // per_row))
