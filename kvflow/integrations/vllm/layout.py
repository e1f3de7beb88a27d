"""vLLM's per-layer KV views, seen as kvflow's `vllm_flash_attn` format (docs/VLLM.md, Layout).

vLLM (0.32+) hands a connector one *manager view* per attention layer, of logical
shape `[num_blocks, num_kv_heads, block_size, 2 * head_size]` (`[B, H, N, C]`, its
strides set by the KV cache layout). How K and V share the last two axes is the
attention backend's business:

- ``"channels"`` (FlashAttention and the other CUDA backends): each token row holds
  K in its first `head_size` elements and V in the next (`split(head_size, dim=-1)`);
- ``"rows"`` (the CPU backend): each (block, head) is re-read as
  `[2 * block_size, head_size]`, K in the first `block_size` rows and V in the rest.

Either way every element sits at an affine address, so a strided view of shape
`[2, num_blocks, block_size, num_kv_heads, head_size]` over the same memory is
exactly kvflow's `vllm_flash_attn` format (KERNELS.md: non-contiguous views are fine
while each head is contiguous). No byte is copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

SPLITS = ("channels", "rows")
KV_FORMAT = "vllm_flash_attn"


def split_for_device(device: torch.device) -> str:
    """The K/V split of vLLM's backend on this device: "rows" on CPU, "channels" on CUDA."""
    return "rows" if device.type == "cpu" else "channels"


def kvflow_view(layer: torch.Tensor, split: str, *, where: str = "kv cache") -> torch.Tensor:
    """One manager view `[B, H, N, 2*D]` as `[2, B, N, H, D]` over the same memory."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if layer.dim() != 4 or layer.shape[3] % 2:
        raise ValueError(
            f"{where}: expected vLLM's [num_blocks, num_kv_heads, block_size, 2 * head_size]"
            f" view, got shape {tuple(layer.shape)}"
        )
    blocks, heads, tokens, channels = layer.shape
    head_size = channels // 2
    s_block, s_head, s_token, s_chan = layer.stride()
    if s_chan != 1:
        raise ValueError(
            f"{where}: each token's channels must be contiguous, strides {layer.stride()}"
        )
    if split == "channels":
        shape = (2, blocks, tokens, heads, head_size)
        strides = (head_size, s_block, s_token, s_head, 1)
    else:
        if s_token != channels:
            raise ValueError(
                f"{where}: the CPU backend re-reads a block's rows as [2 * block_size,"
                f" head_size], which needs rows of {channels} contiguous elements; strides"
                f" {layer.stride()}"
            )
        shape = (2, blocks, tokens, heads, head_size)
        strides = (tokens * head_size, s_block, head_size, s_head, 1)
    return layer.as_strided(shape, strides, layer.storage_offset())


def kvflow_views(kv_caches: Mapping[str, torch.Tensor], split: str) -> list[torch.Tensor]:
    """Every layer's view, in vLLM's layer order (the dict's), one per distinct tensor.

    Layers that share another layer's cache (the same tensor object) are registered once.
    """
    seen: set[int] = set()
    views = []
    for name, tensor in kv_caches.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        views.append(kvflow_view(tensor, split, where=f"kv cache of {name}"))
    return views


def layer_token_bytes(views: list[torch.Tensor]) -> int:
    """One token's bytes (K and V) in the widest of kvflow's [2, blocks, block_size,
    heads, head_size] views of vLLM's layers: what a staging slot needs per token."""
    return max(view[:, 0, 0].numel() * view.element_size() for view in views)
