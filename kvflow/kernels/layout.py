"""KV layout discovery: per-layer stride descriptors and layer groups from registered tensors.

Every format (docs/KERNELS.md, KV cache formats) is affine, so each (layer, kv) is reduced
to a 4-d view ``[num_blocks, block_size, num_heads, head_size]`` carrying the tensor's real strides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from kvflow.kernels.formats import KVFormat, detect_format, parse_format

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
)


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing (num_heads, head_size, dtype), listed in global layer order."""

    layers: tuple[int, ...]
    kv_size: int
    num_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token."""
        return self.head_size * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one (kv, layer): all heads, as laid out in a chunk."""
        return self.num_heads * self.head_bytes

    def chunk_shape(self, chunk_tokens: int) -> tuple[int, int, int, int]:
        """Shape of this group's part of a chunk: (kv_size, layers, tokens, heads*head_size)."""
        return (self.kv_size, len(self.layers), chunk_tokens, self.num_heads * self.head_size)

    def chunk_nbytes(self, chunk_tokens: int) -> int:
        """Bytes of this group's part of a chunk of ``chunk_tokens`` tokens."""
        return self.kv_size * len(self.layers) * chunk_tokens * self.row_bytes


class StrideDesc(NamedTuple):
    """Affine address of one (layer, kv): base pointer plus byte strides per index."""

    base_ptr: int
    block: int
    token: int
    head: int


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Immutable description of a registered KV cache plus references to its tensors.

    ``block_views[layer][kv]`` is a ``[num_blocks, block_size, num_heads, head_size]``
    view of the engine tensor with its real strides (the stride descriptor in tensor form).
    """

    format: KVFormat
    num_layers: int
    num_blocks: int
    block_size: int
    device: torch.device
    groups: tuple[LayerGroup, ...]
    block_views: tuple[tuple[torch.Tensor, ...], ...] = field(repr=False)
    plan_cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    #: layouts of one layer or a run of layers (`layer_layout`, `span_layout`), by (first
    #: layer, layers)
    span_cache: dict[tuple[int, int], KVLayout] = field(default_factory=dict, repr=False)

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Any,
        *,
        block_size: int | None = None,
        kv_format: str | KVFormat | None = None,
    ) -> KVLayout:
        """Describe ``kv_caches`` (format detected unless given); ValueError if it fits none."""
        fmt = detect_format(kv_caches) if kv_format is None else parse_format(kv_format)
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size must be a positive int; got {block_size!r}")
        views = _block_views(fmt, kv_caches, block_size)
        return cls._from_views(fmt, views)

    @classmethod
    def _from_views(cls, fmt: KVFormat, views: list[tuple[torch.Tensor, ...]]) -> KVLayout:
        first = views[0][0]
        num_blocks, block_size = int(first.shape[0]), int(first.shape[1])
        device = first.device
        keys: dict[tuple[int, int, torch.dtype], list[int]] = {}
        for layer, kv_views in enumerate(views):
            for kv, view in enumerate(kv_views):
                where = f"layer {layer}" + (f" {'KV'[kv]}" if len(kv_views) == 2 else "")
                _check_view(view, where, device, num_blocks, block_size)
            k, v = kv_views[0], kv_views[-1]
            if k.shape != v.shape or k.dtype != v.dtype:
                raise ValueError(
                    f"layer {layer}: K {tuple(k.shape)} {k.dtype} and V {tuple(v.shape)} "
                    f"{v.dtype} disagree"
                )
            keys.setdefault((int(k.shape[2]), int(k.shape[3]), k.dtype), []).append(layer)
        kv_size = 1 if fmt.is_mla else 2
        groups = tuple(
            LayerGroup(tuple(layers), kv_size, heads, size, dtype)
            for (heads, size, dtype), layers in keys.items()
        )
        return cls(
            format=fmt,
            num_layers=len(views),
            num_blocks=num_blocks,
            block_size=block_size,
            device=device,
            groups=groups,
            block_views=tuple(views),
        )

    def check_chunk_tokens(self, chunk_tokens: int) -> None:
        """ValueError unless ``chunk_tokens`` is a positive multiple of block_size."""
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1 or chunk_tokens % self.block_size:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of block_size {self.block_size}; "
                f"got {chunk_tokens!r}"
            )

    def layout_desc(self, chunk_tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """The layout desc (docs/ENGINE.md, L1): (chunk_shape, dtype) per group, in chunk order."""
        self.check_chunk_tokens(chunk_tokens)
        return [(g.chunk_shape(chunk_tokens), g.dtype) for g in self.groups]

    def chunk_nbytes(self, chunk_tokens: int) -> int:
        """Bytes of one chunk: the groups' parts concatenated."""
        self.check_chunk_tokens(chunk_tokens)
        return sum(g.chunk_nbytes(chunk_tokens) for g in self.groups)

    def group_offsets(self, chunk_tokens: int) -> list[int]:
        """Byte offset of each group's part inside a chunk."""
        offsets, total = [], 0
        for g in self.groups:
            offsets.append(total)
            total += g.chunk_nbytes(chunk_tokens)
        return offsets

    def layer_layout(self, layer: int) -> KVLayout:
        """The layout of one layer alone, whose chunk is that layer's part of a chunk of
        this layout (`layer_parts`): a layerwise transfer moves one layer per launch."""
        return self.span_layout(layer, 1)

    def layer_parts(self, layer: int, chunk_tokens: int) -> list[tuple[int, int]]:
        """(byte offset, byte count) of each of a layer's K/V parts inside one chunk, in
        the order `layer_layout(layer)` lays them out (a chunk is, per group,
        [kv, layers, tokens, row]: a layer's K and V are two separate runs)."""
        for group, offset in zip(self.groups, self.group_offsets(chunk_tokens), strict=True):
            if layer in group.layers:
                run = chunk_tokens * group.row_bytes
                first = offset + group.layers.index(layer) * run
                return [(first + kv * len(group.layers) * run, run) for kv in range(group.kv_size)]
        raise ValueError(f"layer {layer} is not within the {self.num_layers} layers")

    def span_fits(self, first: int, count: int) -> bool:
        """Whether layers [first, first + count) lie next to each other in one group, so
        that their part of a chunk is one run per kv (`span_parts`)."""
        if count < 1 or first < 0 or first + count > self.num_layers:
            return False
        for group in self.groups:
            if first in group.layers:
                at = group.layers.index(first)
                return group.layers[at : at + count] == tuple(range(first, first + count))
        return False

    def span_layout(self, first: int, count: int) -> KVLayout:
        """The layout of layers [first, first + count) alone (`span_fits`), whose chunk is
        `span_parts` back to back: a layerwise transfer may move several layers in one
        launch."""
        sub = self.span_cache.get((first, count))
        if sub is None:
            if count == 1 and not 0 <= first < self.num_layers:
                raise ValueError(f"layer {first} is not within the {self.num_layers} layers")
            if not self.span_fits(first, count):
                raise ValueError(f"layers {first}..{first + count - 1} are not one span of a group")
            sub = KVLayout._from_views(self.format, list(self.block_views[first : first + count]))
            self.span_cache[(first, count)] = sub
        return sub

    def span_parts(self, first: int, count: int, chunk_tokens: int) -> list[tuple[int, int]]:
        """(byte offset, byte count) of layers [first, first + count)'s part of one chunk, in
        the order `span_layout` lays them out: per kv one run covering all of them (the
        layers lie next to each other in their group's [kv, layers, tokens, row])."""
        if count == 1:
            return self.layer_parts(first, chunk_tokens)
        if not self.span_fits(first, count):
            raise ValueError(f"layers {first}..{first + count - 1} are not one span of a group")
        return [(offset, count * n) for offset, n in self.layer_parts(first, chunk_tokens)]

    def stride_desc(self, layer: int, kv: int) -> StrideDesc:
        """Base pointer and byte strides (block, token, head) of one (layer, kv)."""
        view = self.block_views[layer][kv]
        size = view.element_size()
        return StrideDesc(
            view.data_ptr(), view.stride(0) * size, view.stride(1) * size, view.stride(2) * size
        )

    def validate_block_ids(self, block_ids: torch.Tensor | np.ndarray) -> None:
        """ValueError if any id is < 0 or >= num_blocks (or the ids are not int32/int64)."""
        if isinstance(block_ids, torch.Tensor):
            if block_ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"block_ids must be int64 or int32; got {block_ids.dtype}")
        elif isinstance(block_ids, np.ndarray):
            if block_ids.dtype not in (np.int64, np.int32):
                raise ValueError(f"block_ids must be int64 or int32; got {block_ids.dtype}")
        else:
            raise ValueError(
                f"block_ids must be a torch.Tensor or numpy array; got {type(block_ids).__name__}"
            )
        if block_ids.reshape(-1).shape[0] == 0:
            return
        lo, hi = int(block_ids.min()), int(block_ids.max())
        if lo < 0 or hi >= self.num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"block id {bad} out of range: the cache has {self.num_blocks} blocks "
                f"(valid ids 0..{self.num_blocks - 1})"
            )

    def repeated_block(self, block_ids: np.ndarray) -> int | None:
        """The smallest id that `block_ids` (in range: see `validate_block_ids`) holds more
        than once, or None when every id is distinct."""
        seen = np.zeros(self.num_blocks, dtype=np.bool_)  # a mask: 50x faster than np.unique
        seen[block_ids] = True
        if int(np.count_nonzero(seen)) == block_ids.size:
            return None
        values, counts = np.unique(block_ids, return_counts=True)
        return int(values[counts > 1][0])


