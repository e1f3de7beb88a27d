"""A naive per-block model of the KV formats, to check transfers against.

``block_of``, ``expected_gather`` and ``apply_scatter`` index the engine tensors
exactly as the format table of docs/KERNELS.md defines them, not through KVLayout's views,
so they check layout discovery as well as the copy. The kernel tests and the GPU
checks use them, with structure helpers (clone, compare, flatten) for kv_caches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from kvflow.kernels.formats import KVFormat
from kvflow.kernels.layout import KVLayout


def block_of(fmt: KVFormat, caches: Any, layer: int, kv: int, block: int, bs: int) -> torch.Tensor:
    """The [BS, NH, HS] slice of one block of one (layer, kv), straight from the format's shapes."""
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
