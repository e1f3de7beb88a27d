"""Transfer plan: per-group vector width, warp-tile geometry and the kernel's descriptor table.

Pure Python/numpy (no GPU): the CUDA backend uploads ``TransferPlan.table`` once per
(layout, chunk_tokens, alignment, vector cap) and the kernel reads it. Struct layouts
mirror ``csrc/block_transfer.cu`` (the .cu file static_asserts the same sizes/offsets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvflow.kernels.layout import KVLayout

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
    ],
    align=True,
)
GROUP = np.dtype(
    [
        ("stage_offset", "<i8"),
        ("layer_stage_bytes", "<i8"),
        ("seg_bytes", "<i8"),
        ("tile_begin", "<u4"),
        ("tile_end", "<u4"),
        ("first_entry", "<u4"),
        ("vec_log2", "<u4"),
        ("seg_vecs", "<u4"),
        ("contiguous", "<u4"),
        ("tiles_per_seg", FASTDIV),
        ("num_layers", FASTDIV),
        ("run_vecs", FASTDIV),
        ("runs_per_token", FASTDIV),
    ],
    align=True,
)
ENTRY = np.dtype(
    [("base", "<i8"), ("s_block", "<i8"), ("s_token", "<i8"), ("s_run", "<i8")], align=True
)
HEADER_BYTES = 64  # the group table starts here (16-byte aligned)


def unroll(vec_bytes: int) -> int:
    """Vectors each lane moves per warp tile: 64 bytes per lane, at least 4, at most 16."""
    return min(16, max(4, 64 // vec_bytes))


def tile_vectors(vec_bytes: int) -> int:
    """Vectors in one warp tile (the kernel's unit of work)."""
    return WARP * unroll(vec_bytes)


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
    """How one layer group is copied: vector width and how cache runs are addressed."""

    vec_bytes: int
    contiguous: bool  # one cache block of one (kv, layer) is a single contiguous run
    run_bytes: int  # contiguous bytes per cache run (whole block, token row or head)
    runs_per_token: int
    seg_bytes: int
    tiles_per_seg: int
    tile_begin: int
    tile_end: int


@dataclass(frozen=True)
class TransferPlan:
    """Geometry of every group for one chunk size, plus the packed descriptor table."""

    chunk_tokens: int
    blocks_per_chunk: int
    chunk_bytes: int
    tiles_per_chunk: int
    groups: tuple[GroupPlan, ...]
    table: np.ndarray  # uint8 bytes: header | group descs | (layer, kv) entries
    groups_offset: int
    entries_offset: int


def build_plan(
    layout: KVLayout,
    chunk_tokens: int,
    *,
    staging_alignment: int = 16,
    max_vector_bytes: int = 16,
) -> TransferPlan:
    """Plan a transfer of ``chunk_tokens``-token chunks; vector widths capped as given.

    Each group gets the widest vector of 16/8/4/2/1 bytes dividing its contiguous run and
    every address it touches (cache bases and strides, staging offsets).
    """
    if max_vector_bytes not in VECTOR_WIDTHS:
        raise ValueError(f"max_vector_bytes must be one of {VECTOR_WIDTHS}; got {max_vector_bytes}")
    chunk_bytes = layout.chunk_nbytes(chunk_tokens)
    per_chunk = chunk_tokens // layout.block_size
    bs = layout.block_size
    group_plans: list[GroupPlan] = []
    group_rows: list[tuple[object, ...]] = []
    entries: list[tuple[int, int, int, int]] = []
    tile = 0
    for group, offset in zip(layout.groups, layout.group_offsets(chunk_tokens), strict=True):
        descs = [
            layout.stride_desc(layer, kv) for kv in range(group.kv_size) for layer in group.layers
        ]
        heads_merged = group.num_heads == 1 or all(d.head == group.head_bytes for d in descs)
        tokens_merged = heads_merged and (bs == 1 or all(d.token == group.row_bytes for d in descs))
        seg_bytes = bs * group.row_bytes
        if tokens_merged:
            run_bytes, runs_per_token = seg_bytes, 1
        elif heads_merged:
            run_bytes, runs_per_token = group.row_bytes, 1
        else:
            run_bytes, runs_per_token = group.head_bytes, group.num_heads
        terms = [run_bytes, chunk_bytes, offset, chunk_tokens * group.row_bytes, seg_bytes]
        for d in descs:
            terms += [d.base_ptr, d.block]
            if not tokens_merged:
                terms.append(d.token)
            if runs_per_token > 1:
                terms.append(d.head)
        vec = min(max_vector_bytes, pow2_alignment(staging_alignment))
        for term in terms:
            vec = min(vec, pow2_alignment(term))
        seg_vecs = seg_bytes // vec
        if seg_vecs >= MAX_NUMERATOR:
            raise ValueError(f"a block of {seg_bytes} bytes is too large for the kernel")
        tiles_per_seg = math.ceil(seg_vecs / tile_vectors(vec))
        tiles = group.kv_size * len(group.layers) * per_chunk * tiles_per_seg
        plan = GroupPlan(
            vec,
            tokens_merged,
            run_bytes,
            runs_per_token,
            seg_bytes,
            tiles_per_seg,
            tile,
            tile + tiles,
        )
        group_plans.append(plan)
        group_rows.append(
            (
                offset,
                chunk_tokens * group.row_bytes,
                seg_bytes,
                tile,
                tile + tiles,
                len(entries),
                vec.bit_length() - 1,
                seg_vecs,
                int(tokens_merged),
                _pack_div(tiles_per_seg),
                _pack_div(len(group.layers)),
                _pack_div(run_bytes // vec),
                _pack_div(runs_per_token),
            )
        )
        entries += [
            (d.base_ptr, d.block, d.token, d.head if runs_per_token > 1 else 0) for d in descs
        ]
        tile += tiles
    if tile >= MAX_NUMERATOR:
        raise ValueError(f"a chunk of {chunk_bytes} bytes needs too many warp tiles ({tile})")
    header = np.zeros(1, HEADER)
    header[0] = (
        len(group_rows),
        per_chunk,
        _pack_div(max(tile, 1)),
        _pack_div(per_chunk),
        chunk_bytes,
    )
    groups_arr = np.array(group_rows, dtype=GROUP)
    entries_arr = np.array(entries, dtype=ENTRY)
    entries_offset = HEADER_BYTES + groups_arr.nbytes
    table = np.zeros(entries_offset + entries_arr.nbytes, np.uint8)
    table[: HEADER.itemsize] = header.view(np.uint8)
    table[HEADER_BYTES:entries_offset] = groups_arr.view(np.uint8)
    table[entries_offset:] = entries_arr.view(np.uint8)
    return TransferPlan(
        chunk_tokens=chunk_tokens,
        blocks_per_chunk=per_chunk,
        chunk_bytes=chunk_bytes,
        tiles_per_chunk=tile,
        groups=tuple(group_plans),
        table=table,
        groups_offset=HEADER_BYTES,
        entries_offset=entries_offset,
    )
