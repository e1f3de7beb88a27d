"""The tensor-parallel harness without kvflow: heads split between ranks and merged back.

If these pass, a failure of the tensor-parallel server tests is kvflow's, not the split's.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.scenario import Requests, assert_reuse_matches
from tests.e2e.tiny_llama import NUM_KV_HEADS, ModelFor, prefill
from tests.e2e.tp_heads import heads_of_rank, merge_heads, split_heads


def _kv(num_heads: int) -> torch.Tensor:
    """[NL, 2, T, NH, HS] whose every element names its head (head h holds h)."""
    heads = torch.arange(num_heads, dtype=torch.float32)
    return heads.view(1, 1, 1, num_heads, 1).expand(3, 2, 5, num_heads, 4).contiguous()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_r_holds_its_contiguous_share_of_the_heads(world_size: int) -> None:
    """Rank r gets heads [r * H / W, (r + 1) * H / W) of every layer, K and V, every token."""
    kv = _kv(8)
    shares = split_heads(kv, world_size)
    assert len(shares) == world_size
    for rank, share in enumerate(shares):
        heads = heads_of_rank(8, world_size, rank)
        assert len(heads) == 8 // world_size
        assert share.is_contiguous()
        expected = torch.tensor(list(heads), dtype=kv.dtype).view(1, 1, 1, -1, 1)
        assert torch.equal(share, expected.expand_as(share))
    assert torch.equal(merge_heads(shares, kv.device), kv)


@pytest.mark.parametrize(("world_size", "rank"), [(3, 0), (0, 0), (2, 2), (2, -1)])
def test_a_world_that_cannot_split_the_heads_is_refused(world_size: int, rank: int) -> None:
    with pytest.raises(ValueError, match="world_size"):
        heads_of_rank(8, world_size, rank)


def test_merging_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        merge_heads([], torch.device("cpu"))


def test_shares_merged_in_the_wrong_rank_order_fail_the_bytes_check(
    model_for: ModelFor, requests: Requests
) -> None:
    """A server that gave rank 1 rank 0's heads (and back) is caught by check 1, at head 0."""
    model = model_for(torch.float32, "cpu")
    original = prefill(model, requests.prompt).kv[:, :, : requests.shared].contiguous()
    shares = split_heads(original, NUM_KV_HEADS)
    swapped = merge_heads(shares[::-1], original.device)
    with pytest.raises(AssertionError, match="head 0"):
        assert_reuse_matches(model, swapped, original, requests)
    assert_reuse_matches(model, merge_heads(shares, original.device), original, requests)
