"""Synthetic KV caches: random engine-shaped tensors in every supported format.

`kvflow demo` registers them in place of a real engine's paged cache, and the
benchmarks time transfers on them; shapes follow the format table of
docs/KERNELS.md ("KV cache formats"). Nothing here is on a hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    nb, bs = num_blocks, block_size
    kwargs: dict[str, Any] = {"kv_format": fmt}
    if fmt.is_sglang:
        kwargs["block_size"] = bs

    def mla(hs: int, dt: torch.dtype, sglang: bool) -> torch.Tensor:
        pad = 16 if noncontiguous else 0
        if sglang:
            return _physical((nb * bs, 1, hs + pad), dt, device, generator)[..., :hs]
        return _physical((nb, bs, hs + pad), dt, device, generator)[..., :hs]

    def tokens_heads(nh: int, hs: int, dt: torch.dtype) -> torch.Tensor:
        if noncontiguous:
            return _physical((nh, nb * bs, hs), dt, device, generator).permute(1, 0, 2)
        return _physical((nb * bs, nh, hs), dt, device, generator)

    if fmt is KVFormat.VLLM_CROSS_LAYER:
        if len(set(specs)) != 1:
            raise ValueError("vllm_cross_layer holds one (num_heads, head_size, dtype) only")
        nh, hs, dt = specs[0]
        nl = len(specs)
        if noncontiguous:
            t = _physical((nb, nl, 2, nh, bs, hs), dt, device, generator)
            return t.permute(0, 1, 2, 4, 3, 5), kwargs
        return _physical((nb, nl, 2, bs, nh, hs), dt, device, generator), kwargs
    if fmt is KVFormat.VLLM_FLASH_ATTN:
        if noncontiguous:
            return [
                _physical((2, nb, nh, bs, hs), dt, device, generator).permute(0, 1, 3, 2, 4)
                for nh, hs, dt in specs
            ], kwargs
        return [
            _physical((2, nb, bs, nh, hs), dt, device, generator) for nh, hs, dt in specs
        ], kwargs
    if fmt is KVFormat.VLLM_FLASHINFER:
        if noncontiguous:
            return [
                _physical((nb, 2, nh, bs, hs), dt, device, generator).permute(0, 1, 3, 2, 4)
                for nh, hs, dt in specs
            ], kwargs
        return [
            _physical((nb, 2, bs, nh, hs), dt, device, generator) for nh, hs, dt in specs
        ], kwargs
    if fmt is KVFormat.SGLANG_MHA:
        keys = [tokens_heads(nh, hs, dt) for nh, hs, dt in specs]
        values = [tokens_heads(nh, hs, dt) for nh, hs, dt in specs]
        return (keys, values), kwargs
    return [mla(hs, dt, fmt is KVFormat.SGLANG_MLA) for _, hs, dt in specs], kwargs


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
