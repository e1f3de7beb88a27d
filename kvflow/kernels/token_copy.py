"""Token-granular copy of one chunk object's KV into a cache at any (block, offset) slots.

The block kernels move whole blocks, which is all a prefix needs: a prefix chunk starts
on a block boundary. A blend segment (a stored chunk reused elsewhere in a prompt) starts
wherever the prompt put it, usually inside a block, so its tokens land in slots that
straddle blocks. This copies a chunk's tokens (its object's bytes, laid out per group as
[kv, layers, tokens, row]) into given slots with torch indexing, one indexed write per
layer and K/V, on whichever device the cache lives (CUDA: queued on torch's current
stream, the chunk's bytes already on that device).
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.kernels.layout import KVLayout

#: the integer dtype of each item size: slots are copied as raw bits, whatever the
#: cache dtype (fp8 included, which torch cannot index-assign on every device)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def token_slots(
    block_ids: np.ndarray, start: int, num_tokens: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(block id, offset in block) of each of `num_tokens` tokens that start at offset
    `start` of the first of `block_ids` and run on through the next blocks.

    ValueError when the blocks do not cover them or `start` is outside a block."""
    if not 0 <= start < block_size:
        raise ValueError(f"start {start} is not an offset within a block of {block_size}")
    needed = -(-(start + num_tokens) // block_size)
    if len(block_ids) < needed:
        raise ValueError(
            f"{num_tokens} tokens from offset {start} need {needed} blocks, got {len(block_ids)}"
        )
    positions = start + np.arange(num_tokens)
    return np.asarray(block_ids)[positions // block_size], positions % block_size


def scatter_chunk_tokens(
    layout: KVLayout,
    chunk: torch.Tensor,
    chunk_tokens: int,
    blocks: np.ndarray,
    offsets: np.ndarray,
    first_token: int = 0,
) -> None:
    """Write tokens first_token.. of one chunk object (`chunk`: its uint8 bytes, on the
    cache's device) into the cache slots (blocks[i], offsets[i]), every layer, K and V.

    ValueError when the chunk's size, device or the slots do not fit the layout."""
    count = len(blocks)
    if chunk.dtype != torch.uint8 or chunk.dim() != 1:
        raise ValueError(f"chunk must be 1-D uint8 bytes, got {chunk.dtype} {tuple(chunk.shape)}")
    if chunk.numel() != layout.chunk_nbytes(chunk_tokens):
        raise ValueError(
            f"chunk holds {chunk.numel()} bytes; {chunk_tokens} tokens of this layout take"
            f" {layout.chunk_nbytes(chunk_tokens)}"
        )
    if chunk.device != layout.device:
        raise ValueError(f"chunk is on {chunk.device}, the cache on {layout.device}")
    if len(offsets) != count or not 0 <= first_token <= chunk_tokens - count:
        raise ValueError(
            f"{count} slots from token {first_token} do not fit a chunk of {chunk_tokens} tokens"
        )
    if count and (int(np.min(blocks)) < 0 or int(np.max(blocks)) >= layout.num_blocks):
        raise ValueError(f"a block id is outside the cache's {layout.num_blocks} blocks")
    if count and (int(np.min(offsets)) < 0 or int(np.max(offsets)) >= layout.block_size):
        raise ValueError(f"an offset is outside a block of {layout.block_size} tokens")
    index = (
        torch.as_tensor(np.asarray(blocks, dtype=np.int64)).to(layout.device),
        torch.as_tensor(np.asarray(offsets, dtype=np.int64)).to(layout.device),
    )
    for group, start in zip(layout.groups, layout.group_offsets(chunk_tokens), strict=True):
        bits = _BITS[group.dtype.itemsize]
        shape = (group.kv_size, len(group.layers), chunk_tokens, group.num_heads, group.head_size)
        part = chunk[start : start + group.chunk_nbytes(chunk_tokens)].view(bits).view(shape)
        for i, layer in enumerate(group.layers):
            for kv in range(group.kv_size):
                dst = layout.block_views[layer][kv].view(bits)
                dst[index] = part[kv, i, first_token : first_token + count]
