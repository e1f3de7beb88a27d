"""One-pass LRU simulation of L1 over a `Trace`: every capacity's hits at once.

The model is L1's own (kvflow/core/tiers/l1.py): a store or a retrieve touches a
prefix of chunks, tail first, so the prefix's head ends most recent; eviction
takes the least recently touched object. A lookup only asks: it never changes the
cache here. (L1 also refreshes a lookup's hits, but in the lookup -> retrieve ->
store sequence of one request the store refreshes them all again before anything
else is evicted, so the contents are the same; docs/EVENTLOG.md says when not.)

For each lookup chunk the simulation computes its LRU stack distance in bytes:
the bytes of the objects touched no earlier than it (itself included), using a
Fenwick tree over touch times weighted by object size (Mattson et al., 1970; the
tree makes each distance O(log n)). A chunk is an L1 hit at capacity C exactly
when its distance, and that of every chunk before it in the lookup (and of its
object on every rank), is at most C. Because every touch covers a prefix, head
first in recency, those distances grow along a lookup, so the prefix rule costs
nothing extra; it is applied anyway.

Sampled mode (SHARDS, Waldspurger et al., FAST 2015): only keys the deterministic
`Sampler` keeps are simulated, each object weighing size / rate, so distances
come out in full-cache bytes. Hits are estimated as all lookup chunks (counted
exactly) less the sampled misses scaled by 1 / rate (the SHARDS-adj correction:
the shortfall of sampled references is credited to the hottest keys, i.e. hits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvflow.core.replay.trace import LOOKUP, Trace
from kvflow.events import Sampler

INF = math.inf
ALIGN = 256  # L1 reserves object bytes in multiples of this (kvflow/core/tiers/l1.py)
L1_SEGMENT_BYTES = 1 << 30  # and allocates host memory in segments of at most this


@dataclass
class Distances:
    """The stack distance (bytes; inf = never touched) of every simulated lookup chunk."""

    distances: np.ndarray  # float64, sorted
    lookup_chunks: int  # lookup chunks in the whole trace (sampled or not)
    rate: float  # 1.0 = exact

    def hit_chunks(self, capacity_bytes: float) -> float:
        """Lookup chunks that hit at this effective capacity (scaled up when sampled)."""
        n = int(np.searchsorted(self.distances, capacity_bytes, side="right"))
        if self.rate >= 1.0:
            return float(n)
        # SHARDS-adj: scale the sampled *misses*, not the hits. Misses fall on many cold
        # keys (low variance); hits concentrate on a few hot prefixes, whose being
        # sampled or not would swing a hit-scaled estimate by their whole share
        misses = (len(self.distances) - n) / self.rate
        return min(max(self.lookup_chunks - misses, 0.0), float(self.lookup_chunks))


def aligned(nbytes: int) -> int:
    """Bytes L1 reserves for an object of `nbytes`."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def effective_capacity(capacity_bytes: int, object_bytes: int) -> int:
    """The bytes of whole objects an L1 of `capacity_bytes` holds, segment by segment
    as L1 allocates them: objects never straddle a segment."""
    size = aligned(object_bytes)
    if size <= 0:
        return capacity_bytes
    room, objects = capacity_bytes, 0
    while room >= size:
        seg = max(size, min(L1_SEGMENT_BYTES, room))
        objects += seg // size
        room -= seg
    return objects * size


def simulate(trace: Trace, *, rate: float = 1.0, seed: int = 0) -> Distances:
    """Stack distances of the trace's lookup chunks; `rate` < 1 samples keys (SHARDS)."""
    keys = trace.keys
    start = trace.start
    kinds = trace.kind.tolist()
    spaces = trace.space.tolist()
    worlds = trace.world.tolist()
    lengths = np.diff(start)
    lookup_chunks = int(lengths[trace.kind == LOOKUP].sum())
    if rate >= 1.0:
        positions = None
        key_list = keys.tolist()
        n_touch_slots = int(lengths[trace.kind != LOOKUP].sum())
    else:
        keep = Sampler(rate, seed).keep_mask(ids=keys.view(np.int64))
        positions = np.flatnonzero(keep)
        key_list = keys[positions].tolist()
        # per op, the range of kept positions it covers
        bounds = np.searchsorted(positions, start).tolist()
        n_touch_slots = len(key_list)
    scale = 1.0 / rate
    weight = {s: aligned(b) * scale for s, b in trace.space_bytes.items()}
    default_w = aligned(trace.object_bytes() or 1) * scale
    tree = [0.0] * (n_touch_slots + 2)
    size = len(tree) - 1
    last: list[dict[int, int]] = [{} for _ in range(max(trace.spaces.values(), default=-1) + 2)]
    total = 0.0
    clock = 0
    out: list[float] = []
    append = out.append
    starts = start.tolist()
    for i, kind in enumerate(kinds):
        if positions is None:
            lo, hi = starts[i], starts[i + 1]
        else:
            lo, hi = bounds[i], bounds[i + 1]
        if lo == hi:
            continue
        base = spaces[i]
        if kind == LOOKUP:
            world = worlds[i]
            worst = 0.0
            for j in range(lo, hi):
                k = key_list[j]
                if worst != INF:
                    for r in range(world):
                        t = last[base + r].get(k)
                        if t is None:
                            worst = INF
                            break
                        # bytes touched at times >= t: total - prefix(t - 1)
                        s, x = 0.0, t - 1
                        while x > 0:
                            s += tree[x]
                            x &= x - 1
                        d = total - s
                        if d > worst:
                            worst = d
                append(worst)
            continue
        w = weight.get(base, default_w)
        seen = last[base]
        for j in range(hi - 1, lo - 1, -1):  # tail first: the head ends most recent
            k = key_list[j]
            t = seen.get(k)
            if t is not None:
                x = t
                while x <= size:
                    tree[x] -= w
                    x += x & -x
            else:
                total += w
            clock += 1
            x = clock
            while x <= size:
                tree[x] += w
                x += x & -x
            seen[k] = clock
    return Distances(np.sort(np.asarray(out, dtype=np.float64)), lookup_chunks, min(rate, 1.0))
