"""Torch reference transfer: vectorised index_select / index_put on byte views.

The CI path and the oracle for the CUDA kernel; runs wherever the tensors live
(CPU, or CUDA when used as the oracle), staging may be on another device.
"""

from __future__ import annotations

import torch

from kvflow.kernels.layout import KVLayout


def transfer_reference(
    layout: KVLayout,
    staging: torch.Tensor,
    block_ids: torch.Tensor,
    skip_blocks: torch.Tensor,
    *,
    gather: bool,
) -> None:
    """Copy blocks between the cache and ``staging`` (arguments already validated).

    block_ids: int64 CPU [chunks, blocks_per_chunk]; skip_blocks: int64 CPU [chunks].
    """
    num_chunks, per_chunk = block_ids.shape
    if num_chunks == 0:
        return
    chunk_tokens = per_chunk * layout.block_size
    cache_dev, stage_dev = layout.device, staging.device
    keep = torch.arange(per_chunk).unsqueeze(0) >= skip_blocks.unsqueeze(1)
    full = bool(keep.all())
    chunk_idx, block_idx = keep.nonzero(as_tuple=True)
    ids = (block_ids.reshape(-1) if full else block_ids[chunk_idx, block_idx]).to(cache_dev)
    chunk_idx, block_idx = chunk_idx.to(stage_dev), block_idx.to(stage_dev)
    count = ids.numel()
    for group, offset in zip(layout.groups, layout.group_offsets(chunk_tokens), strict=True):
        size = group.chunk_nbytes(chunk_tokens)
        parts = staging[:, offset : offset + size].view(
            num_chunks,
            group.kv_size,
            len(group.layers),
            per_chunk,
            layout.block_size,
            group.row_bytes,
        )
        for li, layer in enumerate(group.layers):
            for kv in range(group.kv_size):
                cache = layout.block_views[layer][kv].view(torch.uint8)
                part = parts[:, kv, li]
                if gather:
                    rows = cache[ids].reshape(count, layout.block_size, group.row_bytes)
                    if full:
                        part.copy_(rows.view(part.shape))
                    else:
                        part[chunk_idx, block_idx] = rows.to(stage_dev)
                else:
                    rows = (
                        part.reshape(count, *part.shape[2:]) if full else part[chunk_idx, block_idx]
                    )
                    cache[ids] = rows.to(cache_dev).view(count, *cache.shape[1:])
