"""The transfer plan: vector widths, fast division, and the descriptor table's index math.

``_emulate`` walks the packed table exactly as ``block_transfer.cu`` does (warp tile ->
chunk, group, (kv, layer), block, vectors; a tiled group's CTA -> one segment through a
shared-memory copy of its source span) and moves real bytes with bounds-checked
memmoves, so the table and the kernel's addressing are checked on CPU against the
reference transfer.
"""

from __future__ import annotations

import ctypes
import itertools
import random
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.kernels import KVFormat, KVLayout
from kvflow.kernels.plan import (
    DEFAULT_ITERS,
    DEFAULT_WIDE_ITERS,
    ENTRY,
    GROUP,
    HEADER,
    HEADER_BYTES,
    LINEAR_BOTH,
    LINEAR_CACHE,
    LINEAR_STAGE,
    ORDER_BITS,
    PREFETCH_GAPS,
    STAGED,
    TILE_MIN_BYTES,
    TILE_SPAN_MAX,
    TILED,
    WARP_TILED,
    WARPS_PER_CTA,
    TransferPlan,
    build_plan,
    fast_divide,
    fast_divisor,
    is_wide,
    unroll,
)
from kvflow.kernels.reference import transfer_reference
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import flat_tensors


def test_fast_division_is_exact_below_two_to_the_31() -> None:
    """The kernel's multiply-high division equals floor division for every tested pair."""
    rng = random.Random(5)
    divisors = [*range(1, 300), *(rng.randrange(1, 2**31) for _ in range(300)), 2**31 - 1]
    for d in divisors:
        div = fast_divisor(d)
        assert div[1] < 2**32
        for n in (0, 1, d - 1, d, d + 1, 3 * d + 2, 2**31 - 1, rng.randrange(2**31)):
            if n < 2**31:
                assert fast_divide(n, div) == n // d, (n, d)
    with pytest.raises(ValueError, match="outside"):
        fast_divisor(0)
    with pytest.raises(ValueError, match="outside"):
        fast_divisor(2**31)
    # the magic numbers themselves (the kernel reads them from the table)
    assert fast_divisor(1) == (1, 1, 0)
    assert fast_divisor(7) == (7, (1 << 32) // 7 + 1, 3)
    assert fast_divisor(132) == (132, ((256 - 132) << 32) // 132 + 1, 8)


@pytest.mark.parametrize(
    ("vec", "mode", "lane_bytes", "vectors"),
    [
        (16, LINEAR_BOTH, 64, 4),
        (4, LINEAR_BOTH, 64, 16),
        (1, LINEAR_BOTH, 64, 16),
        (16, LINEAR_BOTH, 32, 4),
        (4, LINEAR_STAGE, 64, 8),
        (4, LINEAR_CACHE | PREFETCH_GAPS, 64, 8),
        (2, LINEAR_STAGE, 128, 8),
        (16, LINEAR_STAGE, 64, 4),
        (4, LINEAR_STAGE | STAGED, 64, 2),
        (4, LINEAR_STAGE | STAGED, 128, 4),
        (4, LINEAR_STAGE | STAGED, 32, 1),
        (1, LINEAR_CACHE | STAGED, 16, 1),
    ],
)
def test_vectors_per_lane_step_mirror_the_kernel(
    vec: int, mode: int, lane_bytes: int, vectors: int
) -> None:
    """unroll() is the kernel's unroll<VEC, LIN>() and kStagedUnroll: lane_bytes / vec
    within [4, 16] on both-linear groups and [4, 8] on the others, a staged group
    lane_bytes / 32 granules (at least 1)."""
    assert unroll(vec, mode, lane_bytes) == vectors


def test_group_records_carry_the_planned_mode() -> None:
    """Each packed group record's `linear` field is its order or-ed with exactly the flags
    its plan has (the kernel dispatches on them), and its step count."""
    layouts = [
        _layout(KVFormat.VLLM_FLASH_ATTN, block_size=16),
        _layout(KVFormat.VLLM_FLASH_ATTN, block_size=32, num_heads=8, head_size=128),
        _int8_hnd(num_heads=2, block_size=16, head_size=132),
        _int8_hnd(num_heads=2, block_size=16, head_size=66),
        _layout(KVFormat.SGLANG_MLA, noncontiguous=True, head_size=132, dtype=torch.int8),
    ]
    seen = 0
    for layout, lane_bytes in itertools.product(layouts, (64, 128)):
        for gather in (True, False):
            plan = build_plan(layout, 32, gather=gather, lane_bytes=lane_bytes, iters=3)
            records = plan.table[plan.groups_offset : plan.entries_offset].view(GROUP)
            for g, record in zip(plan.groups, records, strict=True):
                mode = g.linear | (STAGED if g.staged else 0) | (TILED if g.span else 0)
                mode |= (WARP_TILED if g.warp_tiled else 0) | (PREFETCH_GAPS * g.prefetch_gaps)
                assert int(record["linear"]) == mode
                assert int(record["iters"]) == g.iters
                assert int(record["span"]) == g.span
                assert int(record["tiles_per_seg"]["d"]) == g.tiles_per_seg
                if not g.span:  # warp tiles of `iters` steps cover the segment
                    unit = 16 if g.staged else g.vec_bytes
                    per_tile = 32 * unroll(g.vec_bytes, mode, lane_bytes) * g.iters * unit
                    assert g.tiles_per_seg == -(-g.seg_bytes // per_tile)
                seen |= mode
    assert seen == LINEAR_STAGE | LINEAR_CACHE | STAGED | TILED | WARP_TILED | PREFETCH_GAPS


def test_tiling_loads_at_most_a_quarter_of_padding() -> None:
    """A padded-row gather is tiled while its span is at most 1.25 x its data: 66-byte
    rows padded to 82 (1.23 x) are, 50-byte rows padded to 66 (1.30 x) stay staged."""

    def gather(head: int) -> Any:
        layout = _layout(
            KVFormat.SGLANG_MLA, noncontiguous=True, block_size=16, head_size=head,
            dtype=torch.int8,
        )  # fmt: skip
        return build_plan(layout, 32).groups[0]

    tiled = gather(66)
    assert tiled.staged and tiled.span == 15 * 82 + 66
    assert tiled.span <= 1.25 * tiled.seg_bytes
    staged = gather(50)
    assert staged.staged and staged.span == 0


def test_staged_groups_keep_the_narrow_step_count() -> None:
    """A staged group of 8-byte vectors (untiled) takes `iters`, not `wide_iters`."""
    layout = _int8_hnd(num_heads=2, block_size=16, head_size=136)
    group = build_plan(layout, 32, tiled=False, iters=3, wide_iters=2).groups[0]
    assert (group.vec_bytes, group.staged, group.iters) == (8, True, 3)


def _layout(fmt: KVFormat, **kwargs: Any) -> KVLayout:
    caches, kw = make_kv_caches(fmt, **kwargs)
    return KVLayout.from_kv_caches(caches, **kw)


def _int8_hnd(**kwargs: Any) -> KVLayout:
    """A head-major (HND) flashinfer layout of int8 heads."""
    return _layout(KVFormat.VLLM_FLASHINFER, noncontiguous=True, dtype=torch.int8, **kwargs)


@pytest.mark.parametrize(
    ("fmt", "kwargs", "vec", "linear"),
    [
        (KVFormat.VLLM_FLASH_ATTN, {}, 16, LINEAR_BOTH),
        (KVFormat.VLLM_FLASH_ATTN, {"noncontiguous": True}, 16, LINEAR_STAGE),
        (
            KVFormat.VLLM_FLASHINFER,
            {"noncontiguous": True, "head_size": 132, "dtype": torch.int8},
            4,
            LINEAR_STAGE,
        ),
        (KVFormat.SGLANG_MHA, {"noncontiguous": True, "head_size": 65}, 2, LINEAR_STAGE),
        (
            KVFormat.VLLM_CROSS_LAYER,
            {"noncontiguous": True, "head_size": 7, "dtype": torch.uint8},
            1,
            LINEAR_STAGE,
        ),
        (
            KVFormat.VLLM_MLA,
            {"head_size": 132, "dtype": torch.int8, "block_size": 16},
            16,
            LINEAR_BOTH,
        ),
        (
            KVFormat.VLLM_MLA,
            {"head_size": 132, "dtype": torch.int8, "block_size": 1},
            4,
            LINEAR_BOTH,
        ),
        (
            KVFormat.SGLANG_MLA,
            {"head_size": 132, "dtype": torch.int8, "noncontiguous": True},
            4,
            LINEAR_STAGE,
        ),
    ],
)
def test_widest_vector_dividing_runs_and_addresses(
    fmt: KVFormat, kwargs: dict[str, Any], vec: int, linear: int
) -> None:
    """Each group gets the widest of 16/8/4/2/1 bytes dividing its runs and addresses."""
    layout = _layout(fmt, **kwargs)
    plan = build_plan(layout, 2 * layout.block_size)
    assert [(g.vec_bytes, g.linear) for g in plan.groups] == [(vec, linear)]


def test_scatter_into_head_major_blocks_writes_the_cache_linearly() -> None:
    """HND blocks: gather follows staging order, scatter follows cache order (linear dst)."""
    layout = _layout(KVFormat.VLLM_FLASHINFER, noncontiguous=True, num_heads=4, block_size=8)
    gather = build_plan(layout, 16, gather=True).groups[0]
    scatter = build_plan(layout, 16, gather=False).groups[0]
    assert (gather.linear, gather.inner, gather.stage_strides) == (LINEAR_STAGE, 4, (64, 16))
    assert (scatter.linear, scatter.inner, scatter.stage_strides) == (LINEAR_CACHE, 8, (16, 64))


def test_vector_width_is_capped_by_request_and_staging_alignment() -> None:
    """max_vector_bytes and a less aligned staging buffer narrow the vector."""
    layout = _layout(KVFormat.VLLM_FLASH_ATTN)
    assert build_plan(layout, 8, max_vector_bytes=2).groups[0].vec_bytes == 2
    assert build_plan(layout, 8, staging_alignment=4).groups[0].vec_bytes == 4
    with pytest.raises(ValueError, match="max_vector_bytes must be one of"):
        build_plan(layout, 8, max_vector_bytes=3)


def test_table_layout_and_tile_counts() -> None:
    """Header, groups and entries sit where the kernel expects; tiles cover every segment."""
    specs = [(2, 64, torch.bfloat16), (1, 132, torch.int8), (2, 64, torch.bfloat16)]
    layout = _layout(KVFormat.VLLM_FLASH_ATTN, layer_specs=specs, block_size=16, num_blocks=4)
    plan = build_plan(layout, 64)
    assert (HEADER.itemsize, GROUP.itemsize, ENTRY.itemsize) == (56, 128, 32)
    assert plan.groups_offset == HEADER_BYTES
    assert plan.entries_offset == HEADER_BYTES + 2 * GROUP.itemsize
    assert plan.table.nbytes == plan.entries_offset + (2 * 2 + 2 * 1) * ENTRY.itemsize
    header = plan.table[: HEADER.itemsize].view(HEADER)[0]
    assert (int(header["num_groups"]), int(header["blocks_per_chunk"])) == (2, 4)
    assert (plan.chunk_tokens, plan.blocks_per_chunk) == (64, 4)
    assert all(g.run_bytes == g.seg_bytes for g in plan.groups)  # contiguous: a run per block
    assert int(header["chunk_bytes"]) == layout.chunk_nbytes(64)
    for g in plan.groups:
        mode, unit = (g.linear | STAGED, 16) if g.staged else (g.linear, g.vec_bytes)
        wide = is_wide(g.vec_bytes, g.linear, g.staged)
        assert g.iters == (DEFAULT_WIDE_ITERS if wide else DEFAULT_ITERS)
        per_tile = 32 * unroll(g.vec_bytes, mode) * g.iters * unit
        assert g.tiles_per_seg == -(-g.seg_bytes // per_tile)
    assert plan.groups[0].tile_begin == 0
    assert plan.groups[0].tile_end == plan.groups[1].tile_begin
    assert plan.groups[1].tile_end == plan.tiles_per_chunk


class _Memory:
    """Bounds-checked byte moves between the CPU tensors of one test."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.ranges = [
            (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors
        ]

    def check(self, addr: int, size: int) -> None:
        assert any(lo <= addr and addr + size <= lo + n for lo, n in self.ranges), hex(addr)

    def move(self, dst: int, src: int, size: int) -> None:
        self.check(dst, size)
        self.check(src, size)
        ctypes.memmove(dst, src, size)

    def read(self, addr: int, size: int) -> bytes:
        self.check(addr, size)
        return ctypes.string_at(addr, size)

    def write(self, addr: int, data: bytes) -> None:
        self.check(addr, len(data))
        ctypes.memmove(addr, data, len(data))


def _bytes_at(memory: _Memory, addr: int, next_granule: bool) -> bytes:
    """The kernel's bytes_at: 16 bytes at addr from the aligned granule(s) it reads."""
    base = addr & ~15
    both = memory.read(base, 16) + (memory.read(base + 16, 16) if next_granule else bytes(16))
    return both[addr - base : addr - base + 16]


def _staged_granule(
    memory: _Memory, src: int, d: int, run_bytes: int, inner: int, strides: tuple[int, int]
) -> bytes:
    """The 16 destination bytes at segment offset d of a staged group, as the kernel reads them."""
    r, c = divmod(d, run_bytes)
    outer, at = divmod(r, inner)
    a = src + outer * strides[0] + at * strides[1] + c
    n = min(16, run_bytes - c)
    out = _bytes_at(memory, a, (a & 15) + n > 16)
    if n < 16:
        outer, at = divmod(r + 1, inner)
        b = src + outer * strides[0] + at * strides[1] - n
        out = out[:n] + _bytes_at(memory, b, (b & 15) != 0)[n:]
    return out


def _tiled_segment(
    memory: _Memory,
    src: int,
    dst: int,
    g: Any,
    strides: tuple[int, int],
) -> None:
    """A tiled group's CTA: the source span copied whole (as shared memory), then every
    destination granule built from that copy by the staged path's addressing."""
    span = int(g["span"])
    assert src % 16 == 0 and dst % 16 == 0 and span % 16 == 0
    buffer = torch.empty(span + 16, dtype=torch.uint8)
    shared = buffer.data_ptr() + (-buffer.data_ptr() % 16)  # shared memory is 16-byte aligned
    ctypes.memmove(shared, memory.read(src, span), span)
    local = _Memory([])
    local.ranges = [(shared, span)]  # reads outside the span fail
    run_bytes, inner = int(g["run_vecs"]["d"]), int(g["inner"]["d"])
    for j in range(int(g["seg_vecs"])):
        memory.write(
            dst + j * 16, _staged_granule(local, shared, j * 16, run_bytes, inner, strides)
        )


def _div(record: Any, name: str) -> tuple[int, int, int]:
    f = record[name]
    return int(f["d"]), int(f["m"]), int(f["s"])


def _emulate(
    plan: TransferPlan,
    ids: torch.Tensor,
    skip: torch.Tensor,
    staging: torch.Tensor,
    memory: _Memory,
    gather: bool,
) -> None:
    """The kernel's per-warp-tile addressing, one lane and one vector at a time."""
    header = plan.table[: HEADER.itemsize].view(HEADER)[0]
    groups = plan.table[plan.groups_offset : plan.entries_offset].view(GROUP)
    entries = plan.table[plan.entries_offset :].view(ENTRY)
    per_chunk = int(header["blocks_per_chunk"])
    tpc = _div(header, "tiles_per_chunk")
    for tile in range(ids.shape[0] * plan.tiles_per_chunk):
        chunk = fast_divide(tile, tpc)
        rem = tile - chunk * tpc[0]
        gi = 0
        while gi + 1 < int(header["num_groups"]) and rem >= int(groups[gi]["tile_end"]):
            gi += 1
        g = groups[gi]
        if not int(g["tile_begin"]) <= rem < int(g["tile_end"]):
            continue  # padding that aligns a tiled group to a CTA
        rem -= int(g["tile_begin"])
        tps = _div(g, "tiles_per_seg")
        seg = fast_divide(rem, tps)
        seg_tile = rem - seg * tps[0]
        kv_layer = fast_divide(seg, _div(header, "per_chunk_div"))
        block = seg - kv_layer * per_chunk
        if block < int(skip[chunk]):
            continue
        e = entries[int(g["first_entry"]) + kv_layer]
        cache = int(e["base"]) + int(ids[chunk, block]) * int(e["s_block"])
        stage = (
            staging.data_ptr()
            + chunk * int(header["chunk_bytes"])
            + int(g["stage_offset"])
            + kv_layer * int(g["layer_stage_bytes"])
            + block * int(g["seg_bytes"])
        )
        vec = 1 << int(g["vec_log2"])
        linear = int(g["linear"])
        if linear & PREFETCH_GAPS:  # prefetches only: no bytes move
            assert not gather and linear & ORDER_BITS == LINEAR_STAGE
        if linear & TILED:
            if linear & WARP_TILED:  # a warp per segment, in the warp's shared memory
                assert int(g["tiles_per_seg"]["d"]) == 1
                assert WARPS_PER_CTA * int(g["span"]) <= TILE_SPAN_MAX
            else:
                assert int(g["tiles_per_seg"]["d"]) == WARPS_PER_CTA
                assert (tile - seg_tile) % WARPS_PER_CTA == 0, "a tiled segment spans two CTAs"
            if seg_tile == 0:  # the CTA's (or the warp's) threads move the segment together
                src_strides = (
                    (int(e["s_outer"]), int(e["s_inner"]))
                    if gather
                    else (int(g["stage_outer"]), int(g["stage_inner"]))
                )
                src, dst = (cache, stage) if gather else (stage, cache)
                _tiled_segment(memory, src, dst, g, src_strides)
            continue
        steps = unroll(vec, linear) * int(g["iters"])
        run_vecs, inner = _div(g, "run_vecs"), _div(g, "inner")
        for lane in range(32):
            for u in range(steps):
                v = seg_tile * 32 * steps + u * 32 + lane
                if v >= int(g["seg_vecs"]):
                    continue
                if linear & STAGED:
                    src_strides = (
                        (int(e["s_outer"]), int(e["s_inner"]))
                        if gather
                        else (int(g["stage_outer"]), int(g["stage_inner"]))
                    )
                    src, dst = (cache, stage) if gather else (stage, cache)
                    granule = _staged_granule(
                        memory, src, v * 16, run_vecs[0], inner[0], src_strides
                    )
                    memory.write(dst + v * 16, granule)
                    continue
                run = fast_divide(v, run_vecs)
                outer = fast_divide(run, inner)
                index = (outer, run - outer * inner[0])
                word = (v - run * run_vecs[0]) * vec
                at_cache = index[0] * int(e["s_outer"]) + index[1] * int(e["s_inner"]) + word
                at_stage = (
                    index[0] * int(g["stage_outer"]) + index[1] * int(g["stage_inner"]) + word
                )
                if linear & ORDER_BITS in (LINEAR_BOTH, LINEAR_CACHE):
                    at_cache = v * vec
                if linear & ORDER_BITS in (LINEAR_BOTH, LINEAR_STAGE):
                    at_stage = v * vec
                src, dst = (cache + at_cache, stage + at_stage)
                memory.move(*((dst, src) if gather else (src, dst)), vec)


@pytest.mark.parametrize(("max_vec", "iters"), [(16, 1), (4, 3), (1, 1)])
@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [
        (KVFormat.VLLM_CROSS_LAYER, {"noncontiguous": True}),
        (
            KVFormat.VLLM_FLASH_ATTN,
            {"layer_specs": [(2, 8, torch.bfloat16), (1, 12, torch.float8_e5m2)]},
        ),
        (KVFormat.VLLM_FLASHINFER, {"noncontiguous": True, "head_size": 132, "dtype": torch.int8}),
        (KVFormat.SGLANG_MHA, {"noncontiguous": True, "num_heads": 3}),
        (KVFormat.VLLM_MLA, {"head_size": 132, "dtype": torch.int8, "noncontiguous": True}),
        (KVFormat.SGLANG_MLA, {"head_size": 20, "dtype": torch.float32}),
    ],
    ids=lambda x: x.value if isinstance(x, KVFormat) else "",
)
def test_kernel_addressing_matches_the_reference(
    fmt: KVFormat, kwargs: dict[str, Any], max_vec: int, iters: int
) -> None:
    """Gather and scatter through the emulated kernel equal the reference, byte for byte."""
    gen = torch.Generator().manual_seed(max_vec)
    caches, kw = make_kv_caches(fmt, num_blocks=6, block_size=2, generator=gen, **kwargs)
    layout = KVLayout.from_kv_caches(caches, **kw)
    ids = torch.tensor([[4, 1, 3], [0, 5, 2]])
    skip = torch.tensor([1, 0])
    steps = {"iters": iters, "wide_iters": iters + 1}  # both kinds of group, apart
    plan = build_plan(layout, 3 * layout.block_size, max_vector_bytes=max_vec, **steps)
    for g in plan.groups:
        assert g.iters == (iters + 1 if is_wide(g.vec_bytes, g.linear, g.staged) else iters)
    nbytes = plan.chunk_bytes
    staging = torch.full((2, nbytes), 0xA5, dtype=torch.uint8)
    want = staging.clone()
    transfer_reference(layout, want, ids, skip, gather=True)
    memory = _Memory([*flat_tensors(caches), staging])
    _emulate(plan, ids, skip, staging, memory, gather=True)
    assert torch.equal(staging, want)

    target, _ = make_kv_caches(fmt, num_blocks=6, block_size=2, generator=gen, **kwargs)
    target_layout = KVLayout.from_kv_caches(target, **kw)
    expected, _ = make_kv_caches(fmt, num_blocks=6, block_size=2, **kwargs)
    for dst, src in zip(flat_tensors(expected), flat_tensors(target), strict=True):
        dst.copy_(src)
    transfer_reference(KVLayout.from_kv_caches(expected, **kw), staging, ids, skip, gather=False)
    plan = build_plan(
        target_layout, 3 * layout.block_size, gather=False, max_vector_bytes=max_vec, **steps
    )
    memory = _Memory([*flat_tensors(target), staging])
    _emulate(plan, ids, skip, staging, memory, gather=False)
    for got, exp in zip(flat_tensors(target), flat_tensors(expected), strict=True):
        assert np.array_equal(got.view(torch.uint8).numpy(), exp.view(torch.uint8).numpy())


STAGED_CASES = [
    # (format, make_kv_caches kwargs, gather staged, scatter staged); 2 heads x 16 tokens
    (KVFormat.VLLM_FLASHINFER, {"head_size": 132, "dtype": torch.int8}, True, True),
    (KVFormat.VLLM_FLASHINFER, {"head_size": 129, "dtype": torch.uint8}, True, True),
    (KVFormat.VLLM_FLASHINFER, {"head_size": 65, "dtype": torch.bfloat16}, True, True),
    # padded rows: a gather reads whole granules over the padding; a scatter must not
    # write it, so it keeps its narrow vectors
    (KVFormat.SGLANG_MLA, {"head_size": 132, "dtype": torch.int8}, True, False),
    # a 2112-byte page: staged, tiled a warp per segment (under TILE_MIN_BYTES)
    (KVFormat.VLLM_FLASHINFER, {"head_size": 66, "dtype": torch.int8}, True, True),
]


@pytest.mark.parametrize(("fmt", "kwargs", "gather_staged", "scatter_staged"), STAGED_CASES)
def test_narrow_groups_with_a_linear_aligned_destination_are_staged(
    fmt: KVFormat, kwargs: dict[str, Any], gather_staged: bool, scatter_staged: bool
) -> None:
    """Narrow vectors become 16-byte granules where the destination allows, never with a cap."""
    layout = _layout(fmt, noncontiguous=True, num_heads=2, block_size=16, **kwargs)
    gather = build_plan(layout, 32, gather=True).groups[0]
    scatter = build_plan(layout, 32, gather=False).groups[0]
    assert (gather.staged, scatter.staged) == (gather_staged, scatter_staged)
    assert gather.vec_bytes < 16 and scatter.vec_bytes < 16
    assert not build_plan(layout, 32, max_vector_bytes=8).groups[0].staged
    assert not build_plan(layout, 32, staging_alignment=8).groups[0].staged
    assert not build_plan(layout, 32, gather=True).all_linear


@pytest.mark.parametrize(("tiled", "iters"), [(True, 1), (False, 1), (False, 3)])
@pytest.mark.parametrize(("fmt", "kwargs", "gather_staged", "scatter_staged"), STAGED_CASES)
def test_staged_addressing_matches_the_reference(
    fmt: KVFormat,
    kwargs: dict[str, Any],
    gather_staged: bool,
    scatter_staged: bool,
    tiled: bool,
    iters: int,
) -> None:
    """The emulated staged kernel (granule reads bounds-checked), from global memory or
    through a shared-memory copy of each segment's span (tiled), moves exactly the
    reference's bytes both ways, runs straddling granules and runs of other heads included."""
    gen = torch.Generator().manual_seed(iters)
    shape: dict[str, Any] = {
        "num_blocks": 6,
        "block_size": 16,
        "num_heads": 2,
        "noncontiguous": True,
    }
    caches, kw = make_kv_caches(fmt, generator=gen, **shape, **kwargs)
    layout = KVLayout.from_kv_caches(caches, **kw)
    ids = torch.tensor([[4, 1], [0, 5]])
    skip = torch.tensor([1, 0])
    plan = build_plan(layout, 32, iters=iters, tiled=tiled)
    assert plan.groups[0].staged == gather_staged
    small = plan.groups[0].seg_bytes < TILE_MIN_BYTES
    assert bool(plan.groups[0].span) == (tiled and gather_staged)
    assert plan.groups[0].warp_tiled == (tiled and gather_staged and small)
    staging = torch.full((2, plan.chunk_bytes), 0xA5, dtype=torch.uint8)
    want = staging.clone()
    transfer_reference(layout, want, ids, skip, gather=True)
    _emulate(plan, ids, skip, staging, _Memory([*flat_tensors(caches), staging]), True)
    assert torch.equal(staging, want)

    target, _ = make_kv_caches(fmt, generator=gen, **shape, **kwargs)
    expected, _ = make_kv_caches(fmt, **shape, **kwargs)
    for dst, src in zip(flat_tensors(expected), flat_tensors(target), strict=True):
        dst.copy_(src)
    transfer_reference(KVLayout.from_kv_caches(expected, **kw), staging, ids, skip, gather=False)
    plan = build_plan(
        KVLayout.from_kv_caches(target, **kw), 32, gather=False, iters=iters, tiled=tiled
    )
    assert plan.groups[0].staged == scatter_staged
    assert bool(plan.groups[0].span) == (tiled and scatter_staged)
    assert plan.groups[0].warp_tiled == (tiled and scatter_staged and small)
    _emulate(plan, ids, skip, staging, _Memory([*flat_tensors(target), staging]), False)
    for got, exp in zip(flat_tensors(target), flat_tensors(expected), strict=True):
        assert np.array_equal(got.view(torch.uint8).numpy(), exp.view(torch.uint8).numpy())


def test_tiled_groups_start_on_a_cta_and_fit_shared_memory() -> None:
    """A tiled group after a plain one starts on a CTA boundary (padding tiles between), a
    chunk's tiles are whole CTAs, and the launch's shared memory is the largest span; a
    segment larger than TILE_SPAN_MAX stays staged from global memory."""
    specs = [(1, 64, torch.bfloat16), (2, 132, torch.int8)]
    layout = _layout(
        KVFormat.VLLM_FLASHINFER, noncontiguous=True, num_heads=2, block_size=16, layer_specs=specs
    )
    plan = build_plan(layout, 32)
    plain, tiled = plan.groups
    assert (plain.span, plain.tile_end) == (0, 4)
    assert (tiled.span, tiled.tiles_per_seg, tiled.tile_begin) == (4224, WARPS_PER_CTA, 8)
    assert plan.tiles_per_chunk % WARPS_PER_CTA == 0
    assert plan.shared_bytes == 4224
    group = build_plan(_int8_hnd(num_heads=8, block_size=64, head_size=132), 64).groups[0]
    assert TILE_SPAN_MAX < 8 * 64 * 132
    assert group.staged and group.span == 0


@pytest.mark.parametrize("tiled_first", [False, True])
def test_mixed_plain_and_tiled_groups_match_the_reference(tiled_first: bool) -> None:
    """Padding tiles before a tiled group, or ending a chunk so the next chunk's tiled
    segments start on a CTA, move nothing; both groups land byte for byte."""
    specs = [(1, 64, torch.bfloat16), (2, 132, torch.int8)][:: -1 if tiled_first else 1]
    shape: dict[str, Any] = {
        "num_blocks": 6,
        "block_size": 16,
        "num_heads": 2,
        "noncontiguous": True,
        "layer_specs": specs,
    }
    gen = torch.Generator().manual_seed(7)
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASHINFER, generator=gen, **shape)
    layout = KVLayout.from_kv_caches(caches, **kw)
    ids = torch.tensor([[4, 1], [0, 5]])
    skip = torch.tensor([1, 0])
    plan = build_plan(layout, 32)
    staging = torch.full((2, plan.chunk_bytes), 0xA5, dtype=torch.uint8)
    want = staging.clone()
    transfer_reference(layout, want, ids, skip, gather=True)
    memory = _Memory([*flat_tensors(caches), staging])
    _emulate(plan, ids, skip, staging, memory, True)
    assert torch.equal(staging, want)


def test_small_segments_are_tiled_a_warp_each() -> None:
    """Segments under TILE_MIN_BYTES take one warp tile each (no CTA padding) and a slice
    of shared memory per warp; a padded-row gather is one of them, its scatter is not."""
    plan = build_plan(_int8_hnd(num_heads=2, block_size=16, head_size=66, num_layers=3), 32)
    (group,) = plan.groups
    assert group.seg_bytes < TILE_MIN_BYTES
    assert (group.warp_tiled, group.span, group.tiles_per_seg) == (True, 2112, 1)
    assert plan.tiles_per_chunk == 2 * 3 * 2  # kv x layers x blocks: no padding to a CTA
    assert plan.shared_bytes == WARPS_PER_CTA * 2112
    padded = _layout(
        KVFormat.SGLANG_MLA, noncontiguous=True, block_size=16, head_size=132, dtype=torch.int8
    )
    assert build_plan(padded, 32).groups[0].warp_tiled
    assert not build_plan(padded, 32, gather=False).groups[0].span


def test_scatter_into_padded_rows_prefetches_its_partial_sectors() -> None:
    """Only a scatter whose (non-linear) cache destination has holes between its runs is
    marked to prefetch; gathers and dense destinations are not."""
    padded = _layout(
        KVFormat.SGLANG_MLA, noncontiguous=True, block_size=16, head_size=132, dtype=torch.int8
    )
    assert build_plan(padded, 32, gather=False).groups[0].prefetch_gaps
    assert not build_plan(padded, 32, gather=True).groups[0].prefetch_gaps
    table = build_plan(padded, 32, gather=False).table
    record = table[HEADER_BYTES : HEADER_BYTES + GROUP.itemsize].view(GROUP)[0]
    assert int(record["linear"]) == LINEAR_STAGE | PREFETCH_GAPS
    dense = _layout(KVFormat.VLLM_FLASH_ATTN, noncontiguous=True, block_size=16)
    assert not build_plan(dense, 32, gather=False).groups[0].prefetch_gaps
    assert (
        not build_plan(_layout(KVFormat.VLLM_FLASH_ATTN), 32, gather=False).groups[0].prefetch_gaps
    )


def test_wide_groups_take_their_own_steps_per_tile() -> None:
    """8- and 16-byte groups, and 4-byte ones linear on both sides, use wide_iters; staged,
    strided 4-byte and narrower groups use iters."""
    assert is_wide(16, LINEAR_STAGE, False) and is_wide(8, LINEAR_CACHE, False)
    assert is_wide(4, LINEAR_BOTH, False)
    assert not is_wide(4, LINEAR_STAGE, False) and not is_wide(2, LINEAR_BOTH, False)
    assert not is_wide(4, LINEAR_BOTH, True)
    hnd = _layout(KVFormat.VLLM_FLASHINFER, noncontiguous=True, block_size=16)
    assert build_plan(hnd, 32, iters=3, wide_iters=2).groups[0].iters == 2
    assert build_plan(hnd, 32, iters=3, wide_iters=2, max_vector_bytes=4).groups[0].iters == 3
