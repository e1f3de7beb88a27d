"""KV heads split between the ranks of a tensor-parallel engine, and merged back.

With tensor parallelism each of `world_size` ranks computes attention for a contiguous
share of the KV heads: rank r holds heads [r * H / W, (r + 1) * H / W) of every layer.
KV here is the model's `[num_layers, 2, num_tokens, num_kv_heads, head_size]`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: The axis of the KV heads in `[NL, 2, T, NH, HS]`.
HEAD_AXIS = 3


def heads_of_rank(num_heads: int, world_size: int, rank: int) -> range:
    """The KV heads rank `rank` of `world_size` holds; the world size must divide `num_heads`."""
    if world_size < 1 or num_heads % world_size:
        raise ValueError(f"world_size {world_size} does not divide {num_heads} KV heads evenly")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    share = num_heads // world_size
    return range(rank * share, (rank + 1) * share)


def split_heads(kv: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Each rank's share of `kv`'s heads, in rank order (contiguous copies, on kv's device)."""
    num_heads = kv.shape[HEAD_AXIS]
    return [
        kv[:, :, :, heads.start : heads.stop].contiguous()
        for heads in (heads_of_rank(num_heads, world_size, r) for r in range(world_size))
    ]


def merge_heads(shares: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The full-head KV on `device` from every rank's share, given in rank order."""
    if not shares:
        raise ValueError("merge_heads needs the share of at least one rank")
    return torch.cat([share.to(device) for share in shares], dim=HEAD_AXIS)
