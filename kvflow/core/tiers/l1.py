"""L1, the pinned host-memory tier: which objects exist, their bytes, pins, LRU, eviction.

It implements `HostTier` (`kvflow.core.tiers.base`): movers copy GPU blocks into and out
of its objects in place, and the generic `StorageTier` calls (contains, store, load, pin)
copy host bytes and answer at once. A store is two-phase:
`prepare_write` (and `extend_write`, for a plan made in steps) allocates invisible
objects, then `commit` publishes them or `abort` frees them, so a failed store
leaves nothing visible. Objects pinned by a
reader are never evicted. Recency is refreshed in reverse chunk order, so a
prefix's tail is evicted before its head (a lost head makes the tail useless).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvflow.core.tiers.base import StoreOutcome, WritePlan, check_buffers, completed
from kvflow.core.tiers.hostmem import HostPool
from kvflow.core.tiers.l1space import FreeSpace
from kvflow.core.tiers.pinahead import DEFAULT_THREADS, PinAhead
from kvflow.core.tiers.quota import Tenant, TenantQuotas

ALIGN = 256
DEFAULT_SEGMENT_BYTES = 1 << 30
#: the first segment pinned ahead is at most this big, so L1 holds memory within ~0.1 s
FIRST_PIN_BYTES = 256 << 20
#: the longest close() waits for a segment being pinned ahead (a GiB pins in ~0.3 s)
CLOSE_PIN_WAIT_S = 30.0

log = logging.getLogger(__name__)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class L1Object:
    """One chunk's storage: where it lives, whether it is readable, who reads it."""

    __slots__ = ("key", "nbytes", "offset", "pins", "ready", "segment", "size")

    def __init__(self, key: Hashable, segment: int, offset: int, nbytes: int, size: int):
        self.key = key
        self.segment = segment
        self.offset = offset
        self.nbytes = nbytes
        self.size = size  # aligned bytes reserved
        self.ready = False
        self.pins = 0


