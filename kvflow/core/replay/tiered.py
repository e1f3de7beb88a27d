"""Exact simulation of L1 with one LRU L2 tier behind it, over a `Trace`.

`kvflow whatif --l2-size-gb` (docs/EVENTLOG.md, "L2"). Unlike lru.py's one-pass
stack distances, this replays the trace op by op against two ordered dicts, once
per (L1 size, L2 size) pair: L1's contents now depend on L2 (chunks loaded from L2
are written back into L1), so one L1 pass no longer answers every size.

The model, as the engine does it (kvflow/core/engine/cache_engine.py, tiering.py,
writethrough.py; kvflow/core/tiers/disk.py):

- L1 is lru.py's: objects of their aligned size, LRU eviction, a store or a retrieve
  touches its chunks tail first (the head ends most recent); a lookup refreshes the
  run of chunks from chunk 0 that L1 holds (lru.py need not: there, nothing is
  evicted between a lookup and its request's store; here the prefetch evicts).
- A store writes through to L2 the chunks it newly put in L1 (not those L1 already
  held) and L1 still holds, head first, each inserted into L2 unless L2 holds it
  already (a present key is not refreshed, as the disk tier's store does); L2 counts
  payload bytes and evicts least recently used objects; an object larger than L2 is
  not stored. The write-through backlog holds `BACKLOG_SHARE` of L1's configured
  bytes (whole chunks): a store's new chunks go in batches of that many, each
  submitted once the one before finished (writethrough.py waits for backlog room,
  up to --l2-backlog-wait-s, instead of refusing). Each batch pins its chunks in
  L1, which refreshes them (tail first): after a store, its new chunks are L1's
  most recent, ahead of the chunks L1 already held, its last batch newest.
- A lookup's prefix extends while each chunk is, on every rank of the world, in L1
  or L2; a chunk counts for the slowest tier one of its ranks needed (L1, else L2),
  as `hit_tokens_by_tier` does. When some chunk of the prefix needed L2, the
  lookup's prefetch takes the chunks from the first that needed L2, as many as fit
  in `PREFETCH_SHARE` of L1's configured bytes (tiering.py; the rest load at
  retrieve), in order: each one's L1 objects are pinned (refreshed, never evicted
  by the prefetch) and room is made in L1 for its L2-only objects (loads.py
  reserves it, evicting L1's least recent). One load refreshes those in L2 (head
  most recent); the write-back commits them to L1 in order (the tail ends newest).
  A position that finds no room ends the prefetch (its own loads discarded).
- A retrieve touches its recorded chunks (the live hit prefix, L2 loads included) in
  L1, tail first, up to the first that neither L1 nor L2 holds here (at sizes other
  than the run's the simulated hits differ from the recorded ones; the request's
  store, which follows, puts the rest in L1 and writes them through); a chunk not in
  L1 (one the prefetch left out) is first refreshed in L2 (a load), then written
  back into L1.

What it assumes (exact on a run that meets it; tested): every write-through
completes before the next lookup and never fails, the backlog is empty at each
store and no batch waits past --l2-backlog-wait-s (a batch still without room then
is dropped), the lookup's prefetch runs (layouts registered, L2 write-back on), L1
is larger than a request (a store larger than free L1 streams through it in
windows, and a retrieve missing more than half of L1 loads window by window:
neither is modelled), one L2 tier (a Redis tier's approximate LRU is modelled as
exact LRU on payload bytes), no salts.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvflow.core.config import BACKLOG_SHARE, PREFETCH_SHARE
from kvflow.core.replay.lru import aligned
from kvflow.core.replay.trace import LOOKUP, Trace

#: an object: (namespace id, chunk key)
_Obj = tuple[int, int]


class _Lru:
    """Objects by recency (oldest first) with a byte capacity."""

    __slots__ = ("capacity", "objects", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self.objects: OrderedDict[_Obj, int] = OrderedDict()

    def __contains__(self, obj: _Obj) -> bool:
        return obj in self.objects

    def refresh(self, obj: _Obj) -> None:
        """Make `obj` most recent if held."""
        if obj in self.objects:
            self.objects.move_to_end(obj)

    def insert(self, obj: _Obj, nbytes: int) -> bool:
        """Add `obj` as most recent, evicting the least recent for room; False (nothing
        changed) when it is held already or larger than the capacity."""
        if obj in self.objects or nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            _, freed = self.objects.popitem(last=False)
            self.used -= freed
        self.objects[obj] = nbytes
        self.used += nbytes
        return True

    def reserve(self, nbytes: int, keep: set[_Obj]) -> bool:
        """Make room for `nbytes` more, evicting the least recent objects not in `keep`,
        and count them used (an object not visible yet: `commit` adds it); False (nothing
        changed) when the others leave too little room."""
        need = self.used + nbytes - self.capacity
        victims: list[_Obj] = []
        for obj, held in self.objects.items():
            if need <= 0:
                break
            if obj not in keep:
                victims.append(obj)
                need -= held
        if need > 0:
            return False
        for obj in victims:
            self.used -= self.objects.pop(obj)
        self.used += nbytes
        return True

    def commit(self, obj: _Obj, nbytes: int) -> None:
        """Add a `reserve`d object as most recent (its bytes counted already)."""
        self.objects[obj] = nbytes

    def touch(self, obj: _Obj, nbytes: int) -> bool:
        """Refresh `obj`, or insert it; True when it was inserted."""
        if obj in self.objects:
            self.objects.move_to_end(obj)
            return False
        return self.insert(obj, nbytes)


@dataclass(frozen=True)
class TierHits:
    """Lookup chunks that hit, by the tier they counted for."""

    l1_chunks: int
    l2_chunks: int

    @property
    def chunks(self) -> int:
        return self.l1_chunks + self.l2_chunks


class _Tiers:
    """L1 and L2 as the engine runs them (the module docstring's model) and the lookup
    chunks that hit each: `simulate_tiers` feeds it the trace's ops in order."""

    __slots__ = ("backlog", "default", "l1", "l1_hits", "l2", "l2_hits", "prefetch_budget", "raw")

    def __init__(self, trace: Trace, l1_capacity: int, l2_capacity: int, configured: int) -> None:
        self.backlog = int(configured * BACKLOG_SHARE)
        self.prefetch_budget = int(configured * PREFETCH_SHARE)
        self.default = trace.object_bytes() or 1
        self.raw = trace.space_bytes
        self.l1, self.l2 = _Lru(l1_capacity), _Lru(l2_capacity)
        self.l1_hits = self.l2_hits = 0

    def lookup(self, base: int, world: int, chunk_keys: list[int]) -> None:
        """Count the hit prefix, each chunk for the slowest tier one of its ranks needed;
        refresh in L1 the objects of its chunks before the first that needed L2, and
        prefetch from that one on."""
        l1, l2 = self.l1, self.l2
        # from the first position that needed L2: each one's objects and which of them
        # only L2 holds (the engine's prefetch rows)
        rows: list[tuple[list[_Obj], list[_Obj]]] = []
        in_l1: list[_Obj] = []  # objects of the chunks before the first that needed L2
        l1_hits = l2_hits = 0
        for k in chunk_keys:
            objs = [(base + r, k) for r in range(world)]
            from_l2: list[_Obj] = []
            for obj in objs:
                if obj in l1:
                    continue
                if obj not in l2:
                    break
                from_l2.append(obj)
            else:
                if from_l2:
                    l2_hits += 1
                else:
                    l1_hits += 1
                if from_l2 or rows:
                    rows.append((objs, from_l2))
                else:
                    in_l1 += objs
                continue
            break
        self.l1_hits += l1_hits
        self.l2_hits += l2_hits
        for obj in reversed(in_l1):  # L1 refreshes its lookup hits, head most recent
            l1.refresh(obj)
        if rows:
            self._prefetch(base, world, rows)

    def _prefetch(self, base: int, world: int, rows: list[tuple[list[_Obj], list[_Obj]]]) -> None:
        """The lookup's prefetch, of the rows that fit in its share of L1: L1's objects
        pinned, L2's loaded into room reserved in L1 (a row without room ends it)."""
        l1, raw, default = self.l1, self.raw, self.default
        row_bytes = sum(raw.get(base + r, default) for r in range(world))
        fit = max(1, self.prefetch_budget // max(1, row_bytes))
        pinned: set[_Obj] = set()
        loads: list[_Obj] = []
        kept = 0  # loads of the rows that found room in L1
        for objs, from_l2 in rows[:fit]:
            room = True
            for obj in objs:  # in order: L1's objects pinned, L2's reserved in L1
                if obj not in from_l2:
                    l1.refresh(obj)
                    pinned.add(obj)
                elif l1.reserve(aligned(raw.get(obj[0], default)), pinned):
                    loads.append(obj)
                else:
                    room = False
                    break
            if not room:  # no row after it is loaded; its own loads are discarded
                for obj in loads[kept:]:
                    l1.used -= aligned(raw.get(obj[0], default))
                break
            kept = len(loads)
        l2 = self.l2
        for obj in reversed(loads):  # one load: L2 refreshes them, head most recent
            l2.refresh(obj)
        for obj in loads[:kept]:  # write-back commits them in order: tail newest
            l1.commit(obj, aligned(raw.get(obj[0], default)))

    def retrieve(self, base: int, chunk_keys: list[int]) -> None:
        """Touch the recorded chunks L1 or L2 holds, from chunk 0, tail first; one only
        L2 holds is loaded (refreshed in L2) and written back into L1."""
        l1, l2 = self.l1, self.l2
        size = aligned(self.raw.get(base, self.default))
        obj_keys = [(base, k) for k in chunk_keys]
        got = 0  # the recorded chunks this L1 and L2 hold, from chunk 0
        while got < len(obj_keys) and (obj_keys[got] in l1 or obj_keys[got] in l2):
            got += 1
        for obj in reversed(obj_keys[:got]):
            if obj not in l1:
                l2.refresh(obj)
            l1.touch(obj, size)

    def store(self, base: int, chunk_keys: list[int]) -> None:
        """Touch the chunks in L1, tail first, and write the new ones it still holds
        through to L2."""
        l1, l2 = self.l1, self.l2
        nbytes = self.raw.get(base, self.default)
        size = aligned(nbytes)
        obj_keys = [(base, k) for k in chunk_keys]
        new = [obj for obj in reversed(obj_keys) if l1.touch(obj, size)]
        if l2.capacity:
            # write-through of the new chunks L1 still holds, head first, in batches of
            # the backlog bound (the first waits for nothing; each next one waits for
            # the one before to finish): each batch pins its chunks in L1, tail first (a
            # pin refreshes: the batch's head ends most recent), then L2 stores them
            written = [obj for obj in reversed(new) if obj in l1]
            per = max(1, self.backlog // nbytes) if nbytes else len(written) or 1
            for b in range(0, len(written), per):
                batch = written[b : b + per]
                for obj in reversed(batch):
                    l1.refresh(obj)
                for obj in batch:
                    l2.insert(obj, nbytes)


def simulate_tiers(
    trace: Trace, l1_capacity: int, l2_capacity: int, l1_configured: int | None = None
) -> TierHits:
    """Replay `trace` against an L1 of `l1_capacity` bytes of aligned objects (as
    `effective_capacity` gives) and an L2 of `l2_capacity` payload bytes (0: none).
    `l1_configured` is L1's configured bytes (default `l1_capacity`), which bounds
    the write-through backlog."""
    configured = l1_configured if l1_configured is not None else l1_capacity
    tiers = _Tiers(trace, l1_capacity, l2_capacity, configured)
    lookup, retrieve, store = tiers.lookup, tiers.retrieve, tiers.store
    keys = trace.keys.tolist()
    start = trace.start.tolist()
    kinds, spaces, worlds = trace.kind.tolist(), trace.space.tolist(), trace.world.tolist()
    retrieves = trace.retrieve.tolist() if trace.retrieve is not None else [False] * len(kinds)
    for i, (kind, base, world, is_retrieve) in enumerate(
        zip(kinds, spaces, worlds, retrieves, strict=True)
    ):
        chunk_keys = keys[start[i] : start[i + 1]]
        if kind == LOOKUP:
            lookup(base, world, chunk_keys)
        elif is_retrieve:
            retrieve(base, chunk_keys)
        else:
            store(base, chunk_keys)
    return TierHits(tiers.l1_hits, tiers.l2_hits)
