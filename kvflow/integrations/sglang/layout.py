"""SGLang host pools as kvflow KV caches: per-layer views of the pool's one buffer.

SGLang's host pool (`HostKVCache.kv_buffer`) is one tensor whose axis order is its
`layout`; every layout is affine, so each layer is a strided view kvflow moves as is:
MHA pools as `vllm_flash_attn` layers `[2, pages, page_size, heads, head_dim]`, MLA
pools as `vllm_mla` layers `[pages, page_size, kv_cache_dim]`, one kvflow block per
SGLang page. kvflow's own chunk layout does not depend on the engine's, so a page
written from one layout reads back into a pool of another. Read through duck typing
(`layout`, `kv_buffer`, `page_size`, `layer_num`), so this module needs no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: MHA buffer shape per layout (SGLang 0.5.23, pool_host/mha.py), K/V first
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
#: MLA buffer shape per layout (pool_host/mla.py)
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")


@dataclass(frozen=True)
class HostPoolViews:
    """What kvflow registers for one host pool: per-layer views, their format, page size."""

    layers: list[torch.Tensor]
    kv_format: str
    page_size: int
    is_mla: bool

    @property
    def num_pages(self) -> int:
        return int(self.layers[0].shape[0 if self.is_mla else 1])


def is_mla_pool(pool: Any) -> bool:
    """Whether `pool` is an MLA host pool (one latent row per token, no K/V split)."""
    return hasattr(pool, "kv_lora_rank")


def host_pool_views(pool: Any) -> HostPoolViews:
    """Per-layer kvflow views of `pool.kv_buffer`; ValueError naming what is unsupported."""
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(
            f"{type(pool).__name__} keeps no single kv_buffer tensor: kvflow maps one host buffer"
        )
    layout, page, layers = pool.layout, int(pool.page_size), int(pool.layer_num)
    if is_mla_pool(pool):
        return HostPoolViews(_mla_layers(buffer, layout, page, layers), "vllm_mla", page, True)
    if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
        raise ValueError(
            f"MHA host pool with head_dim {pool.head_dim} and v_head_dim {pool.v_head_dim}:"
            " kvflow needs K and V of one width"
        )
    return HostPoolViews(
        _mha_layers(pool, buffer, layout, page, layers), "vllm_flash_attn", page, False
    )


def _pages(view: torch.Tensor, dim: int, page: int) -> torch.Tensor:
    """Split a token axis into (pages, page_size)."""
    return view.unflatten(dim, (view.shape[dim] // page, page))


def _mha_layers(
    pool: Any, kv: torch.Tensor, layout: str, page: int, layers: int
) -> list[torch.Tensor]:
    """`[2, pages, page_size, heads, head_dim]` per layer."""
    if layout == "layer_first":  # [2, L, tokens, H, D]
        return [_pages(kv[:, i], 1, page) for i in range(layers)]
    if layout == "page_first":  # [2, tokens, L, H, D]
        return [_pages(kv[:, :, i], 1, page) for i in range(layers)]
    if layout == "page_first_direct":  # [2, pages, L, page_size, H, D]
        return [kv[:, :, i] for i in range(layers)]
    if layout == "page_head":  # [2, pages, H, page_size, L, D]
        return [kv[:, :, :, :, i].transpose(2, 3) for i in range(layers)]
    if layout == "page_unified":  # [pages, head_groups, L, 2, page_size, H / groups, D]
        groups = pool.page_unified_layout.head_group_num
        if groups != 1:
            raise ValueError(
                f"page_unified with {groups} head groups splits the heads of a token across"
                " the page: kvflow needs one head stride (use head_group_num 1 or another layout)"
            )
        return [kv[:, 0, i].transpose(0, 1) for i in range(layers)]
    raise ValueError(
        f"MHA host layout {layout!r} is not supported; supported: {', '.join(MHA_LAYOUTS)}"
    )


def _mla_layers(kv: torch.Tensor, layout: str, page: int, layers: int) -> list[torch.Tensor]:
    """`[pages, page_size, kv_cache_dim]` per layer."""
    if layout == "layer_first":  # [L, tokens, 1, D]
        return [_pages(kv[i, :, 0], 0, page) for i in range(layers)]
    if layout == "page_first":  # [tokens, L, 1, D]
        return [_pages(kv[:, i, 0], 0, page) for i in range(layers)]
    if layout == "page_first_direct":  # [pages, L, page_size, 1, D]
        return [kv[:, i, :, 0] for i in range(layers)]
    if layout == "page_unified":  # [pages, L, page_size, D]
        return [kv[:, i] for i in range(layers)]
    raise ValueError(
        f"MLA host layout {layout!r} is not supported; supported: {', '.join(MLA_LAYOUTS)}"
    )


def page_ids(host_indices: torch.Tensor, page: int, n_pages: int) -> torch.Tensor:
    """The page of each key from SGLang's host indices (page_size token slots per key,
    page-aligned); ValueError when they do not describe `n_pages` whole pages."""
    flat = host_indices.reshape(-1)
    if flat.numel() != n_pages * page:
        raise ValueError(f"{flat.numel()} host indices for {n_pages} keys of {page} tokens each")
    rows = flat.to(torch.int64).view(n_pages, page)
    starts = rows[:, 0]
    if n_pages and (
        bool((starts % page).any())
        or not torch.equal(rows - starts[:, None], torch.arange(page).expand(n_pages, page))
    ):
        raise ValueError(
            "host indices are not whole pages (page_size consecutive slots from a page boundary)"
        )
    return starts // page