def _check_view(
    view: torch.Tensor, where: str, device: torch.device, num_blocks: int, block_size: int
) -> None:
    if view.device != device:
        raise ValueError(f"{where} is on {view.device} but layer 0 is on {device}: mixed devices")
    if view.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"{where}: unsupported dtype {view.dtype}; supported: {names}")
    if int(view.shape[0]) != num_blocks:
        raise ValueError(
            f"{where} has {view.shape[0]} blocks but layer 0 has {num_blocks}: block counts disagree"
        )
    if int(view.shape[1]) != block_size:
        raise ValueError(
            f"{where} has block_size {view.shape[1]} but layer 0 has {block_size}: "
            "block sizes disagree"
        )
    if min(view.shape) < 1:
        raise ValueError(f"{where}: empty dimension in [NB, BS, NH, HS] = {tuple(view.shape)}")
    if view.shape[3] > 1 and view.stride(3) != 1:
        raise ValueError(
            f"{where}: the head dimension must be contiguous (stride 1); strides are "
            f"{tuple(view.stride())}"
        )
    if num_blocks > 1 and view.stride(0) == 0:
        raise ValueError(f"{where}: block stride 0 makes every block alias the same memory")


def _tensor_list(obj: Any, what: str) -> list[torch.Tensor]:
    if (
        isinstance(obj, torch.Tensor)
        or not isinstance(obj, Sequence)
        or not obj
        or not all(isinstance(t, torch.Tensor) for t in obj)
    ):
        raise ValueError(f"{what} must be a non-empty list of tensors")
    return list(obj)


