"""Paged KV caches in vLLM's layouts, written and read through a block table.

Independent of kvflow on purpose: this is the engine side of the end-to-end
tests, so it indexes the tensors with plain torch views (one per layer, shaped
`[2, NB, BS, NH, HS]`), never with kvflow's stride descriptors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: The paged layouts covered, by their format names (docs/KERNELS.md).
LAYOUTS = ("vllm_flash_attn", "vllm_flashinfer", "vllm_cross_layer")

#: How the caches are held: one tensor (cross-layer) or one per layer.
PagedCaches = torch.Tensor | list[torch.Tensor]
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def _torch_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def allocate(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    empty: Allocator = _torch_empty,
) -> PagedCaches:
    """Uninitialised caches of `layout`; `empty(shape, dtype)` allocates each tensor."""
    page = (block_size, num_heads, head_size)
    if layout == "vllm_flash_attn":
        return [empty((2, num_blocks, *page), dtype) for _ in range(num_layers)]
    if layout == "vllm_flashinfer":
        return [empty((num_blocks, 2, *page), dtype) for _ in range(num_layers)]
    if layout == "vllm_cross_layer":
        return empty((num_blocks, num_layers, 2, *page), dtype)
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def layer_view(caches: PagedCaches, layout: str, layer: int) -> torch.Tensor:
    """Layer `layer` of the caches as a view `[2, num_blocks, block_size, NH, HS]`."""
    if layout == "vllm_flash_attn":
        assert isinstance(caches, list)
        return caches[layer]
    if layout == "vllm_flashinfer":
        assert isinstance(caches, list)
        return caches[layer].transpose(0, 1)
    if layout == "vllm_cross_layer":
        assert isinstance(caches, torch.Tensor)
        return caches[:, layer].transpose(0, 1)
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def num_layers_of(caches: PagedCaches, layout: str) -> int:
    """How many layers the caches hold."""
    return caches.shape[1] if isinstance(caches, torch.Tensor) else len(caches)


def fill(caches: PagedCaches, value: float) -> None:
    """Set every element of every block (a wipe, e.g. with NaN as poison)."""
    for tensor in caches if isinstance(caches, list) else [caches]:
        tensor.fill_(value)


def write_kv(caches: PagedCaches, layout: str, kv: torch.Tensor, block_table: torch.Tensor) -> None:
    """Put `kv` ([NL, 2, T, NH, HS]) where an engine would: token p in block_table[p // BS]."""
    for layer in range(kv.shape[0]):
        view = layer_view(caches, layout, layer)
        block_size = view.shape[2]
        num_tokens = kv.shape[2]
        full, rest = divmod(num_tokens, block_size)
        src = kv[layer].to(view.device)
        if full:
            pages = src[:, : full * block_size].unflatten(1, (full, block_size))
            view[:, block_table[:full].to(view.device)] = pages
        if rest:
            view[:, int(block_table[full]), :rest] = src[:, full * block_size :]


def read_kv(
    caches: PagedCaches, layout: str, num_tokens: int, block_table: torch.Tensor
) -> torch.Tensor:
    """The KV of tokens [0, num_tokens) of the request with `block_table`, as [NL, 2, T, NH, HS]."""
    layers = []
    for layer in range(num_layers_of(caches, layout)):
        view = layer_view(caches, layout, layer)
        block_size = view.shape[2]
        num_pages = -(-num_tokens // block_size)
        pages = view[:, block_table[:num_pages].to(view.device)]  # a copy: [2, P, BS, NH, HS]
        layers.append(pages.flatten(1, 2)[:, :num_tokens])
    return torch.stack(layers).contiguous()


def read_blocks(caches: PagedCaches, layout: str, block_ids: Sequence[int]) -> torch.Tensor:
    """A copy of the given blocks of every layer, [NL, 2, len(block_ids), BS, NH, HS]."""
    pages = []
    for layer in range(num_layers_of(caches, layout)):
        view = layer_view(caches, layout, layer)
        pages.append(view[:, torch.as_tensor(list(block_ids), device=view.device)])
    return torch.stack(pages)


def random_block_table(
    num_blocks: int, num_tokens: int, block_size: int, generator: torch.Generator
) -> torch.Tensor:
    """Distinct random block ids (int64) for a request of `num_tokens` tokens."""
    needed = -(-num_tokens // block_size)
    if needed > num_blocks:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks, the cache has {num_blocks}")
    return torch.randperm(num_blocks, generator=generator)[:needed]
