"""Copies straight into KV blocks (`DirectLayers`): run on CPU memory row by row, as the
copy engine runs a 2-D copy, they put every byte where the reference scatter does, and
they are few where the blocks are in order; layouts whose blocks do not hold a layer's
bytes in order, and tables too fragmented, are left to the staged path (None)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine.direct import Copy2D, DirectLayers
from kvflow.kernels import KVLayout
from kvflow.kernels.formats import KVFormat
from kvflow.kernels.layout import LayerGroup, StrideDesc
from kvflow.kernels.reference import transfer_reference
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import same_bytes

BLOCK, PER_CHUNK, CHUNKS, NUM_BLOCKS = 4, 3, 5, 40
SKIPS = [0, 1, 0, 2, 3]  # the fourth chunk keeps its first two blocks, the last all three
GAP = 64  # bytes between L1 objects in the host buffer


def _run(copies: list[Copy2D]) -> None:
    """Do each 2-D copy the way the copy engine does: row by row, at the pitches."""
    for c in copies:
        for row in range(c.height):
            ctypes.memmove(c.dst + row * c.dst_pitch, c.src + row * c.src_pitch, c.width)


def _setup(
    fmt: KVFormat, noncontiguous: bool, table: np.ndarray, specs: Any = None
) -> dict[str, Any]:
    """Source objects gathered from one cache (layer `specs` if given), a target cache,
    and what the reference scatter makes of the target."""
    chunk_tokens = PER_CHUNK * BLOCK
    more: dict[str, Any] = {"layer_specs": specs} if specs else {}

    def caches(seed: int) -> tuple[Any, dict[str, Any]]:
        return make_kv_caches(
            fmt, num_layers=3, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_heads=2,
            head_size=8, noncontiguous=noncontiguous, generator=torch.Generator().manual_seed(seed),
            **more,
        )  # fmt: skip

    src, kw = caches(1)
    layout = KVLayout.from_kv_caches(src, **kw)
    nbytes = layout.chunk_nbytes(chunk_tokens)
    objects = torch.empty((CHUNKS, nbytes + GAP), dtype=torch.uint8)
    chunks = objects[:, :nbytes]
    transfer_reference(
        layout, chunks, torch.from_numpy(table), torch.zeros(CHUNKS, dtype=torch.int64),
        gather=True,
    )  # fmt: skip
    target, _ = caches(2)
    expected, _ = caches(2)
    transfer_reference(
        KVLayout.from_kv_caches(expected, **kw), chunks, torch.from_numpy(table),
        torch.tensor(SKIPS), gather=False,
    )  # fmt: skip
    hosts = [int(objects[c].data_ptr()) for c in range(CHUNKS)]
    return {
        "layout": KVLayout.from_kv_caches(target, **kw), "target": target,
        "expected": expected, "hosts": hosts, "chunk_tokens": chunk_tokens,
        "objects": objects,  # the memory at `hosts`: alive as long as the test needs it
    }  # fmt: skip


def _in_order() -> np.ndarray:
    """Blocks allocated one after another (a fresh request), starting at block 7."""
    return np.arange(7, 7 + CHUNKS * PER_CHUNK, dtype=np.int64).reshape(CHUNKS, PER_CHUNK)


def _shuffled() -> np.ndarray:
    ids = np.random.default_rng(5).permutation(NUM_BLOCKS)[: CHUNKS * PER_CHUNK]
    return ids.reshape(CHUNKS, PER_CHUNK).astype(np.int64)


@pytest.mark.parametrize("fmt", list(KVFormat), ids=[f.value for f in KVFormat])
@pytest.mark.parametrize("table", [_in_order, _shuffled], ids=["in-order", "shuffled"])
def test_direct_copies_land_every_byte_where_the_scatter_does(fmt: KVFormat, table: Any) -> None:
    s = _setup(fmt, False, table())
    direct = DirectLayers(
        s["layout"], table(), SKIPS, s["hosts"], s["chunk_tokens"], max_copies=10_000
    )
    for layer in range(s["layout"].num_layers):
        copies = direct.copies(layer)
        assert copies is not None, f"layer {layer} of {fmt.value} was not planned"
        _run(copies)
    assert same_bytes(s["target"], s["expected"])


@pytest.mark.parametrize("fmt", list(KVFormat), ids=[f.value for f in KVFormat])
def test_blocks_in_order_take_one_copy_per_chunk_part_and_layer(fmt: KVFormat) -> None:
    """In-order blocks with skips: one copy per part (K, V) per chunk that keeps blocks
    (its blocks as one row where they are contiguous, as rows where blocks are spaced out,
    K and V interleaved), exactly the kept blocks' bytes."""
    s = _setup(fmt, False, _in_order())
    direct = DirectLayers(s["layout"], _in_order(), SKIPS, s["hosts"], s["chunk_tokens"])
    kv_size = 1 if fmt.is_mla else 2
    kept = sum(PER_CHUNK - skip for skip in SKIPS)  # 3 + 2 + 3 + 1 + 0 blocks
    group = s["layout"].groups[0]
    for layer in range(s["layout"].num_layers):
        copies = direct.copies(layer)
        assert copies is not None
        assert len(copies) == 4 * kv_size  # four chunks keep blocks
        moved = sum(c.height * c.width for c in copies)
        assert moved == kv_size * kept * BLOCK * group.row_bytes


