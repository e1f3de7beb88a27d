"""A chunk object's tokens land in any (block, offset) slots, straddling blocks, bit-exact."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvflow.kernels import KVFormat, KVLayout
from kvflow.kernels.reference import transfer_reference
from kvflow.kernels.synthetic import make_kv_caches
from kvflow.kernels.token_copy import scatter_tokens, token_slots

BLOCK, PER_CHUNK, NUM_BLOCKS = 4, 3, 24
CHUNK_TOKENS = BLOCK * PER_CHUNK
SRC_BLOCKS = [7, 2, 11]
FP8 = (1, 12, torch.float8_e4m3fn)


def _pair(fmt: str, **kw: Any) -> tuple[KVLayout, KVLayout, torch.Tensor]:
    """Source and destination layouts of `fmt`, and the source's blocks as one chunk object."""
    made = [
        make_kv_caches(fmt, num_layers=3, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                       generator=torch.Generator().manual_seed(seed), **kw)
        for seed in (1, 2)
    ]  # fmt: skip
    src, dst = (KVLayout.from_kv_caches(c, **k) for c, k in made)
    chunk = torch.empty((1, src.chunk_nbytes(CHUNK_TOKENS)), dtype=torch.uint8)
    ids = torch.tensor([SRC_BLOCKS])
    transfer_reference(src, chunk, ids, torch.zeros(1, dtype=torch.int64), gather=True)
    return src, dst, chunk[0]


def _row(layout: KVLayout, layer: int, kv: int, block: int, offset: int) -> torch.Tensor:
    return layout.block_views[layer][kv][block, offset].contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", [f.value for f in KVFormat])
@pytest.mark.parametrize("start", [0, 1, 3])
def test_tokens_land_in_their_slots_and_nothing_else_changes(fmt: str, start: int) -> None:
    src, dst, chunk = _pair(fmt)
    before = [[v.clone() for v in layer] for layer in dst.block_views]
    dst_blocks = np.array([5, 19, 0, 9])
    blocks, offsets = token_slots(dst_blocks, start, CHUNK_TOKENS, BLOCK)
    scatter_tokens(dst, chunk[None], CHUNK_TOKENS, blocks[None], offsets[None])
    written = set()
    for t in range(CHUNK_TOKENS):
        b, o = int(blocks[t]), int(offsets[t])
        written.add((b, o))
        for layer in range(3):
            for kv in range(len(dst.block_views[layer])):
                want = _row(src, layer, kv, SRC_BLOCKS[t // BLOCK], t % BLOCK)
                assert torch.equal(_row(dst, layer, kv, b, o), want), (t, layer, kv)
    for layer in range(3):
        for kv, view in enumerate(dst.block_views[layer]):
            for b in range(NUM_BLOCKS):
                for o in range(BLOCK):
                    if (b, o) not in written:
                        got, old = (
                            view[b, o].view(torch.uint8),
                            before[layer][kv][b, o].view(torch.uint8),
                        )
                        assert torch.equal(got, old)


@pytest.mark.parametrize("fmt", [f.value for f in KVFormat])
def test_a_batch_of_chunks_lands_as_each_would_alone(fmt: str) -> None:
    _src, batch, chunk = _pair(fmt)
    _src, alone, _chunk = _pair(fmt)
    chunks = torch.stack([chunk, chunk.flip(0)])  # two chunks of different bytes
    slots = [
        token_slots(np.array(ids), start, CHUNK_TOKENS, BLOCK)
        for ids, start in (([5, 19, 0, 9], 1), ([2, 3, 4, 6], 3))
    ]
    blocks, offsets = (np.stack([s[k] for s in slots]) for k in (0, 1))
    scatter_tokens(batch, chunks, CHUNK_TOKENS, blocks, offsets)
    for j in range(2):
        scatter_tokens(
            alone, chunks[j : j + 1], CHUNK_TOKENS, blocks[j : j + 1], offsets[j : j + 1]
        )
    for got, want in zip(batch.block_views, alone.block_views, strict=True):
        for x, y in zip(got, want, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_two_groups_fp8_and_a_slice_of_the_chunk() -> None:
    specs = [(2, 8, torch.bfloat16), FP8, (2, 8, torch.bfloat16)]
    src, dst, chunk = _pair("vllm_flash_attn", layer_specs=specs)
    blocks, offsets = token_slots(np.array([3, 4]), 2, 5, BLOCK)
    scatter_tokens(dst, chunk[None], CHUNK_TOKENS, blocks[None], offsets[None], first_token=6)
    for i in range(5):
        t = 6 + i
        for layer in range(3):
            for kv in range(2):
                want = _row(src, layer, kv, SRC_BLOCKS[t // BLOCK], t % BLOCK)
                assert torch.equal(_row(dst, layer, kv, int(blocks[i]), int(offsets[i])), want)


def test_slots_that_do_not_fit_are_refused_before_any_write() -> None:
    _src, dst, chunk = _pair("vllm_flash_attn")
    with pytest.raises(ValueError, match="need 4 blocks"):
        token_slots(np.array([1, 2, 3]), 1, CHUNK_TOKENS, BLOCK)
    with pytest.raises(ValueError, match="not an offset within a block"):
        token_slots(np.array([1, 2, 3, 4]), BLOCK, 1, BLOCK)
    blocks, offsets = token_slots(np.array([1, 2, 3, 4]), 1, CHUNK_TOKENS, BLOCK)
    before = [v.clone() for layer in dst.block_views for v in layer]
    bad = [
        (chunk[None, :-1], blocks, offsets, 0, "bytes"),
        (chunk[None].view(torch.int8), blocks, offsets, 0, "uint8"),
        (chunk, blocks, offsets, 0, "2-D"),
        (chunk[None], blocks, offsets, 1, "do not fit"),
        (chunk[None], blocks, offsets[:-1], 0, "do not fit"),
        (chunk.expand(2, -1), blocks, offsets, 0, "do not fit"),
        (chunk[None], np.where(blocks == 4, NUM_BLOCKS, blocks), offsets, 0, "outside the cache"),
        (chunk[None], blocks, np.where(offsets == 0, BLOCK, offsets), 0, "outside a block"),
    ]
    for data, b, o, first, match in bad:
        with pytest.raises(ValueError, match=match):
            scatter_tokens(dst, data, CHUNK_TOKENS, b[None], o[None], first_token=first)
    after = [v for layer in dst.block_views for v in layer]
    assert all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(before, after, strict=True)
    )
