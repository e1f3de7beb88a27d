"""Test helpers shipped with the package: KV caches of every format, and a naive model.

The model (``block_of``, ``expected_gather``, ``apply_scatter``) indexes the engine
tensors exactly as the SPEC format table defines them, not through KVLayout's views, so
it checks layout discovery as well as the copy. Used by kvflow's tests, the GPU checks
and the engine's tests; nothing here is on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvflow.kernels.formats import KVFormat
from kvflow.kernels.layout import KVLayout

LayerSpec = tuple[int, int, torch.dtype]  # (num_heads, head_size, dtype)


def fill_random_(tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
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
    return fill_random_(torch.empty(tuple(shape), dtype=dtype, device=device), generator)


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


def block_of(fmt: KVFormat, caches: Any, layer: int, kv: int, block: int, bs: int) -> torch.Tensor:
    """The [BS, NH, HS] slice of one block of one (layer, kv), straight from the SPEC shapes."""
    if fmt is KVFormat.VLLM_CROSS_LAYER:
        return caches[block, layer, kv]
    if fmt is KVFormat.VLLM_FLASH_ATTN:
        return caches[layer][kv, block]
    if fmt is KVFormat.VLLM_FLASHINFER:
        return caches[layer][block, kv]
    if fmt is KVFormat.VLLM_MLA:
        return caches[layer][block].unsqueeze(1)
    if fmt is KVFormat.SGLANG_MHA:
        return caches[kv][layer][block * bs : (block + 1) * bs]
    return caches[layer][block * bs : (block + 1) * bs]


def segments(
    layout: KVLayout, ids: torch.Tensor, skip: list[int]
) -> Iterator[tuple[int, int, int, int, int, int]]:
    """Yield (chunk, layer, kv, block id, staging byte offset, byte length) per moved block."""
    chunks, per_chunk = ids.shape
    chunk_tokens = per_chunk * layout.block_size
    for c in range(chunks):
        offset = 0
        for g in layout.groups:
            for kv in range(g.kv_size):
                for li, layer in enumerate(g.layers):
                    for j in range(skip[c], per_chunk):
                        token = (kv * len(g.layers) + li) * chunk_tokens + j * layout.block_size
                        pos = offset + token * g.row_bytes
                        yield c, layer, kv, int(ids[c, j]), pos, layout.block_size * g.row_bytes
            offset += g.chunk_nbytes(chunk_tokens)


def expected_gather(
    layout: KVLayout, caches: Any, staging_before: torch.Tensor, ids: torch.Tensor, skip: list[int]
) -> torch.Tensor:
    """Staging bytes after a gather that started from ``staging_before``."""
    out = staging_before.clone()
    for c, layer, kv, blk, pos, size in segments(layout, ids, skip):
        src = block_of(layout.format, caches, layer, kv, blk, layout.block_size)
        out[c, pos : pos + size] = src.contiguous().view(torch.uint8).reshape(-1).to(out.device)
    return out


def apply_scatter(
    layout: KVLayout, caches: Any, staging: torch.Tensor, ids: torch.Tensor, skip: list[int]
) -> None:
    """Write the staging blocks into ``caches`` (same structure as the layout's) one by one."""
    for c, layer, kv, blk, pos, size in segments(layout, ids, skip):
        dst = block_of(layout.format, caches, layer, kv, blk, layout.block_size)
        dst.view(torch.uint8).copy_(staging[c, pos : pos + size].view(dst.view(torch.uint8).shape))


def flat_tensors(caches: Any) -> list[torch.Tensor]:
    """Every tensor of a kv_caches structure, in order."""
    if isinstance(caches, torch.Tensor):
        return [caches]
    return [t for item in caches for t in flat_tensors(item)]


def clone_structure(caches: Any) -> Any:
    """A copy of a kv_caches structure with every tensor cloned (strides may differ)."""
    if isinstance(caches, torch.Tensor):
        return caches.clone()
    return type(caches)(clone_structure(item) for item in caches)


def same_bytes(a: Any, b: Any) -> bool:
    """Bitwise equality of two kv_caches structures (NaN patterns compare equal)."""
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(flat_tensors(a), flat_tensors(b), strict=True)
    )
