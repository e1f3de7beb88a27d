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

Sampled mode (SHARDS spatial sampling, Waldspurger et al., FAST 2015): only keys
the deterministic `Sampler` keeps (the L0 subscriber's hash) are simulated, each
object weighing size / rate, so distances come out in full-cache bytes. Because a
lookup's hit is a prefix and distances grow along it (above), a chunk hits exactly
when its own distance is within the capacity: per-chunk hits are the prefix hits,
and the sampled chunks estimate them without seeing their neighbours.

The estimate is post-stratified by popularity (`Strata`). Spatial sampling at 1%
gives a key's every reference or none, and a moderately popular key that misses
hundreds of times swings plain scaling (SHARDS, or SHARDS-adj: all lookup chunks
less sampled misses / rate) by its whole count. So every lookup chunk is put in a
stratum by how often its key is looked up in the whole log (a count-min sketch over
all lookup keys, numpy, one pass), the exact number of lookup chunks of each
stratum is counted, and each stratum's misses are its exact chunk count times the
miss ratio of its sampled chunks (a ratio estimator; SHARDS-adj's correction of the
sampled reference count to the expected one, done per stratum). A stratum with no
sampled chunk (the few hottest keys, or a sparse band) takes its miss ratio from
the sampled strata around it, log-linearly in the keys' mean count; above the
hottest sampled stratum as r ** (count / its count), the independent-reference
model's exp(-count * t) (docs/EVENTLOG.md says what this assumes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvflow.core.replay.trace import LOOKUP, Trace
from kvflow.events import Sampler

INF = math.inf
ALIGN = 256  # L1 reserves object bytes in multiples of this (kvflow/core/tiers/l1.py)
L1_SEGMENT_BYTES = 1 << 30  # and allocates host memory in segments of at most this


#: strata per doubling of a key's lookup count (bands of a factor sqrt(2))
STRATA_PER_DOUBLING = 2
#: floor for a miss ratio interpolated in log space
_RATIO_FLOOR = 1e-9


@dataclass
class Strata:
    """A sampled run's popularity strata: which stratum each sampled lookup chunk is in,
    and every stratum's exact lookup chunks and mean key count, over the whole trace."""

    of_sample: np.ndarray  # int64, per sampled lookup chunk (Distances.distances order)
    chunks: np.ndarray  # float64, per stratum: lookup chunks of the whole trace
    mean_count: np.ndarray  # float64, per stratum: lookup chunks per key (sketch counts)

    def miss_ratios(self, missed: np.ndarray) -> np.ndarray:
        """Each stratum's estimated miss ratio given which sampled chunks missed."""
        n = len(self.chunks)
        sampled = np.bincount(self.of_sample, minlength=n).astype(np.float64)
        misses = np.bincount(self.of_sample, weights=missed, minlength=n)
        have = np.flatnonzero(sampled > 0)
        if not len(have):
            return np.full(n, math.nan)
        ratio = np.zeros(n)
        ratio[have] = misses[have] / sampled[have]
        x = self.mean_count
        lo, hi = int(have[0]), int(have[-1])
        ratio[:lo] = ratio[lo]
        gap = np.arange(lo, hi + 1)
        gap = gap[sampled[gap] == 0]
        if len(gap):
            logs = np.log(np.maximum(ratio[have], _RATIO_FLOOR))
            ratio[gap] = np.exp(np.interp(x[gap], x[have], logs))
        if hi + 1 < n:
            ratio[hi + 1 :] = ratio[hi] ** (x[hi + 1 :] / x[hi])
        return ratio


@dataclass
class Distances:
    """The stack distance (bytes; inf = never touched) of every simulated lookup chunk:
    exact, sorted; sampled, in log order with their strata."""

    distances: np.ndarray  # float64
    lookup_chunks: int  # lookup chunks in the whole trace (sampled or not)
    rate: float  # 1.0 = exact
    strata: Strata | None = None  # set when sampled

    def hit_chunks(self, capacity_bytes: float) -> float:
        """Lookup chunks that hit at this effective capacity (estimated when sampled;
        nan when no lookup chunk was sampled)."""
        if self.strata is None:
            return float(np.searchsorted(self.distances, capacity_bytes, side="right"))
        ratio = self.strata.miss_ratios(self.distances > capacity_bytes)
        misses = float((self.strata.chunks * ratio).sum())
        if math.isnan(misses):
            return math.nan
        return min(max(self.lookup_chunks - misses, 0.0), float(self.lookup_chunks))


#: numpy passes over long arrays go this many elements at a time (cache-resident)
_BLOCK = 1 << 16


def keep_mask(sampler: Sampler, keys: np.ndarray) -> np.ndarray:
    """`sampler.keep_mask` over `keys` (uint64), a block at a time: the same decisions,
    several times faster than one pass of temporaries the size of the whole array."""
    out = np.empty(len(keys), dtype=bool)
    ids = keys.view(np.int64)
    for i in range(0, len(keys), _BLOCK):
        out[i : i + _BLOCK] = sampler.keep_mask(ids=ids[i : i + _BLOCK])
    return out


_SKETCH_MULTS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F))
#: strata kept: counts below 2**32
_MAX_STRATA = 32 * STRATA_PER_DOUBLING + 1


