"""Transfer plan: per-group vector width, warp-tile geometry and the kernel's descriptor table.

Pure Python/numpy (no GPU): the CUDA backend uploads ``TransferPlan.table`` once per
(layout, chunk_tokens, alignment, vector cap) and the kernel reads it. Struct layouts
mirror ``csrc/block_transfer.cu`` (the .cu file static_asserts the same sizes/offsets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvflow.kernels.layout import KVLayout, LayerGroup, StrideDesc

WARP = 32
WARPS_PER_CTA = 8
THREADS_PER_CTA = WARP * WARPS_PER_CTA
VECTOR_WIDTHS = (16, 8, 4, 2, 1)
MAX_NUMERATOR = 2**31  # the kernel's fast division is exact for numerators below this

FASTDIV = np.dtype([("d", "<u4"), ("m", "<u4"), ("s", "<u4"), ("pad", "<u4")], align=True)
HEADER = np.dtype(
    [
        ("num_groups", "<u4"),
        ("blocks_per_chunk", "<u4"),
        ("tiles_per_chunk", FASTDIV),
        ("per_chunk_div", FASTDIV),
        ("chunk_bytes", "<i8"),
        ("pad", "<u4", (2,)),
    ],
    align=True,
)
GROUP = np.dtype(
    [
        ("stage_offset", "<i8"),
        ("layer_stage_bytes", "<i8"),
        ("seg_bytes", "<i8"),
        ("stage_outer", "<i8"),
        ("stage_inner", "<i8"),
        ("tile_begin", "<u4"),
        ("tile_end", "<u4"),
        ("first_entry", "<u4"),
        ("vec_log2", "<u4"),
        ("seg_vecs", "<u4"),
        ("linear", "<u4"),
        ("tiles_per_seg", FASTDIV),
        ("span", "<u4"),
        ("iters", "<u4"),
        ("iters_pad", "<u4", (2,)),
        ("run_vecs", FASTDIV),
        ("inner", FASTDIV),
    ],
    align=True,
)
ENTRY = np.dtype(
    [("base", "<i8"), ("s_block", "<i8"), ("s_outer", "<i8"), ("s_inner", "<i8")], align=True
)
LINEAR_BOTH, LINEAR_STAGE, LINEAR_CACHE = 0, 1, 2  # which side is linear in the vector index
ORDER_BITS = 3  # a group record's `linear` field: the order above, or-ed with the flags below
# Flag or-ed into a group's `linear` field: the group is moved in 16-byte granules of its
# (linear) destination, its source read as aligned 16-byte granules and shifted into place.
STAGED = 4
# Or-ed with STAGED: a staged group whose source segment is one aligned span small enough
# for shared memory is moved a segment per CTA, the span loaded to shared memory first.
TILED = 8
# Or-ed with TILED: the segment is small (under TILE_MIN_BYTES), so one warp moves it
# through its own slice of shared memory instead of a whole CTA.
WARP_TILED = 16
# Or-ed into a scatter whose destination (the cache) is not linear and has bytes the
# transfer does not own between its runs (padded rows): the kernel prefetches the
# sectors it will write in part into L2 before writing them.
PREFETCH_GAPS = 32
TILE_SPAN_MAX = 48 * 1024  # shared memory a CTA may use without opting in
TILE_MIN_BYTES = THREADS_PER_CTA * 16  # smaller segments go a warp each (WARP_TILED)
# a warp-tiled span (< 1.25 x TILE_MIN_BYTES) fits once per warp in a CTA's shared memory
assert WARPS_PER_CTA * (TILE_MIN_BYTES + TILE_MIN_BYTES // 4) <= TILE_SPAN_MAX
GRANULE = 16
DEFAULT_LANE_BYTES = 64
# Unrolled steps per warp tile: 1 for wide groups (`is_wide`; measured best: small tiles
# even out the end of a launch), 4 for the others (narrow or strided vectors: measured
# best, fewer CTAs for the same bytes in flight).
DEFAULT_ITERS = 4
DEFAULT_WIDE_ITERS = 1
HEADER_BYTES = 64  # the group table starts here (16-byte aligned)


def unroll(vec_bytes: int, linear: int, lane_bytes: int = DEFAULT_LANE_BYTES) -> int:
    """Vectors per lane per unrolled step, as the kernel's ``unroll<VEC, LIN>()``."""
    if linear & STAGED:  # a granule reads about two: lane_bytes of loads in flight
        return max(1, lane_bytes // (2 * GRANULE))
    most = 16 if linear & ORDER_BITS == LINEAR_BOTH else 8
    return min(most, max(4, lane_bytes // vec_bytes))


def is_wide(vec_bytes: int, linear: int, staged: bool) -> bool:
    """A group moved in 8- or 16-byte vectors, or in 4-byte ones linear on both sides
    (not staged): its warp tiles take `wide_iters` steps."""
    return not staged and (vec_bytes >= 8 or (vec_bytes == 4 and linear == LINEAR_BOTH))


def fast_divisor(d: int) -> tuple[int, int, int]:
    """(d, m, s) with q = (umulhi(n, m) + n) >> s == n // d for 0 <= n < 2**31, 1 <= d < 2**31."""
    if not 1 <= d < MAX_NUMERATOR:
        raise ValueError(f"divisor {d} outside [1, 2**31)")
    s = (d - 1).bit_length()
    m = (((1 << s) - d) << 32) // d + 1
    return d, m, s


def fast_divide(n: int, divisor: tuple[int, int, int]) -> int:
    """Host model of the kernel's division, for tests."""
    _, m, s = divisor
    return (((n * m) >> 32) + n) >> s


def _pack_div(d: int) -> tuple[int, int, int, int]:
    return (*fast_divisor(d), 0)


def pow2_alignment(value: int, cap: int = 16) -> int:
    """Largest power of two <= cap dividing ``value`` (0 is divisible by everything)."""
    if value == 0:
        return cap
    return min(cap, value & -value)


@dataclass(frozen=True)
class GroupPlan:
    """How one layer group is copied: vector width and the order vectors are visited in.

    A segment (one block of one (kv, layer)) is cut into runs contiguous on both sides;
    run r sits at (outer, inner) = divmod(r, inner) with a byte stride per index and side.
    """

    vec_bytes: int  # the vector width; a staged group moves 16-byte granules whatever it is
    linear: int  # LINEAR_BOTH / LINEAR_STAGE / LINEAR_CACHE: side(s) linear in the vector index
    staged: bool  # moved in 16-byte destination granules, the source shifted into place
    span: int  # tiled (staged through shared memory): the source span of a segment; else 0
    warp_tiled: bool  # tiled a segment per warp (small segments), not per CTA
    prefetch_gaps: bool  # a scatter into padded rows: partial sectors prefetched first
    iters: int  # unrolled steps per warp tile
    run_bytes: int
    inner: int  # runs per outer index
    stage_strides: tuple[int, int]  # (outer, inner) byte strides in staging
    seg_bytes: int
    tiles_per_seg: int
    tile_begin: int
    tile_end: int

    @property
    def mode(self) -> int:
        """The packed record's `linear` field: the order or-ed with the group's flags."""
        flags = (STAGED if self.staged else 0) | (TILED if self.span else 0)
        flags |= (WARP_TILED if self.warp_tiled else 0) | (
            PREFETCH_GAPS if self.prefetch_gaps else 0
        )
        return self.linear | flags


@dataclass(frozen=True)
class TransferPlan:
    """Geometry of every group for one chunk size and direction, plus the packed table."""

    chunk_tokens: int
    blocks_per_chunk: int
    chunk_bytes: int
    tiles_per_chunk: int
    groups: tuple[GroupPlan, ...]
    table: np.ndarray  # uint8 bytes: header | group descs | (kv, layer) entries
    groups_offset: int
    entries_offset: int
    shared_bytes: int  # dynamic shared memory per CTA: the largest tiled span, else 0

    @property
    def all_linear(self) -> bool:
        """Every group is contiguous on both sides: the lean kernel instantiation suffices."""
        return all(g.linear == LINEAR_BOTH and not g.staged for g in self.groups)

    @property
    def all_tiled(self) -> bool:
        """Every group is tiled: the shared-memory kernel instantiation suffices."""
        return all(g.span for g in self.groups)


def _order(
    group: LayerGroup, descs: list[StrideDesc], block_size: int, gather: bool
) -> tuple[int, int, int, tuple[int, int], list[tuple[int, int]]]:
    """(linear, run_bytes, inner, staging strides, cache strides per entry) for one group.

    Runs are merged as far as both sides are contiguous. Otherwise vectors follow the
    staging order (token, head), except that a scatter into a head-major (HND) block
    follows the cache order (head, token), so the destination is written linearly.
    """
    hb, row = group.head_bytes, group.row_bytes
    heads_merged = group.num_heads == 1 or all(d.head == hb for d in descs)
    if heads_merged and (block_size == 1 or all(d.token == row for d in descs)):
        return LINEAR_BOTH, block_size * row, 1, (0, 0), [(0, 0)] * len(descs)
    if heads_merged:
        return LINEAR_STAGE, row, 1, (row, 0), [(d.token, 0) for d in descs]
    head_major = all(d.token == hb and d.head == block_size * hb for d in descs)
    if head_major and not gather:
        return LINEAR_CACHE, hb, block_size, (hb, row), [(d.head, d.token) for d in descs]
    return LINEAR_STAGE, hb, group.num_heads, (row, hb), [(d.token, d.head) for d in descs]


def _stageable(
    linear: int,
    run_bytes: int,
    cache_strides: list[tuple[int, int]],
    stage_strides: tuple[int, int],
    *,
    gather: bool,
    dst_terms: list[int],
) -> bool:
    """Whether a narrow-vector group can move in 16-byte granules of its destination.

    The destination must be linear over a segment and 16-byte aligned everywhere, so
    every store is a whole 16-byte granule; a run must be >= 16 bytes, so a granule takes
    bytes of at most two runs; and every source stride in use >= 16 bytes, so the granule
    read to reach the start of a second run lies inside the block.
    """
    dst_linear = linear == LINEAR_BOTH or linear == (LINEAR_STAGE if gather else LINEAR_CACHE)
    if not dst_linear or run_bytes < GRANULE:
        return False
    if any(term % GRANULE for term in dst_terms):
        return False
    src_strides = [s for pair in cache_strides for s in pair] if gather else list(stage_strides)
    return all(s == 0 or s >= GRANULE for s in src_strides)


def _cta_aligned(tile: int) -> int:
    """The first warp tile at or after `tile` that starts a CTA."""
    return -(-tile // WARPS_PER_CTA) * WARPS_PER_CTA


def _spans(seg_bytes: int, run_bytes: int, inner: int, strides: list[tuple[int, int]]) -> set[int]:
    """Per (outer, inner) stride pair, the end of a segment's last run (strides >= 0):
    the bytes from a segment's first run to its last, holes included."""
    outers = seg_bytes // run_bytes // inner
    return {(outers - 1) * so + (inner - 1) * si + run_bytes for so, si in strides}


def _tile_span(
    seg_bytes: int,
    run_bytes: int,
    inner: int,
    src_strides: list[tuple[int, int]],
    src_terms: list[int],
) -> int:
    """The source span a tiled group loads per segment, or 0 where it cannot be tiled.

    The runs' source offsets (outer * s_outer + inner * s_inner, strides >= 0) lie in
    [0, span) with span = the last run's end, the same for every (kv, layer). Tiling needs
    that span 16-byte aligned at its start and end (whole granules, nothing read outside
    the runs' hull), at most TILE_SPAN_MAX bytes, and at most a quarter more than the
    segment's bytes (padding between runs is loaded too). A segment under TILE_MIN_BYTES
    is warp-tiled (a CTA per 2 KiB segment measured half the speed): its span, at most
    5 KiB, fits a CTA's shared memory once per warp.
    """
    spans = _spans(seg_bytes, run_bytes, inner, src_strides)
    if len(spans) != 1 or any(s < 0 for pair in src_strides for s in pair):
        return 0
    span = spans.pop()
    aligned = all(term % GRANULE == 0 for term in [span, *src_terms])
    return span if aligned and span <= min(TILE_SPAN_MAX, seg_bytes + seg_bytes // 4) else 0


@dataclass(frozen=True)
class _Request:
    """What `build_plan` was asked for: the chunk and the tuning arguments, handed whole
    to the per-group helpers."""

    chunk_tokens: int
    chunk_bytes: int
    blocks_per_chunk: int
    gather: bool
    staging_alignment: int
    max_vector_bytes: int
    lane_bytes: int
    iters: int
    wide_iters: int
    tiled: bool


@dataclass(frozen=True)
class _GroupShape:
    """One group's runs and addresses in a chunk: what its vector width, staging and
    tiling follow from."""

    descs: list[StrideDesc]  # per (kv, layer), kv-major
    linear: int
    run_bytes: int
    inner: int
    stage_strides: tuple[int, int]
    cache_strides: list[tuple[int, int]]  # per (kv, layer)
    offset: int  # the group's offset in a chunk
    layer_stage_bytes: int  # one (kv, layer) of the group in a chunk
    seg_bytes: int
    stage_terms: list[int]  # staging's address terms: alignment, chunk/group/layer/block offsets
    cache_terms: list[int]  # the cache's: block bytes, each (kv, layer)'s base and block stride

    @property
    def entries(self) -> list[tuple[int, int, int, int]]:
        """The group's (kv, layer) entries (ENTRY): cache base, block and run strides."""
        pairs = zip(self.descs, self.cache_strides, strict=True)
        return [(d.base_ptr, d.block, *strides) for d, strides in pairs]


def _group_shape(layout: KVLayout, group: LayerGroup, offset: int, req: _Request) -> _GroupShape:
    """The runs (see `_order`) and addresses of one group at `offset` in a chunk."""
    descs = [layout.stride_desc(layer, kv) for kv in range(group.kv_size) for layer in group.layers]
    linear, run_bytes, inner, stage_strides, cache_strides = _order(
        group, descs, layout.block_size, req.gather
    )
    seg_bytes = layout.block_size * group.row_bytes
    layer_stage_bytes = req.chunk_tokens * group.row_bytes
    stage_terms = [req.staging_alignment, req.chunk_bytes, offset, layer_stage_bytes, seg_bytes]
    cache_terms = [seg_bytes, *(t for d in descs for t in (d.base_ptr, d.block))]
    return _GroupShape(
        descs, linear, run_bytes, inner, stage_strides, cache_strides, offset,
        layer_stage_bytes, seg_bytes, stage_terms, cache_terms,
    )  # fmt: skip


def _vector_bytes(req: _Request, shape: _GroupShape) -> int:
    """The widest vector (at most ``max_vector_bytes``) dividing the group's runs, both
    sides' strides and every address term."""
    terms = [shape.run_bytes, *shape.stage_strides, *shape.stage_terms, *shape.cache_terms]
    terms += [s for pair in shape.cache_strides for s in pair]
    return min([req.max_vector_bytes, *(pow2_alignment(term) for term in terms)])


def _staged_span(req: _Request, shape: _GroupShape, vec: int) -> tuple[bool, int]:
    """Whether a group of `vec`-byte vectors is staged (`_stageable`; never under a
    vector cap) and, tiled, its source span (`_tile_span`; 0: not tiled)."""
    dst_terms, src_terms = shape.stage_terms, shape.cache_terms  # a gather writes staging
    if not req.gather:
        dst_terms, src_terms = src_terms, dst_terms
    staged = (
        vec < GRANULE
        and req.max_vector_bytes == GRANULE
        and _stageable(
            shape.linear,
            shape.run_bytes,
            shape.cache_strides,
            shape.stage_strides,
            gather=req.gather,
            dst_terms=dst_terms,
        )
    )
    if not (staged and req.tiled):
        return staged, 0
    src_strides = shape.cache_strides if req.gather else [shape.stage_strides]
    return True, _tile_span(shape.seg_bytes, shape.run_bytes, shape.inner, src_strides, src_terms)


def _plan_group(req: _Request, shape: _GroupShape, tile: int) -> GroupPlan:
    """How one group moves (vector, staging, tiling, prefetch, steps) and its warp tiles,
    from `tile` on (from the next CTA's first when it is tiled a CTA per segment)."""
    vec = _vector_bytes(req, shape)
    staged, span = _staged_span(req, shape, vec)
    warp_tiled = bool(span) and shape.seg_bytes < TILE_MIN_BYTES
    # a plain scatter whose (non-linear) cache side has holes between its runs
    prefetch_gaps = (
        not req.gather
        and shape.linear == LINEAR_STAGE
        and not staged
        and max(_spans(shape.seg_bytes, shape.run_bytes, shape.inner, shape.cache_strides))
        > shape.seg_bytes
    )
    iters = req.wide_iters if is_wide(vec, shape.linear, staged) else req.iters
    seg_vecs = shape.seg_bytes // (GRANULE if staged else vec)
    if seg_vecs >= MAX_NUMERATOR:
        raise ValueError(f"a block of {shape.seg_bytes} bytes is too large for the kernel")
    if warp_tiled:  # one warp per segment
        tiles_per_seg = 1
    elif span:  # one CTA per segment, its warps' tiles aligned to a CTA
        tile = _cta_aligned(tile)
        tiles_per_seg = WARPS_PER_CTA
    else:
        mode = shape.linear | (STAGED if staged else 0) | (PREFETCH_GAPS if prefetch_gaps else 0)
        tiles_per_seg = math.ceil(seg_vecs / (WARP * unroll(vec, mode, req.lane_bytes) * iters))
    tiles = len(shape.descs) * req.blocks_per_chunk * tiles_per_seg
    return GroupPlan(
        vec_bytes=vec,
        linear=shape.linear,
        staged=staged,
        span=span,
        warp_tiled=warp_tiled,
        prefetch_gaps=prefetch_gaps,
        iters=iters,
        run_bytes=shape.run_bytes,
        inner=shape.inner,
        stage_strides=shape.stage_strides,
        seg_bytes=shape.seg_bytes,
        tiles_per_seg=tiles_per_seg,
        tile_begin=tile,
        tile_end=tile + tiles,
    )


def _group_record(g: GroupPlan, shape: _GroupShape, first_entry: int) -> tuple[object, ...]:
    """A group's packed record (GROUP) as the kernel reads it."""
    unit = GRANULE if g.staged else g.vec_bytes
    return (
        shape.offset,
        shape.layer_stage_bytes,
        g.seg_bytes,
        *g.stage_strides,
        g.tile_begin,
        g.tile_end,
        first_entry,
        unit.bit_length() - 1,
        g.seg_bytes // unit,
        g.mode,
        _pack_div(g.tiles_per_seg),
        g.span,
        g.iters,
        (0, 0),
        _pack_div(g.run_bytes if g.staged else g.run_bytes // g.vec_bytes),
        _pack_div(g.inner),
    )


def _pack_table(
    req: _Request,
    records: list[tuple[object, ...]],
    entries: list[tuple[int, int, int, int]],
    tiles_per_chunk: int,
) -> tuple[np.ndarray, int]:
    """The descriptor table (header | group records | entries, as uint8) and where its
    entries start."""
    header = np.zeros(1, HEADER)
    header[0] = (
        len(records),
        req.blocks_per_chunk,
        _pack_div(max(tiles_per_chunk, 1)),
        _pack_div(req.blocks_per_chunk),
        req.chunk_bytes,
        (0, 0),
    )
    groups_arr = np.array(records, dtype=GROUP)
    entries_arr = np.array(entries, dtype=ENTRY)
    entries_offset = HEADER_BYTES + groups_arr.nbytes
    table = np.zeros(entries_offset + entries_arr.nbytes, np.uint8)
    table[: HEADER.itemsize] = header.view(np.uint8)
    table[HEADER_BYTES:entries_offset] = groups_arr.view(np.uint8)
    table[entries_offset:] = entries_arr.view(np.uint8)
    return table, entries_offset


def build_plan(
    layout: KVLayout,
    chunk_tokens: int,
    *,
    gather: bool = True,
    staging_alignment: int = 16,
    max_vector_bytes: int = 16,
    lane_bytes: int = DEFAULT_LANE_BYTES,
    iters: int = DEFAULT_ITERS,
    wide_iters: int = DEFAULT_WIDE_ITERS,
    tiled: bool = True,
) -> TransferPlan:
    """Plan a transfer of ``chunk_tokens``-token chunks in one direction.

    Each group gets the widest vector of 16/8/4/2/1 bytes (at most ``max_vector_bytes``)
    dividing its runs and every address it touches (cache bases and strides, staging
    offsets and alignment). A group narrower than 16 bytes whose destination is linear and
    16-byte aligned is *staged* (see `_stageable`) unless ``max_vector_bytes`` caps the
    width, and a staged group whose source segment is one aligned span that fits in
    shared memory is *tiled* (see `_tile_span`) unless ``tiled`` is false. A warp tile
    is ``wide_iters`` unrolled steps in a wide group (see `is_wide`), ``iters`` in any
    other; ``lane_bytes`` must match the kernel build.
    """
    if max_vector_bytes not in VECTOR_WIDTHS:
        raise ValueError(f"max_vector_bytes must be one of {VECTOR_WIDTHS}; got {max_vector_bytes}")
    chunk_bytes = layout.chunk_nbytes(chunk_tokens)
    req = _Request(
        chunk_tokens, chunk_bytes, chunk_tokens // layout.block_size, gather,
        staging_alignment, max_vector_bytes, lane_bytes, iters, wide_iters, tiled,
    )  # fmt: skip
    groups: list[GroupPlan] = []
    records: list[tuple[object, ...]] = []
    entries: list[tuple[int, int, int, int]] = []
    tile = 0  # the groups' warp tiles follow each other in a chunk
    for group, offset in zip(layout.groups, layout.group_offsets(chunk_tokens), strict=True):
        shape = _group_shape(layout, group, offset, req)
        plan = _plan_group(req, shape, tile)
        groups.append(plan)
        records.append(_group_record(plan, shape, len(entries)))
        entries += shape.entries
        tile = plan.tile_end
    if any(g.span and not g.warp_tiled for g in groups):  # next chunk's stay aligned
        tile = _cta_aligned(tile)
    if tile >= MAX_NUMERATOR:
        raise ValueError(f"a chunk of {chunk_bytes} bytes needs too many warp tiles ({tile})")
    table, entries_offset = _pack_table(req, records, entries, tile)
    return TransferPlan(
        chunk_tokens=chunk_tokens,
        blocks_per_chunk=req.blocks_per_chunk,
        chunk_bytes=chunk_bytes,
        tiles_per_chunk=tile,
        groups=tuple(groups),
        table=table,
        groups_offset=HEADER_BYTES,
        entries_offset=entries_offset,
        shared_bytes=max(
            (g.span * (WARPS_PER_CTA if g.warp_tiled else 1) for g in groups), default=0
        ),
    )
