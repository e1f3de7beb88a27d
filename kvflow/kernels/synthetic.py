"""Synthetic KV caches: random engine-shaped tensors in every supported format.

`kvflow demo` registers them in place of a real engine's paged cache, and the
benchmarks time transfers on them; shapes follow the format table of
docs/KERNELS.md ("KV cache formats"). Nothing here is on a hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.kernels.formats import KVFormat
from kvflow.kernels.layout import KVLayout
from kvflow.kernels.transfer import transfer_blocks

LayerSpec = tuple[int, int, torch.dtype]  # (num_heads, head_size, dtype)


def _fill_random(tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Overwrite every byte of a contiguous tensor with random bytes (NaN patterns included)."""
    raw = tensor.view(torch.uint8).view(-1)
    raw.copy_(
        torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator, device="cpu")
        if tensor.device.type == "cpu" or generator is not None
        else torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=tensor.device)
    )
    return tensor


def _physical(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None,
) -> torch.Tensor:
    return _fill_random(torch.empty(tuple(shape), dtype=dtype, device=device), generator)


@dataclass(frozen=True)
class _Maker:
    """Random tensors of one cache's blocks, per format: contiguous, or (``noncontiguous``)
    head-major permuted views (MHA) and row-padded views (MLA)."""

    num_blocks: int
    block_size: int
    noncontiguous: bool
    device: torch.device | str
    generator: torch.Generator | None

    def physical(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor of random bytes on the maker's device."""
        return _physical(shape, dtype, self.device, self.generator)

    def cross_layer(self, specs: list[LayerSpec]) -> torch.Tensor:
        """One ``[blocks, layers, 2, block_size, heads, head_size]`` tensor."""
        if len(set(specs)) != 1:
            raise ValueError("vllm_cross_layer holds one (num_heads, head_size, dtype) only")
        (nh, hs, dt), nl = specs[0], len(specs)
        nb, bs = self.num_blocks, self.block_size
        if self.noncontiguous:
            return self.physical((nb, nl, 2, nh, bs, hs), dt).permute(0, 1, 2, 4, 3, 5)
        return self.physical((nb, nl, 2, bs, nh, hs), dt)

    def paged(self, specs: list[LayerSpec], kv_first: bool) -> list[torch.Tensor]:
        """A ``[2, blocks, ...]`` (flash-attn, `kv_first`) or ``[blocks, 2, ...]``
        (flashinfer) tensor per layer, each block ``[block_size, heads, head_size]``."""
        lead = (2, self.num_blocks) if kv_first else (self.num_blocks, 2)
        bs = self.block_size
        if self.noncontiguous:
            return [
                self.physical((*lead, nh, bs, hs), dt).permute(0, 1, 3, 2, 4)
                for nh, hs, dt in specs
            ]
        return [self.physical((*lead, bs, nh, hs), dt) for nh, hs, dt in specs]

    def sglang_mha(self, specs: list[LayerSpec]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer ``[tokens, heads, head_size]`` keys, then values."""
        keys = [self._tokens_heads(nh, hs, dt) for nh, hs, dt in specs]
        values = [self._tokens_heads(nh, hs, dt) for nh, hs, dt in specs]
        return keys, values

    def _tokens_heads(self, nh: int, hs: int, dt: torch.dtype) -> torch.Tensor:
        """One ``[tokens, heads, head_size]`` tensor (head-major underneath when permuted)."""
        tokens = self.num_blocks * self.block_size
        if self.noncontiguous:
            return self.physical((nh, tokens, hs), dt).permute(1, 0, 2)
        return self.physical((tokens, nh, hs), dt)

    def mla(self, specs: list[LayerSpec], sglang: bool) -> list[torch.Tensor]:
        """Per-layer latent rows: ``[tokens, 1, head_size]`` (SGLang) or ``[blocks,
        block_size, head_size]`` (vLLM)."""
        pad = 16 if self.noncontiguous else 0
        nb, bs = self.num_blocks, self.block_size
        lead = (nb * bs, 1) if sglang else (nb, bs)
        return [self.physical((*lead, hs + pad), dt)[..., :hs] for _, hs, dt in specs]


def make_kv_caches(
    fmt: KVFormat | str,
    *,
    num_layers: int = 2,
    num_blocks: int = 8,
    block_size: int = 4,
    num_heads: int = 2,
    head_size: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    layer_specs: Sequence[LayerSpec] | None = None,
    noncontiguous: bool = False,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Random KV caches in format ``fmt`` and the kwargs ``KVLayout.from_kv_caches`` needs.

    ``layer_specs`` gives (num_heads, head_size, dtype) per layer (per-layer formats only;
    MLA formats ignore num_heads). ``noncontiguous`` makes head-major (HND) permuted views
    for MHA formats and row-padded views for MLA formats.
    """
    fmt = KVFormat(fmt)
    specs = list(layer_specs) if layer_specs else [(num_heads, head_size, dtype)] * num_layers
    kwargs: dict[str, Any] = {"kv_format": fmt}
    if fmt.is_sglang:
        kwargs["block_size"] = block_size
    make = _Maker(num_blocks, block_size, noncontiguous, device, generator)
    if fmt is KVFormat.VLLM_CROSS_LAYER:
        return make.cross_layer(specs), kwargs
    if fmt in (KVFormat.VLLM_FLASH_ATTN, KVFormat.VLLM_FLASHINFER):
        return make.paged(specs, kv_first=fmt is KVFormat.VLLM_FLASH_ATTN), kwargs
    if fmt is KVFormat.SGLANG_MHA:
        return make.sglang_mha(specs), kwargs
    return make.mla(specs, sglang=fmt is KVFormat.SGLANG_MLA), kwargs


def block_bytes(kv_caches: Any, kwargs: dict[str, Any], block_ids: Sequence[int]) -> torch.Tensor:
    """Each listed block's bytes, one row per block (a one-block chunk in the L1 chunk layout,
    docs/KERNELS.md), gathered by the CPU reference: what a round-trip check compares.

    `kwargs` are the caches' registration keywords (as `make_kv_caches` returns them).
    """
    layout = KVLayout.from_kv_caches(kv_caches, **kwargs)
    out = torch.empty((len(block_ids), layout.chunk_nbytes(layout.block_size)), dtype=torch.uint8)
    ids = torch.tensor(list(block_ids), dtype=torch.int64).view(-1, 1)
    transfer_blocks(layout, out, ids, direction="gather", backend="cpu")
    return out
