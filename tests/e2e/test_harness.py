"""The end-to-end harness proven without kvflow: blocks copied by hand pass, broken copies fail.

If these pass, a failure of the server tests is kvflow's, not the harness's.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e import paged_kv
from tests.e2e.scenario import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    RECOMPUTE_RTOL,
    Requests,
    assert_reuse_matches,
)
from tests.e2e.tiny_llama import (
    HEAD_SIZE,
    NUM_KV_HEADS,
    NUM_LAYERS,
    ModelFor,
    continue_from,
    full_logits,
    prefill,
    relative_error,
)


def _allocate(layout: str, dtype: torch.dtype) -> paged_kv.PagedCaches:
    return paged_kv.allocate(
        layout,
        num_layers=NUM_LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        dtype=dtype,
    )


@pytest.mark.parametrize("layout", paged_kv.LAYOUTS)
def test_writer_places_each_token_where_the_layout_says(layout: str) -> None:
    """Token p of layer l lands in block table[p // BS], slot p % BS, of the layout's own axes."""
    gen = torch.Generator().manual_seed(3)
    num_tokens = 3 * BLOCK_SIZE + 5  # a partial last block too
    kv = torch.randn(NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    table = paged_kv.random_block_table(NUM_BLOCKS, num_tokens, BLOCK_SIZE, gen)
    caches = _allocate(layout, torch.float32)
    paged_kv.fill(caches, float("nan"))

    paged_kv.write_kv(caches, layout, kv, table)

    # Index every token in the axis order of docs/KERNELS.md's format table, not the writer's views.
    for layer in range(NUM_LAYERS):
        for half in range(2):
            for pos in range(num_tokens):
                block, slot = int(table[pos // BLOCK_SIZE]), pos % BLOCK_SIZE
                if isinstance(caches, torch.Tensor):  # vllm_cross_layer
                    stored = caches[block, layer, half, slot]
                elif layout == "vllm_flash_attn":
                    stored = caches[layer][half, block, slot]
                else:
                    stored = caches[layer][block, half, slot]
                assert torch.equal(stored, kv[layer, half, pos])
    # The reader inverts the writer.
    assert torch.equal(paged_kv.read_kv(caches, layout, num_tokens, table), kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", paged_kv.LAYOUTS)
def test_hand_copied_blocks_reproduce_the_continuation(
    layout: str,
    dtype: torch.dtype,
    model_for: ModelFor,
    requests: Requests,
) -> None:
    """The scenario of the server tests with a by-hand copy in place of kvflow passes every check."""
    model = model_for(dtype, "cpu")
    gen = torch.Generator().manual_seed(5)
    caches = _allocate(layout, dtype)

    # Request 1 is prefilled and its KV written at a random block table.
    first = prefill(model, requests.prompt)
    table1 = paged_kv.random_block_table(NUM_BLOCKS, len(requests.prompt), BLOCK_SIZE, gen)
    paged_kv.write_kv(caches, layout, first.kv, table1)

    # "Store": copy the shared prefix's blocks out by hand; then poison the whole cache.
    saved = paged_kv.read_kv(caches, layout, requests.shared, table1)
    paged_kv.fill(caches, float("nan"))

    # "Retrieve" into a different random block table for request 2.
    table2 = paged_kv.random_block_table(NUM_BLOCKS, len(requests.second), BLOCK_SIZE, gen)
    assert not torch.equal(table1[: len(table2)], table2)
    paged_kv.write_kv(caches, layout, saved, table2)

    reused = paged_kv.read_kv(caches, layout, requests.shared, table2)
    assert_reuse_matches(model, reused, first.kv[:, :, : requests.shared].contiguous(), requests)


def test_checks_catch_misplaced_or_mixed_up_kv(model_for: ModelFor, requests: Requests) -> None:
    """Each check fails on the mistake it exists for: the harness cannot pass vacuously."""
    model = model_for(torch.float32, "cpu")
    original = prefill(model, requests.prompt).kv[:, :, : requests.shared].contiguous()
    suffix = requests.second[requests.shared :]
    recomputed = full_logits(model, requests.second)[requests.shared :]
    first, second = slice(0, BLOCK_SIZE), slice(BLOCK_SIZE, 2 * BLOCK_SIZE)

    # Two whole blocks swapped (K with its V): only the byte check can see it, because
    # attention sums over (K, V) pairs whatever their order.
    swapped = original.clone()
    swapped[:, :, first], swapped[:, :, second] = original[:, :, second], original[:, :, first]
    with pytest.raises(AssertionError, match="KV differ first at layer 0 K token 0"):
        assert_reuse_matches(model, swapped, original, requests)

    # K of one block paired with V of another, and one layer's K and V exchanged: the
    # continuation moves far beyond the recompute tolerance.
    keys_only = original.clone()
    keys_only[:, 0, first], keys_only[:, 0, second] = original[:, 0, second], original[:, 0, first]
    layer_mixup = original.clone()
    layer_mixup[1] = original[1].flip(0)
    for broken in (keys_only, layer_mixup):
        err = relative_error(continue_from(model, broken, suffix), recomputed)
        assert err > 100 * RECOMPUTE_RTOL[torch.float32]