def test_no_skips_and_in_order_blocks_make_one_copy_per_part() -> None:
    s = _setup(KVFormat.VLLM_FLASH_ATTN, False, _in_order())
    direct = DirectLayers(s["layout"], _in_order(), [0] * CHUNKS, s["hosts"], s["chunk_tokens"])
    copies = direct.copies(0)
    assert copies is not None and len(copies) == 2
    block_bytes = BLOCK * 2 * 8 * 2  # tokens x heads x head size x bf16
    for copy in copies:
        assert (copy.height, copy.width) == (CHUNKS, PER_CHUNK * block_bytes)
        assert copy.src_pitch == s["hosts"][1] - s["hosts"][0]
        assert copy.dst_pitch == PER_CHUNK * block_bytes


def test_no_copy_spans_two_regions_of_l1() -> None:
    """Chunks 0-1 in one pinned segment and 2-4 in another (evenly spaced all the same):
    one copy per part and region instead of one per part (a copy across two
    registrations is refused by the driver), every row within its copy's region, and
    every byte still where the scatter puts it."""
    s = _setup(KVFormat.VLLM_FLASH_ATTN, False, _in_order())
    regions = [0, 0, 1, 1, 1]
    whole = DirectLayers(s["layout"], _in_order(), [0] * CHUNKS, s["hosts"], s["chunk_tokens"])
    split = DirectLayers(
        s["layout"], _in_order(), [0] * CHUNKS, s["hosts"], s["chunk_tokens"], regions=regions
    )
    one, two = whole.copies(0), split.copies(0)
    assert one is not None and two is not None
    assert len(one) == 2 and sorted(c.height for c in two) == [2, 2, 3, 3]
    pitch = s["hosts"][1] - s["hosts"][0]
    for copy in two:
        first = (copy.src - s["hosts"][0]) // pitch
        assert len({regions[first + row] for row in range(copy.height)}) == 1
    skipping = DirectLayers(
        s["layout"], _in_order(), SKIPS, s["hosts"], s["chunk_tokens"], regions=regions
    )
    for layer in range(s["layout"].num_layers):
        copies = skipping.copies(layer)
        assert copies is not None
        _run(copies)
    assert same_bytes(s["target"], s["expected"])


@pytest.mark.parametrize("fmt", list(KVFormat), ids=[f.value for f in KVFormat])
def test_layouts_whose_blocks_are_out_of_order_are_left_to_the_scatter(fmt: KVFormat) -> None:
    """Head-major (HND) views and padded MLA rows do not hold a layer's bytes in block
    order: no layer is planned."""
    s = _setup(fmt, True, _in_order())
    direct = DirectLayers(s["layout"], _in_order(), SKIPS, s["hosts"], s["chunk_tokens"])
    planned = [direct.copies(layer) for layer in range(s["layout"].num_layers)]
    assert planned == [None] * s["layout"].num_layers


def test_a_fragmented_table_past_the_copy_limit_is_left_to_the_scatter() -> None:
    s = _setup(KVFormat.VLLM_FLASH_ATTN, False, _shuffled())
    direct = DirectLayers(s["layout"], _shuffled(), SKIPS, s["hosts"], s["chunk_tokens"])
    assert direct.copies(0) is not None  # 10 blocks kept, 20 copies: within the limit
    tight = DirectLayers(
        s["layout"], _shuffled(), SKIPS, s["hosts"], s["chunk_tokens"], max_copies=8
    )
    assert tight.copies(0) is None


def test_layer_groups_with_different_block_strides_get_their_own_copies() -> None:
    """Two layer groups (different heads, sizes and dtypes: different block strides and
    block bytes): each layer's copies are planned for its own group's blocks."""
    specs = [(2, 8, torch.bfloat16), (1, 16, torch.float32), (2, 8, torch.bfloat16)]
    s = _setup(KVFormat.VLLM_FLASH_ATTN, False, _shuffled(), specs)
    direct = DirectLayers(
        s["layout"], _shuffled(), SKIPS, s["hosts"], s["chunk_tokens"], max_copies=10_000
    )
    for layer in range(len(specs)):
        copies = direct.copies(layer)
        assert copies is not None
        _run(copies)
    assert same_bytes(s["target"], s["expected"])