def _sketch(keys: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A count-min sketch of `keys` (two rows of multiplicative hashes): each row's
    slot per key and its table of counts."""
    n = len(keys)
    bits = min(max(n.bit_length() - 1, 10), 20)
    shift = np.uint64(64 - bits)
    slots, tables = [], []
    for mult in _SKETCH_MULTS:
        slot = np.empty(n, dtype=np.intp)
        for i in range(0, n, _BLOCK):
            slot[i : i + _BLOCK] = (keys[i : i + _BLOCK] * mult) >> shift
        slots.append(slot)
        tables.append(np.bincount(slot, minlength=1 << bits))
    return slots, tables


def key_counts(keys: np.ndarray) -> np.ndarray:
    """How often each of `keys` occurs among them, estimated by a count-min sketch:
    never less than the true count, rarely more."""
    (s1, s2), (t1, t2) = _sketch(keys)
    return np.minimum(t1[s1], t2[s2]) if len(keys) else np.zeros(0, dtype=np.int64)


def _stratum(counts: np.ndarray) -> np.ndarray:
    """The popularity stratum of a key looked up `counts` times (bands of sqrt(2))."""
    return (np.log2(np.maximum(counts, 1)) * STRATA_PER_DOUBLING + 1e-9).astype(np.intp)


def strata_of(lookup_keys: np.ndarray, kept: np.ndarray) -> Strata:
    """Popularity strata of a trace's lookup chunks (`lookup_keys`, in log order), for
    the sampled ones (`kept`, a mask over them); a block at a time."""
    (s1, s2), (t1, t2) = _sketch(lookup_keys)
    chunks = np.zeros(_MAX_STRATA)
    keys = np.zeros(_MAX_STRATA)
    of_sample = []
    for i in range(0, len(lookup_keys), _BLOCK):
        counts = np.minimum(t1[s1[i : i + _BLOCK]], t2[s2[i : i + _BLOCK]])
        stratum = np.minimum(_stratum(counts), _MAX_STRATA - 1)
        chunks += np.bincount(stratum, minlength=_MAX_STRATA)
        keys += np.bincount(stratum, weights=1.0 / counts, minlength=_MAX_STRATA)
        of_sample.append(stratum[kept[i : i + _BLOCK]])
    n = int(np.flatnonzero(chunks)[-1]) + 1 if chunks.any() else 1
    chunks, keys = chunks[:n], keys[:n]
    floor = 2.0 ** (np.arange(n) / STRATA_PER_DOUBLING)
    mean = np.where(keys > 0, chunks / np.maximum(keys, 1e-300), floor)
    sample = np.concatenate(of_sample) if of_sample else np.zeros(0, dtype=np.intp)
    return Strata(sample.astype(np.int64), chunks, mean)


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


class _Ops(NamedTuple):
    """The ops a simulation walks, as lists: kind, namespace id and world per op, and its
    range [lo, hi) of `keys` (the keys simulated, in log order)."""

    kinds: list[int]
    spaces: list[int]
    worlds: list[int]
    los: list[int]
    his: list[int]
    keys: list[int]
    touch_slots: int  # touches among them: the Fenwick tree's size


def _exact_ops(trace: Trace, lengths: np.ndarray, is_lookup: np.ndarray) -> _Ops:
    """Every op of the trace, every key."""
    start = trace.start
    return _Ops(
        trace.kind.tolist(), trace.space.tolist(), trace.world.tolist(),
        start[:-1].tolist(), start[1:].tolist(), trace.keys.tolist(),
        int(lengths[~is_lookup].sum()),
    )  # fmt: skip


def _sampled_ops(trace: Trace, keep: np.ndarray, lookup_key: np.ndarray) -> _Ops:
    """The ops that cover kept key positions (`keep`, a mask over the trace's keys;
    `lookup_key`: which keys are a lookup's), each with its range of the kept keys."""
    positions = np.flatnonzero(keep)
    op_of = np.searchsorted(trace.start, positions, side="right") - 1
    firsts = np.flatnonzero(np.diff(op_of, prepend=-1))
    ops = op_of[firsts]
    los = firsts.tolist()
    return _Ops(
        trace.kind[ops].tolist(), trace.space[ops].tolist(), trace.world[ops].tolist(),
        los, [*los[1:], len(positions)], trace.keys[positions].tolist(),
        int((~lookup_key[positions]).sum()),
    )  # fmt: skip


def simulate(
    trace: Trace, *, rate: float = 1.0, seed: int = 0, sampled: bool | None = None
) -> Distances:
    """Stack distances of the trace's lookup chunks; `rate` < 1 samples keys (SHARDS).
    `sampled=True` runs the sampled estimator even at rate 1 (where it equals exact)."""
    lengths = np.diff(trace.start)
    is_lookup = trace.kind == LOOKUP
    lookup_chunks = int(lengths[is_lookup].sum())
    rate = min(rate, 1.0)
    if not (sampled or rate < 1.0):
        dist = _stack_distances(trace, _exact_ops(trace, lengths, is_lookup), 1.0 / rate)
        return Distances(np.sort(dist), lookup_chunks, 1.0)
    keep = keep_mask(Sampler(rate, seed), trace.keys)
    lookup_key = np.repeat(is_lookup, lengths)
    strata = strata_of(trace.keys[lookup_key], keep[lookup_key])
    dist = _stack_distances(trace, _sampled_ops(trace, keep, lookup_key), 1.0 / rate)
    return Distances(dist, lookup_chunks, rate, strata)


def _stack_distances(trace: Trace, ops: _Ops, scale: float) -> np.ndarray:
    """The stack distance of every lookup key of `ops`, in order: the largest over its
    world's ranks of the bytes touched since its object's last touch (inf: never, or a
    key before it in the lookup never). Objects weigh their aligned size times `scale`.

    One piece: the loop over every op and key of the trace is the simulation's hot path;
    the Fenwick tree's prefix sum and update are written out inline (a call per key
    would cost measurable time over millions of keys).
    """
    weight = {s: aligned(b) * scale for s, b in trace.space_bytes.items()}
    default_w = aligned(trace.object_bytes() or 1) * scale
    tree = [0.0] * (ops.touch_slots + 2)
    size = len(tree) - 1
    last: list[dict[int, int]] = [{} for _ in range(max(trace.spaces.values(), default=-1) + 2)]
    key_list = ops.keys
    total, clock = 0.0, 0
    out: list[float] = []
    append = out.append
    for kind, base, world, lo, hi in zip(*ops[:5], strict=True):  # kinds, spaces, ..., his
        if lo == hi:
            continue
        if kind == LOOKUP:
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
    return np.asarray(out, dtype=np.float64)