class L1Cache:
    """Thread-safe L1 index over a byte budget of host memory (a `HostTier`)."""

    name = "l1"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        pool: HostPool | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        tenants: TenantQuotas | None = None,
        pin_ahead: bool | None = None,
        pin_threads: int = DEFAULT_THREADS,
    ) -> None:
        """`pin_ahead` (default: when making the pool's segments is slow: pinned or
        faulted in) grows L1 to its capacity in the background from now on
        (`kvflow.core.tiers.pinahead`), so no store pins or first-touches memory."""
        if capacity_bytes < ALIGN:
            raise ValueError(f"L1 capacity must be at least {ALIGN} bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes
        self.pool = pool if pool is not None else HostPool()
        self._lock = threading.Lock()
        self._grown = threading.Condition(self._lock)  # a pinned-ahead segment arrived
        self._growing = 0  # bytes of segments being pinned ahead, not yet in _reserved
        self._closed = False
        self._index: dict[Hashable, L1Object] = {}
        self._lru: OrderedDict[Hashable, L1Object] = OrderedDict()  # ready objects only
        self._space = FreeSpace()  # the segments' free extents
        self._sizes: list[int] = []  # each segment's bytes (0 once released by a shrink)
        #: segments a shrink gives back: no new objects; live bytes left (released at 0)
        self._retiring: dict[int, int] = {}
        #: per-tenant usage and limits (kvflow.core.tiers.quota)
        self.tenants = tenants if tenants is not None else TenantQuotas()
        self._reserved = 0  # bytes of segments allocated
        self._usage = 0
        self._writing = 0
        #: plans whose copies were only queued: each committed by the first read after its
        #: `done()` (`commit_when_done`), or by `commit`
        self._landing: list[tuple[WritePlan, Callable[[], bool]]] = []
        self.evicted_chunks = 0
        self.evicted_bytes = 0
        want_ahead = self.pool.slow_to_make if pin_ahead is None else pin_ahead
        self._pinner: PinAhead | None = None
        if want_ahead:
            self._pinner = self._grow_ahead(capacity_bytes, pin_threads)

    # -- allocation ---------------------------------------------------------------

    def _alloc(self, key: Hashable, nbytes: int, plan: WritePlan) -> L1Object | None:
        """Room for one object (hold the lock): free space, else (while L1 is pinned ahead)
        an eviction, else a new segment; waits only for a segment being pinned ahead when
        nothing can be evicted. None: no room for it at all."""
        size = _align(nbytes)
        if self.tenants.limited and not self.tenants.make_room(
            key, size, lambda victim: self._evict(victim, plan)
        ):
            return None
        while True:
            found = self._space.alloc(size)
            if found is not None:
                return L1Object(key, *found, nbytes, size)
            room = self.capacity_bytes - self._reserved - self._growing
            ahead = self._pinner is not None and not self._pinner.done
            if room >= size and not ahead:
                return self._new_segment(key, nbytes, size, room)
            victim = self._evict_one()
            if victim is not None:
                plan.evicted_chunks += 1
                plan.evicted_bytes += victim.nbytes
                plan.evicted_keys.append(victim.key)
                off = self._space.alloc_in(victim.segment, size)
                if off is not None:
                    return L1Object(key, victim.segment, off, nbytes, size)
                continue
            if not ahead:
                return None
            self._grown.wait(0.05)  # releases the lock; the pinning threads settle under it

    def _new_segment(self, key: Hashable, nbytes: int, size: int, room: int) -> L1Object:
        """Grow on demand (memory not pinned ahead): a segment, and the object at its start."""
        seg_size = max(size, min(self.segment_bytes, room))
        seg = self.pool.add_segment(seg_size)
        added = self._space.add(seg_size)  # not inside the assert: -O would drop the call
        assert added == seg
        self._sizes.append(seg_size)
        self._reserved += seg_size
        off = self._space.alloc_in(seg, size)
        assert off is not None
        return L1Object(key, seg, off, nbytes, size)

    def _claim_segment(self) -> int:
        """PinAhead: reserve the next segment's bytes; 0 once L1 is (being) grown whole."""
        with self._lock:
            room = self.capacity_bytes - self._reserved - self._growing
            if self._closed or room < ALIGN:
                return 0
            size = min(self.segment_bytes, room)
            if not self._reserved and not self._growing:  # the first: L1 usable sooner
                size = min(size, FIRST_PIN_BYTES)
            self._growing += size
            return size

    def _settle_segment(self, size: int, segment: torch.Tensor | None) -> bool:
        """PinAhead: take a pinned segment (None: it failed; its claim is given back)."""
        with self._lock:
            self._growing -= size
            taken = segment is not None and not self._closed
            if taken:
                assert segment is not None
                self.pool.adopt(segment)
                self._space.add(size)
                self._sizes.append(size)
                self._reserved += size
            self._grown.notify_all()
        if segment is not None and not taken:
            self.pool.discard(segment)
        return taken

    def _evict_one(self) -> L1Object | None:
        for key, obj in self._lru.items():
            if obj.pins == 0:
                del self._lru[key]
                self._remove(obj, evicted=True)
                self.evicted_chunks += 1
                self.evicted_bytes += obj.nbytes
                return obj
        return None

    def _evict(self, obj: L1Object, plan: WritePlan | None) -> None:
        """Evict the readable, unpinned `obj` (a tenant's own, or a shrink's), counted."""
        del self._lru[obj.key]
        self._remove(obj, evicted=True)
        self.evicted_chunks += 1
        self.evicted_bytes += obj.nbytes
        if plan is not None:
            plan.evicted_chunks += 1
            plan.evicted_bytes += obj.nbytes
            plan.evicted_keys.append(obj.key)

    def _remove(self, obj: L1Object, *, evicted: bool = False) -> None:
        del self._index[obj.key]
        self._usage -= obj.size
        self.tenants.removed(obj, evicted=evicted)
        live = self._retiring.get(obj.segment)
        if live is None:
            self._space.free(obj.segment, obj.offset, obj.size)
        elif live - obj.size > 0:
            self._retiring[obj.segment] = live - obj.size
        else:
            self._release_segment(obj.segment)

    def _release_segment(self, seg: int) -> None:
        """Give a retiring segment's memory back (its last object just left; its bytes
        left `_reserved` when it began retiring, so L1 may grow meanwhile)."""
        del self._retiring[seg]
        self.pool.release_segment(seg)
        self._sizes[seg] = 0

    def _touch(self, objs: Sequence[L1Object]) -> None:
        lru = self._lru
        for obj in reversed(objs):
            if obj.ready:
                lru.move_to_end(obj.key)
        if self.tenants.limited:
            for obj in reversed(objs):
                self.tenants.touched(obj)

    # -- two-phase write ---------------------------------------------------------

    def prepare_write(self, keys: Sequence[Hashable], nbytes: int) -> WritePlan:
        """Allocate invisible objects for the keys not present, in order, evicting LRU.

        Stops at the first key no eviction can make room for; keys after it are
        not covered (they would be unreachable by a prefix lookup anyway).
        """
        plan = WritePlan(keys=(), covered=0)
        self.extend_write(plan, keys, nbytes)
        return plan

    def extend_write(self, plan: WritePlan, keys: Sequence[Hashable], nbytes: int) -> None:
        """Continue `plan` over `keys`, which start with the keys it has planned.

        A store plans its first chunks, starts copying them, then plans the rest:
        the result is the same plan as one `prepare_write` of all keys. Nothing is
        added once a key found no room.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"an L1 object holds at least one byte, got {nbytes!r}")
        start = len(plan.keys)
        # chunk keys are chained, so the last planned key standing for the prefix suffices
        if len(keys) < start or (start and keys[start - 1] != plan.keys[start - 1]):
            raise ValueError("extend_write needs keys that start with the plan's keys")
        complete = plan.covered == start
        plan.keys = keys
        if not complete:
            return
        with self._lock:
            present = [obj for key in keys if (obj := self._index.get(key)) is not None]
            for obj in present:  # protect this request's own prefix from eviction
                obj.pins += 1
            try:
                for i in range(start, len(keys)):
                    key = keys[i]
                    if key in self._index:
                        plan.covered = i + 1
                        continue
                    obj = self._alloc(key, nbytes, plan)
                    if obj is None:
                        break
                    if key in self._index:  # written meanwhile: _alloc waited unlocked
                        self._space.free(obj.segment, obj.offset, obj.size)
                        plan.covered = i + 1
                        continue
                    self._index[key] = obj
                    self._usage += obj.size
                    self.tenants.added(obj)
                    self._writing += 1
                    plan.new.append((i, obj))
                    plan.covered = i + 1
            finally:
                for obj in present:
                    obj.pins -= 1

    def commit(self, plan: WritePlan) -> None:
        """Make the plan's new objects visible and refresh the covered prefix's recency
        (once: a plan `commit_when_done` already committed is left as it is)."""
        with self._lock:
            self._commit(plan)

    def commit_when_done(self, plan: WritePlan, done: Callable[[], bool]) -> None:
        """Commit `plan` at the first read of L1 that finds `done()` true (its copies ran),
        unless `commit` comes first: a store that answers once its copies are queued
        (the caller waits for them itself) is seen by every read the caller makes next."""
        with self._lock:
            self._landing.append((plan, done))

    def _settle(self) -> None:
        """Commit the plans whose copies ran (call with the lock held, before a read)."""
        if self._landing:
            for plan in [plan for plan, done in self._landing if done()]:
                self._commit(plan)

    def _forget_landing(self, plan: WritePlan) -> None:
        """No read commits `plan` any more (committed or aborted; call with the lock held)."""
        if self._landing:
            self._landing = [entry for entry in self._landing if entry[0] is not plan]

    def _commit(self, plan: WritePlan) -> None:
        self._forget_landing(plan)
        if plan.committed:
            return
        plan.committed = True
        for _, obj in plan.new:
            obj.ready = True
            self._lru[obj.key] = obj
            self._writing -= 1
        covered = [o for k in plan.keys[: plan.covered] if (o := self._index.get(k))]
        self._touch(covered)

    def abort(self, plan: WritePlan) -> None:
        """Free the plan's new objects; none of them was ever visible (a plan whose
        copies may have failed is no longer committed by a read)."""
        with self._lock:
            self._forget_landing(plan)
            for _, new in plan.new:
                obj: L1Object = new
                if not obj.ready and self._index.get(obj.key) is obj:
                    self._remove(obj)
                    self._writing -= 1

    # -- reading -------------------------------------------------------------------

    def pin_prefix(self, keys: Sequence[Hashable]) -> list[L1Object]:
        """Pin the longest prefix of keys whose objects are readable; unpin() after use."""
        with self._lock:
            self._settle()
            out: list[L1Object] = []
            for key in keys:
                obj = self._index.get(key)
                if obj is None or not obj.ready:
                    break
                obj.pins += 1
                out.append(obj)
            self._touch(out)
            return out

    def release(self, objs: Sequence[L1Object]) -> None:
        """Undo `pin_prefix` for these objects."""
        with self._lock:
            for obj in objs:
                obj.pins -= 1

    def count_prefix(self, chunk_keys: Iterable[Sequence[Hashable]]) -> int:
        """Consecutive chunks from 0 whose every key (one per rank) is readable."""
        get = self._index.get
        with self._lock:
            self._settle()
            hits: list[L1Object] = []
            n = 0
            for keys in chunk_keys:
                if len(keys) == 1:  # one rank: the common case, kept free of per-chunk lists
                    obj = get(keys[0])
                    if obj is None or not obj.ready:
                        break
                    hits.append(obj)
                else:
                    objs = [get(k) for k in keys]
                    if not all(o is not None and o.ready for o in objs):
                        break
                    hits.extend(o for o in objs if o is not None)
                n += 1
            self._touch(hits)
            return n

    # -- the generic tier calls: host bytes in and out, answered before returning --------

    def contains(self, keys: Sequence[Hashable]) -> Future[list[bool]]:
        """Which keys have a readable object."""
        with self._lock:
            self._settle()
            return completed([(o := self._index.get(k)) is not None and o.ready for k in keys])

    def store(self, items: Sequence[tuple[Hashable, torch.Tensor]]) -> Future[StoreOutcome]:
        """Copy each key's bytes into a new object unless the key is present; a key that
        finds no room (everything else pinned) counts as failed."""
        check_buffers([buf for _, buf in items], "items' bytes")
        stored = present = failed = evicted_chunks = evicted_bytes = 0
        for key, buf in items:
            plan = self.prepare_write([key], buf.numel())
            evicted_chunks += plan.evicted_chunks
            evicted_bytes += plan.evicted_bytes
            if not plan.covered:
                failed += 1
                continue
            if not plan.new:
                present += 1
                continue
            try:
                self.view(plan.new[0][1]).copy_(buf)
            except BaseException:
                self.abort(plan)
                raise
            self.commit(plan)
            stored += 1
        return completed(StoreOutcome(stored, present, failed, evicted_chunks, evicted_bytes))

    def load(self, keys: Sequence[Hashable], dsts: Sequence[torch.Tensor]) -> Future[list[bool]]:
        """Copy each readable object into its destination (pinned meanwhile); False for a
        missing key or a destination of another size."""
        if len(keys) != len(dsts):
            raise ValueError(f"load needs one destination per key: {len(keys)} keys, {len(dsts)}")
        check_buffers(dsts, "dsts")
        landed: list[bool] = []
        for key, dst in zip(keys, dsts, strict=True):
            objs = self.pin_prefix([key])
            try:
                ok = bool(objs) and objs[0].nbytes == dst.numel()
                if ok:
                    dst.copy_(self.view(objs[0]))
            finally:
                self.release(objs)
            landed.append(ok)
        return completed(landed)

    def pin(self, keys: Sequence[Hashable]) -> int:
        """Pin the longest readable prefix of keys; returns its length."""
        return len(self.pin_prefix(keys))

    def unpin(self, keys: Sequence[Hashable]) -> None:
        """Undo one `pin` of each key."""
        with self._lock:
            objs = [self._index.get(key) for key in keys]
            wanted = Counter(objs)  # a key listed twice is unpinned twice
            for key, obj in zip(keys, objs, strict=True):
                if obj is None or obj.pins < wanted[obj]:
                    raise ValueError(f"unpin of key {key!r}, which is not pinned")
            for obj in objs:
                assert obj is not None
                obj.pins -= 1

    def view(self, obj: L1Object) -> torch.Tensor:
        """The object's bytes (uint8, 1-D). Valid while the object is pinned or being written."""
        return self.pool.view(obj.segment, obj.offset, obj.nbytes)

    def views(self, objs: Sequence[L1Object]) -> ObjectViews:
        """The objects' bytes as a lazy sequence: each view is made when a mover reaches it."""
        return ObjectViews(self, objs)

    # -- maintenance -----------------------------------------------------------------

    def drop_where(self, predicate: Callable[[Any], bool]) -> int:
        """Remove every readable, unpinned object whose key matches; returns how many."""
        with self._lock:
            doomed = [o for k, o in self._lru.items() if o.pins == 0 and predicate(k)]
            for obj in doomed:
                del self._lru[obj.key]
                self._remove(obj)
            return len(doomed)

    def resize(self, capacity_bytes: int) -> dict[str, int]:
        """Change the byte budget live. Growing raises it and, when L1 pins ahead, pins
        the new room in the background (else L1 grows into it on demand). Shrinking
        retires the last segments until the rest fit: no new object goes there, every
        readable unpinned object there is evicted now, and each segment's memory is given
        back once its last object (pinned by a reader or being written meanwhile, never
        dropped) leaves. A retiring segment no longer counts as reserved: L1 may grow
        within the new budget meanwhile, so host memory can exceed it by the bytes
        still pinned there. Returns the outcome in bytes."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ValueError(f"L1 capacity must be an integer of bytes, got {capacity_bytes!r}")
        if capacity_bytes < ALIGN:
            raise ValueError(f"L1 capacity must be at least {ALIGN} bytes, got {capacity_bytes}")
        with self._lock:
            before = self.evicted_chunks
            grew = capacity_bytes > self.capacity_bytes
            self.capacity_bytes = capacity_bytes
            active = [s for s, n in enumerate(self._sizes) if n and s not in self._retiring]
            kept = sum(self._sizes[s] for s in active)
            doomed: dict[int, int] = {}
            while active and kept > capacity_bytes:
                seg = active.pop()
                kept -= self._sizes[seg]
                doomed[seg] = 0
            if doomed:
                for obj in self._index.values():
                    if obj.segment in doomed:
                        doomed[obj.segment] += obj.size
                for seg, live in doomed.items():
                    self._space.retire(seg)  # nothing is allocated there any more
                    self._retiring[seg] = live
                    self._reserved -= self._sizes[seg]
                    if not live:
                        self._release_segment(seg)
                for obj in [o for o in self._lru.values() if o.segment in doomed and o.pins == 0]:
                    self._evict(obj, None)
            outcome = {
                "capacity_bytes": self.capacity_bytes,
                "reserved_bytes": self._reserved,
                "usage_bytes": self._usage,
                "evicted_chunks": self.evicted_chunks - before,
                "retiring_bytes": sum(self._retiring.values()),
            }
            room = self.capacity_bytes - self._reserved - self._growing
        pinner = self._pinner
        if grew and pinner is not None and pinner.done and room >= ALIGN:  # pin the growth ahead
            self._pinner = self._grow_ahead(room, DEFAULT_THREADS)
        return outcome

    def _grow_ahead(self, nbytes: int, threads: int) -> PinAhead:
        """Start making `nbytes` more of segments in the background (pinned, or faulted
        in for a prefaulting pool)."""
        return PinAhead(
            nbytes, self.segment_bytes, claim=self._claim_segment,
            make=self.pool.make_segment, settle=self._settle_segment, threads=threads,
            mode="prefault" if self.pool.prefault else "pin",
        )  # fmt: skip

    def set_quota(self, tenant: Tenant, nbytes: int | None) -> dict[str, int]:
        """Give a tenant a byte limit (None: none) and evict its own LRU objects now
        until it fits (never pinned or in-flight ones); returns its usage and evictions."""
        with self._lock:
            before = self.evicted_chunks
            self.tenants.set_limit(tenant, nbytes, self._lru.values())
            if nbytes is not None:
                self.tenants.shed(tenant, lambda victim: self._evict(victim, None))
            return {
                "usage_bytes": self.tenants.usage(tenant),
                "evicted_chunks": self.evicted_chunks - before,
            }

    def tenant_stats(self) -> list[dict[str, object]]:
        """Per-tenant usage, limits, evictions and lookup hits (`TenantQuotas.snapshot`)."""
        with self._lock:
            return self.tenants.snapshot()

    def pinning_paused(self) -> contextlib.AbstractContextManager[None]:
        """A block during which L1 pins nothing ahead (`PinAhead.paused`), for a caller's
        CUDA calls; nothing to hold when L1 grows on demand or has finished growing.
        `_pinner` is read without the lock: a reference, replaced only by `resize`."""
        pinner = self._pinner
        return contextlib.nullcontext() if pinner is None or pinner.done else pinner.paused()

    def pin_state(self) -> dict[str, Any] | None:
        """How far pinning L1 ahead has got (`PinAhead.state`); None when L1 grows on demand."""
        return None if self._pinner is None else self._pinner.state()

    def stats(self) -> dict[str, int]:
        """usage/capacity/objects (readable)/writing/evictions/host bytes reserved."""
        with self._lock:
            self._settle()
            return {
                "usage_bytes": self._usage,
                "capacity_bytes": self.capacity_bytes,
                "objects": len(self._lru),
                "writing": self._writing,
                "evicted_chunks": self.evicted_chunks,
                "evicted_bytes": self.evicted_bytes,
                "reserved_bytes": self._reserved,
            }

    def close(self) -> None:
        """Forget every object and release the host memory, then wait (up to
        CLOSE_PIN_WAIT_S) for the threads pinning ahead to finish the segment they are
        making, which they give back: a thread still inside the driver's registration when
        the process exits aborts the process (its GIL wait ends in a C++ terminate)."""
        with self._lock:
            self._closed = True
            self._grown.notify_all()
            self._index.clear()
            self._lru.clear()
            self._landing.clear()
            self._space.clear()
            self._reserved = self._usage = self._writing = 0
            self.pool.release()
        if self._pinner is not None:
            self._pinner.join(CLOSE_PIN_WAIT_S)
            if not self._pinner.done:
                log.warning(
                    "L1 closed while a segment was still being pinned after %.0f s",
                    CLOSE_PIN_WAIT_S,
                )


class ObjectViews:
    """An op's L1 objects as a mover's `HostChunks`: `L1Cache.view` of each, made on
    access (a view costs microseconds; a request has dozens), or its address, for
    movers that copy through the driver and need no view."""

    def __init__(self, l1: L1Cache, objs: Sequence[L1Object]) -> None:
        self._l1 = l1
        self._objs = objs

    def __len__(self) -> int:
        return len(self._objs)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._l1.view(self._objs[index])

    def address(self, index: int, nbytes: int) -> int:
        """Host address of object `index`'s bytes; ValueError unless it holds `nbytes`."""
        obj = self._objs[index]
        if obj.nbytes != nbytes:
            raise ValueError(f"L1 object {index} holds {obj.nbytes} bytes, not {nbytes}")
        return self._l1.pool.address(obj.segment, obj.offset)

    def region(self, index: int) -> int:
        """The L1 segment object `index` lies in (each segment is pinned on its own)."""
        return self._objs[index].segment