def test_the_copy_limit_counts_a_layer_s_copies_inclusively() -> None:
    """A layer of exactly `max_copies` copies is planned; one fewer allowed, it is not."""
    s = _setup(KVFormat.VLLM_MLA, False, _shuffled())
    plan = DirectLayers(s["layout"], _shuffled(), SKIPS, s["hosts"], s["chunk_tokens"], 10_000)
    full = plan.copies(0)
    assert full is not None
    n = len(full)
    exact = DirectLayers(s["layout"], _shuffled(), SKIPS, s["hosts"], s["chunk_tokens"], n)
    assert exact.copies(0) == full
    short = DirectLayers(s["layout"], _shuffled(), SKIPS, s["hosts"], s["chunk_tokens"], n - 1)
    assert short.copies(0) is None


class _HugeBlocks:
    """A one-layer MLA-like layout whose blocks are 256 MiB apart (a cache of many GB):
    block ids times the stride pass 2**31, which an int32 table must not wrap."""

    block_size = 4
    groups = (LayerGroup((0,), 1, 1, 8, torch.bfloat16),)

    def layer_parts(self, layer: int, chunk_tokens: int) -> list[tuple[int, int]]:
        return [(0, chunk_tokens * 16)]

    def stride_desc(self, layer: int, kv: int) -> StrideDesc:
        return StrideDesc(base_ptr=1 << 40, block=1 << 28, token=16, head=16)


def test_block_addresses_do_not_wrap_for_an_int32_table() -> None:
    table = np.array([[10, 11], [30, 40]], dtype=np.int32)
    direct = DirectLayers(_HugeBlocks(), table, [0, 1], [4096, 8192], 8)  # type: ignore[arg-type]
    copies = direct.copies(0)
    assert copies is not None
    assert [c.dst - (1 << 40) for c in copies] == [10 << 28, 40 << 28]
    assert [(c.height, c.dst_pitch, c.src_pitch) for c in copies] == [(2, 1 << 28, 64), (1, 64, 64)]


class _OneTokenBlocks(_HugeBlocks):
    """Blocks of one token (SGLang's page size 1), whose view's token stride means nothing."""

    block_size = 1

    def stride_desc(self, layer: int, kv: int) -> StrideDesc:
        return StrideDesc(base_ptr=1 << 40, block=16, token=12345, head=16)


def test_one_token_blocks_ignore_the_token_stride() -> None:
    table = np.array([[3, 4], [5, 6]], dtype=np.int64)
    direct = DirectLayers(_OneTokenBlocks(), table, [0, 0], [0, 32], 2)  # type: ignore[arg-type]
    assert direct.copies(0) == [
        Copy2D(dst=(1 << 40) + 48, dst_pitch=64, src=0, src_pitch=64, width=64, height=1)
    ]


def test_the_early_refusal_of_fragmented_tables_never_refuses_a_plan_that_fits() -> None:
    """Shuffled tables are refused from a cheap bound before their pieces are grouped;
    for tables of every kind (runs, strides, shuffles, a mix) a budget of copies gets
    exactly the copies an unbounded plan makes when they fit it, None when they do not."""
    src, kw = make_kv_caches(  # MLA: one part a layer, so one part's copies are the budget's
        "vllm_mla", num_layers=1, num_blocks=200, block_size=BLOCK, head_size=8,
    )  # fmt: skip
    layout = KVLayout.from_kv_caches(src, **kw)
    chunks, per_chunk = 8, 4
    hosts = [4096 + c * 100_000 for c in range(chunks)]
    rng = np.random.default_rng(7)
    tables = [
        np.arange(32).reshape(chunks, per_chunk),  # in order
        (np.arange(32) * 3).reshape(chunks, per_chunk),  # evenly strided
        rng.permutation(200)[:32].reshape(chunks, per_chunk),  # shuffled
        np.concatenate([np.arange(16), rng.permutation(np.arange(100, 200))[:16]]).reshape(
            chunks, per_chunk
        ),  # in order, then shuffled
        np.concatenate([np.arange(0, 32, 2), np.arange(60, 76)]).reshape(chunks, per_chunk),
        # steps of 2 and 5 by turns: pairs of blocks per copy, the bound's tightest case
        np.cumsum([0] + [2, 5] * 15 + [2]).reshape(chunks, per_chunk),
        np.cumsum([0] + [2, 2, 2, 5] * 7 + [2, 2, 2]).reshape(chunks, per_chunk),
    ]
    for table in tables:
        for skips in ([0] * chunks, [1, 0, 3, 0, 0, 2, 0, 4]):
            full = DirectLayers(
                layout, table, skips, hosts, per_chunk * BLOCK, max_copies=10**6
            ).copies(0)
            assert full is not None
            for budget in range(0, len(full) + 3):
                got = DirectLayers(
                    layout, table, skips, hosts, per_chunk * BLOCK, max_copies=budget
                ).copies(0)
                assert got == (full if len(full) <= budget else None), (table, skips, budget)
