"""Write-through: chunks a store wrote to L1 are copied to every L2 tier in the background.

The store's reply never waits: the chunks' L1 objects are pinned (so eviction leaves
their bytes alone), each tier's `store` is submitted, and the pins are released when
every tier has answered. A backlog bound keeps a slow tier from pinning all of L1:
chunks beyond it are not written to L2 and count as failed (L1 is unaffected).
"""

from __future__ import annotations

import functools
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


class TierCounters:
    """Per-tier totals since start for `status()` (metrics come from the events)."""

    __slots__ = ("hit_chunks", "load_failures", "loaded", "store_failures", "stored")

    def __init__(self) -> None:
        self.stored = self.store_failures = self.loaded = self.load_failures = 0
        self.hit_chunks = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class WriteThrough:
    """Submits L1's new chunks to each L2 tier; `drain` waits for what is pending."""

    def __init__(
        self,
        l1: HostTier,
        tiers: Sequence[StorageTier],
        bus: EventBus,
        counters: dict[str, TierCounters],
    ) -> None:
        self._l1 = l1
        self._tiers = tiers
        self._bus = bus
        self._counters = counters
        self._max_pending = int(l1.capacity_bytes * BACKLOG_SHARE)
        self._pending_bytes = 0
        self._pending_calls = 0
        self._idle = threading.Condition()

    def submit(self, keys: Sequence[ObjectKey], nbytes: int, session_id: str | None) -> None:
        """Write these L1 chunks (each `nbytes`) to every tier; returns at once.

        Chunks that would take the pinned backlog past its bound are not written (the
        head of the request goes first: it is the part a lookup can reach).
        """
        with self._idle:
            room = max(0, (self._max_pending - self._pending_bytes) // nbytes) if nbytes else 0
            fit = min(len(keys), room)
            self._pending_bytes += fit * nbytes
        objs, pinned = self._pin(keys[:fit])
        with self._idle:
            self._pending_bytes -= (fit - len(objs)) * nbytes
            if objs:
                self._pending_calls += len(self._tiers)
        if len(keys) > fit:
            self._refuse(len(keys) - fit, nbytes, session_id)
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
                                  objs=objs, remaining=remaining)
            )  # fmt: skip

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
        """Chunks past the backlog bound: each tier's write of them fails, counted."""
        error = L2BacklogError(
            f"{self._pending_bytes} bytes already wait for L2 writes (bound {self._max_pending})"
        )
        for tier in self._tiers:
            op = self._start(tier, chunks, chunks * nbytes, session_id)
            self._counters[tier.name].store_failures += chunks
            op.fail(error, stored_chunks=0, stored_bytes=0, present_chunks=0, failed_chunks=chunks)

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
    ) -> None:
        """One tier answered: publish its END (and evictions), release pins after the last."""
        counters = self._counters[tier.name]
        try:
            outcome = future.result()
        except Exception as exc:
            counters.store_failures += len(items)
            op.fail(exc, stored_chunks=0, stored_bytes=0, present_chunks=0,
                    failed_chunks=len(items))  # fmt: skip
        else:
            counters.stored += outcome.stored
            counters.store_failures += outcome.failed
            op.end(
                stored_chunks=outcome.stored,
                stored_bytes=outcome.stored * nbytes,
                present_chunks=outcome.present,
                failed_chunks=outcome.failed,
            )
            if outcome.evicted_chunks:
                attrs = {
                    "tier": tier.name,
                    "chunks": outcome.evicted_chunks,
                    "bytes": outcome.evicted_bytes,
                }
                self._bus.publish(Event(EventType.L2_EVICT, 0, op.session_id, None, attrs))
        with self._idle:
            remaining[0] -= 1
            last = remaining[0] == 0
            self._pending_calls -= 1
            if last:
                self._pending_bytes -= len(objs) * nbytes
            self._idle.notify_all()
        if last:
            self._l1.release(objs)

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