def _require_dims(tensors: list[torch.Tensor], dims: int, fmt: KVFormat, pattern: str) -> None:
    for layer, t in enumerate(tensors):
        if t.dim() != dims:
            raise ValueError(
                f"{fmt.value}: layer {layer} has shape {tuple(t.shape)}; expected {pattern}"
            )


def _agree_block_size(fmt: KVFormat, given: int | None, found: int) -> None:
    if given is not None and given != found:
        raise ValueError(f"{fmt.value}: block_size={given} disagrees with the tensors' {found}")


def _sglang_block_view(t: torch.Tensor, block_size: int, where: str) -> torch.Tensor:
    if t.shape[0] % block_size:
        raise ValueError(
            f"{where}: {t.shape[0]} token slots are not a multiple of block_size {block_size}"
        )
    return t.unflatten(0, (t.shape[0] // block_size, block_size))


def _block_views(
    fmt: KVFormat, kv_caches: Any, block_size: int | None
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, per kv: the ``[NB, BS, NH, HS]`` view of ``kv_caches`` in format ``fmt``."""
    if fmt is KVFormat.VLLM_CROSS_LAYER:
        if (
            not isinstance(kv_caches, torch.Tensor)
            or kv_caches.dim() != 6
            or kv_caches.shape[2] != 2
        ):
            raise ValueError("vllm_cross_layer needs one tensor [NB, NL, 2, BS, NH, HS]")
        _agree_block_size(fmt, block_size, int(kv_caches.shape[3]))
        return [(kv_caches[:, i, 0], kv_caches[:, i, 1]) for i in range(kv_caches.shape[1])]
    if fmt is KVFormat.SGLANG_MHA:
        if not isinstance(kv_caches, Sequence) or len(kv_caches) != 2:
            raise ValueError("sglang_mha needs a (K list, V list) pair")
        keys = _tensor_list(kv_caches[0], "sglang_mha K list")
        values = _tensor_list(kv_caches[1], "sglang_mha V list")
        if len(keys) != len(values):
            raise ValueError(f"sglang_mha: {len(keys)} K layers but {len(values)} V layers")
        _require_dims(keys + values, 3, fmt, "[NB*BS, NH, HS]")
        if block_size is None:
            raise ValueError("sglang_mha needs block_size (its tensors are [NB*BS, NH, HS])")
        return [
            (
                _sglang_block_view(k, block_size, f"layer {i} K"),
                _sglang_block_view(v, block_size, f"layer {i} V"),
            )
            for i, (k, v) in enumerate(zip(keys, values, strict=True))
        ]
    tensors = _tensor_list(kv_caches, f"{fmt.value} kv_caches")
    if fmt is KVFormat.VLLM_FLASH_ATTN:
        _require_dims(tensors, 5, fmt, "[2, NB, BS, NH, HS]")
        if any(t.shape[0] != 2 for t in tensors):
            raise ValueError("vllm_flash_attn layers must be [2, NB, BS, NH, HS]")
        _agree_block_size(fmt, block_size, int(tensors[0].shape[2]))
        return [(t[0], t[1]) for t in tensors]
    if fmt is KVFormat.VLLM_FLASHINFER:
        _require_dims(tensors, 5, fmt, "[NB, 2, BS, NH, HS]")
        if any(t.shape[1] != 2 for t in tensors):
            raise ValueError("vllm_flashinfer layers must be [NB, 2, BS, NH, HS]")
        _agree_block_size(fmt, block_size, int(tensors[0].shape[2]))
        return [(t[:, 0], t[:, 1]) for t in tensors]
    if fmt is KVFormat.VLLM_MLA:
        _require_dims(tensors, 3, fmt, "[NB, BS, HS]")
        _agree_block_size(fmt, block_size, int(tensors[0].shape[1]))
        return [(t.unsqueeze(2),) for t in tensors]
    # SGLANG_MLA
    _require_dims(tensors, 3, fmt, "[NB*BS, 1, HS]")
    if any(t.shape[1] != 1 for t in tensors):
        raise ValueError("sglang_mla layers must be [NB*BS, 1, HS]")
    if block_size is None:
        raise ValueError("sglang_mla needs block_size (its tensors are [NB*BS, 1, HS])")
    return [(_sglang_block_view(t, block_size, f"layer {i}"),) for i, t in enumerate(tensors)]
