"""Write-through: chunks a store wrote to L1 are copied to every L2 tier in the background.

The store's reply does not wait for the writes: the chunks' L1 objects are pinned (so
eviction leaves their bytes alone), each tier's `store` is submitted, and the pins are
released when every tier has answered. A backlog bound keeps a slow tier from pinning all
of L1: a submit past it waits (at most `wait_s`, --l2-backlog-wait-s) for earlier writes
to finish, so a write burst slows the store down instead of losing L2 writes; chunks
still past the bound when the wait ends are not written to L2 and count as dropped (L1
is unaffected). Drops are logged once per burst: the first drop's L2_STORE_END is a
warning like any failed END, later ones carry `drop_burst` (their place in the burst,
from 2), which the logging subscriber counts without a line, and the burst's end (a
submit that goes through whole again) is one warning with what it dropped.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from kvflow.core.config import BACKLOG_SHARE
from kvflow.core.engine.ops import Op
from kvflow.core.errors import L2BacklogError
from kvflow.core.tiers.base import HostTier, ObjectKey, StorageTier, StoreOutcome
from kvflow.events import Event, EventBus, EventType

log = logging.getLogger("kvflow.l2")


class TierCounters:
    """Per-tier totals since start for `status()` (metrics come from the events)."""

    __slots__ = ("hit_chunks", "load_failures", "loaded", "store_failures", "stored")

    def __init__(self) -> None:
        self.stored = self.store_failures = self.loaded = self.load_failures = 0
        self.hit_chunks = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class WriteReceipt:
    """What became of the chunks one store submitted, per tier (read under the
    write-through's lock): keys a tier confirmed (stored or present, in calls with no
    failure), keys whose writes are still pending, and chunks dropped past the bound."""

    def __init__(self, tiers: Sequence[str]) -> None:
        self.confirmed: dict[str, set[ObjectKey]] = {name: set() for name in tiers}
        self.pending: dict[ObjectKey, int] = {}  # key -> tier calls not answered yet
        self.dropped = 0


class WriteThrough:
    """Submits L1's new chunks to each L2 tier; `drain` waits for what is pending."""

    def __init__(
        self,
        l1: HostTier,
        tiers: Sequence[StorageTier],
        bus: EventBus,
        counters: dict[str, TierCounters],
        *,
        wait_s: float,
    ) -> None:
        self._l1 = l1
        self._tiers = tiers
        self._bus = bus
        self._counters = counters
        self.wait_s = wait_s
        self.max_pending = int(l1.capacity_bytes * BACKLOG_SHARE)
        self._pending_bytes = 0
        self._pending_calls = 0
        self._idle = threading.Condition()
        # backpressure and drops since start (status), and the drop burst under way
        self.waits = self.dropped_chunks = self.drop_bursts = 0
        self.waited_s = 0.0
        # the drop burst under way: (start, chunks dropped, L2_STORE_ENDs of drops)
        self._burst: tuple[float, int, int] | None = None

    def submit(
        self,
        keys: Sequence[ObjectKey],
        nbytes: int,
        session_id: str | None,
        receipt: WriteReceipt | None = None,
    ) -> int:
        """Write these L1 chunks (each `nbytes`) to every tier; returns the chunks dropped.

        Returns once every chunk's writes are submitted (not finished): when the pinned
        backlog has no room, it waits for earlier writes to finish, at most `wait_s` in
        all; chunks still without room then are dropped (the head of the request goes
        first: it is the part a lookup can reach). `receipt` records what becomes of them.
        """
        deadline = time.monotonic() + self.wait_s
        done = 0
        while done < len(keys):
            with self._idle:
                fit = self._room(nbytes, deadline)
                fit = min(len(keys) - done, fit)
                self._pending_bytes += fit * nbytes
            if not fit:
                break
            self._write(keys[done : done + fit], nbytes, session_id, receipt)
            done += fit
        dropped = len(keys) - done
        if dropped:
            self._refuse(dropped, nbytes, session_id)
            if receipt is not None:
                with self._idle:
                    receipt.dropped += dropped
        elif keys:
            self._end_burst()
        return dropped

    def _room(self, nbytes: int, deadline: float) -> int:
        """Chunks of `nbytes` the backlog takes now, waiting (under the condition) until
        it takes one or `deadline` passes. A chunk larger than the bound goes alone."""
        started = None
        while True:
            free = self.max_pending - self._pending_bytes
            room = max(0, free // nbytes) if nbytes else 0
            if room or (nbytes and not self._pending_bytes):
                break
            left = deadline - time.monotonic()
            if left <= 0 or not self._pending_calls:
                break
            if started is None:
                started = time.monotonic()
                self.waits += 1
            self._idle.wait(left)
        if started is not None:
            self.waited_s += time.monotonic() - started
        return max(room, 1) if nbytes and not self._pending_bytes else room

    def _write(
        self,
        keys: Sequence[ObjectKey],
        nbytes: int,
        session_id: str | None,
        receipt: WriteReceipt | None,
    ) -> None:
        """Pin the chunks (their backlog bytes are counted already) and submit each tier's
        write of them."""
        objs, pinned = self._pin(keys)
        with self._idle:
            self._pending_bytes -= (len(keys) - len(objs)) * nbytes
            if objs:
                self._pending_calls += len(self._tiers)
                if receipt is not None:
                    for key in pinned:
                        receipt.pending[key] = len(self._tiers)
        if not objs:
            return
        views = self._l1.views(objs)
        items = [(key, views[i]) for i, key in enumerate(pinned)]
        remaining = [len(self._tiers)]
        for tier in self._tiers:
            op = self._start(tier, len(items), len(objs) * nbytes, session_id)
            try:
                future = tier.store(items)
            except Exception as exc:  # a closed or broken tier: counted, L1 unaffected
                future = Future()
                future.set_exception(exc)
            future.add_done_callback(
                functools.partial(self._finished, tier=tier, op=op, items=items, nbytes=nbytes,
                                  objs=objs, remaining=remaining, receipt=receipt)
            )  # fmt: skip

    def wait_progress(self, deadline: float) -> bool:
        """Wait until some pending tier call answers (True) or `deadline` passes or nothing
        is pending (False): a store that found L1 full of chunks being written waits here."""
        with self._idle:
            calls = self._pending_calls
            started = time.monotonic()
            while self._pending_calls >= calls > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            progressed = self._pending_calls < calls
            if calls:
                self.waits += 1
                self.waited_s += time.monotonic() - started
            return progressed

    def _pin(self, keys: Sequence[ObjectKey]) -> tuple[list[Any], list[ObjectKey]]:
        """Pin each key's L1 object (evicted ones are skipped): the chunks need not be one
        run. Last first, so the request's head stays the most recently used (L1 evicts a
        prefix's tail first)."""
        objs: list[Any] = []
        pinned: list[ObjectKey] = []
        for key in reversed(keys):
            got = self._l1.pin_prefix([key])
            objs.extend(got)
            if got:
                pinned.append(key)
        objs.reverse()
        pinned.reverse()
        return objs, pinned

    def _refuse(self, chunks: int, nbytes: int, session_id: str | None) -> None:
        """Chunks past the backlog bound after the wait: each tier's write of them fails,
        counted; the first drop of a burst is logged."""
        error = L2BacklogError(
            f"{self._pending_bytes} bytes still waited for L2 writes after {self.wait_s:g} s "
            f"(bound {self.max_pending}, --l2-backlog-wait-s)"
        )
        with self._idle:
            self.dropped_chunks += chunks
            if self._burst is None:
                self.drop_bursts += 1
                self._burst = (time.monotonic(), 0, 0)
            start, dropped, drops = self._burst
            self._burst = (start, dropped + chunks, drops + len(self._tiers))
        for i, tier in enumerate(self._tiers):
            op = self._start(tier, chunks, chunks * nbytes, session_id)
            self._count(tier, failed=chunks)
            op.fail(error, stored_chunks=0, stored_bytes=0, present_chunks=0, failed_chunks=chunks,
                    drop_burst=drops + i + 1)  # fmt: skip

    def _end_burst(self) -> None:
        """A submit went through whole: log the drop burst under way, if any, as ended."""
        with self._idle:
            burst, self._burst = self._burst, None
        if burst is not None:
            log.warning(
                "l2_write_drop_burst_ended: %d chunks dropped in %.3f s (%d L2 store ENDs)",
                burst[1], time.monotonic() - burst[0], burst[2],
            )  # fmt: skip

    def _count(self, tier: StorageTier, *, stored: int = 0, failed: int = 0) -> None:
        """Add to a tier's store totals under the write-through's lock: tiers answer on
        their own I/O threads, several at once (status reads the ints racily)."""
        counters = self._counters[tier.name]
        with self._idle:
            counters.stored += stored
            counters.store_failures += failed

    def _start(self, tier: StorageTier, chunks: int, total: int, session_id: str | None) -> Op:
        attrs = {"tier": tier.name, "chunks": chunks, "bytes": total}
        op = Op(self._bus, EventType.L2_STORE_START, session_id, attrs)
        op.publish_start()
        return op

    def _finished(
        self,
        future: Future[StoreOutcome],
        tier: StorageTier,
        op: Op,
        items: Sequence[tuple[ObjectKey, Any]],
        nbytes: int,
        objs: list[Any],
        remaining: list[int],
        receipt: WriteReceipt | None,
    ) -> None:
        """One tier answered: publish its END (and evictions), release pins after the last."""
        outcome: StoreOutcome | None = None
        try:
            outcome = future.result()
        except Exception as exc:
            self._count(tier, failed=len(items))
            op.fail(exc, stored_chunks=0, stored_bytes=0, present_chunks=0,
                    failed_chunks=len(items))  # fmt: skip
        else:
            self._count(tier, stored=outcome.stored, failed=outcome.failed)
            op.end(
                stored_chunks=outcome.stored,
                stored_bytes=outcome.stored * nbytes,
                present_chunks=outcome.present,
                failed_chunks=outcome.failed,
                # which keys the tier holds now is known only when none failed
                **({} if outcome.failed else {"keys": [key for key, _ in items]}),
            )
            if outcome.evicted_chunks:
                attrs = {
                    "tier": tier.name,
                    "chunks": outcome.evicted_chunks,
                    "bytes": outcome.evicted_bytes,
                    "keys": list(outcome.evicted_keys),
                }
                self._bus.publish(Event(EventType.L2_EVICT, 0, op.session_id, None, attrs))
        with self._idle:
            if receipt is not None:
                self._settle(receipt, tier.name, [k for k, _ in items], outcome)
            remaining[0] -= 1
            last = remaining[0] == 0
            self._pending_calls -= 1
            if last:
                self._pending_bytes -= len(objs) * nbytes
            self._idle.notify_all()
        if last:
            self._l1.release(objs)

    @staticmethod
    def _settle(
        receipt: WriteReceipt, tier: str, keys: list[ObjectKey], outcome: StoreOutcome | None
    ) -> None:
        """Record one tier's answer for these keys (under the condition). A call with any
        failed key confirms none of them: the outcome does not say which failed."""
        if outcome is not None and not outcome.failed:
            receipt.confirmed[tier].update(keys)
        for key in keys:
            left = receipt.pending.get(key, 0) - 1
            if left > 0:
                receipt.pending[key] = left
            else:
                receipt.pending.pop(key, None)

    def holding(self, receipt: WriteReceipt) -> tuple[dict[str, set[ObjectKey]], set[ObjectKey]]:
        """A copy of the receipt's confirmed keys per tier and its pending keys."""
        with self._idle:
            return (
                {name: set(keys) for name, keys in receipt.confirmed.items()},
                set(receipt.pending),
            )

    def totals(self) -> dict[str, Any]:
        """Backpressure and drops since start, for status (kvflow top shows them)."""
        with self._idle:
            return {
                "bound_bytes": self.max_pending,
                "wait_s": self.wait_s,
                "waits": self.waits,
                "waited_s": round(self.waited_s, 6),
                "dropped_chunks": self.dropped_chunks,
                "drop_bursts": self.drop_bursts,
                "dropping": self._burst is not None,
            }

    def pending(self) -> dict[str, int]:
        """Bytes pinned for and tier calls still waiting on L2 writes."""
        with self._idle:
            return {"bytes": self._pending_bytes, "calls": self._pending_calls}

    def drain(self, timeout: float) -> bool:
        """Wait until no write is pending (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending_calls:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True
