"""Token-granular copy of one chunk object's KV into a cache at any (block, offset) slots.

The block kernels move whole blocks, which is all a prefix needs: a prefix chunk starts
on a block boundary. A blend segment (a stored chunk reused elsewhere in a prompt) starts
wherever the prompt put it, usually inside a block, so its tokens land in slots that
straddle blocks. This copies chunks' tokens (their objects' bytes, laid out per group as
[kv, layers, tokens, row]) into given slots with torch indexing, one indexed write per
layer and K/V for a batch of chunks, on whichever device the cache lives (CUDA: queued
on torch's current stream, the chunks' bytes already on that device).
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


def scatter_tokens(
    layout: KVLayout,
    chunks: torch.Tensor,
    chunk_tokens: int,
    blocks: np.ndarray,
    offsets: np.ndarray,
    first_token: int = 0,
) -> None:
    """Write tokens first_token.. of n chunk objects (`chunks`: [n, chunk bytes] uint8 on
    the cache's device, a row per chunk) into the cache slots (blocks[j, i], offsets[j, i]):
    one indexed write per layer and K/V for all n chunks, so few launches on CUDA, and the
    slots go to the device from pinned memory without waiting for the stream.

    ValueError when the chunks' size, device or the slots do not fit the layout."""
    if chunks.dtype != torch.uint8 or chunks.dim() != 2:
        raise ValueError(
            f"chunks must be 2-D uint8 bytes (a row per chunk), got {chunks.dtype}"
            f" {tuple(chunks.shape)}"
        )
    if chunks.shape[1] != layout.chunk_nbytes(chunk_tokens):
        raise ValueError(
            f"a chunk holds {chunks.shape[1]} bytes; {chunk_tokens} tokens of this layout take"
            f" {layout.chunk_nbytes(chunk_tokens)}"
        )
    if chunks.device != layout.device:
        raise ValueError(f"chunks are on {chunks.device}, the cache on {layout.device}")
    n, shapes = len(chunks), (np.shape(blocks), np.shape(offsets))
    count = shapes[0][-1] if len(shapes[0]) == 2 else -1
    if shapes != ((n, count),) * 2 or not 0 <= first_token <= chunk_tokens - count:
        raise ValueError(
            f"slots of shape {shapes[0]} and {shapes[1]} from token {first_token} do not fit"
            f" {n} chunks of {chunk_tokens} tokens"
        )
    slots = np.stack([np.asarray(blocks), np.asarray(offsets)]).astype(np.int64)
    if slots.size and (slots[0].min() < 0 or slots[0].max() >= layout.num_blocks):
        raise ValueError(f"a block id is outside the cache's {layout.num_blocks} blocks")
    if slots.size and (slots[1].min() < 0 or slots[1].max() >= layout.block_size):
        raise ValueError(f"an offset is outside a block of {layout.block_size} tokens")
    host = torch.from_numpy(slots)
    if layout.device.type == "cuda":
        host = host.pin_memory()
    index = host.to(layout.device, non_blocking=True)
    where = (index[0], index[1])
    for group, start in zip(layout.groups, layout.group_offsets(chunk_tokens), strict=True):
        bits = _BITS[group.dtype.itemsize]
        shape = (group.kv_size, len(group.layers), chunk_tokens, group.num_heads, group.head_size)
        part = chunks[:, start : start + group.chunk_nbytes(chunk_tokens)].view(bits)
        part = part.unflatten(1, shape)
        for i, layer in enumerate(group.layers):
            for kv in range(group.kv_size):
                dst = layout.block_views[layer][kv].view(bits)
                dst[where] = part[:, kv, i, first_token : first_token + count]
