"""The six KV-cache formats (docs/KERNELS.md) and their detection from the registered tensors."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch


class KVFormat(enum.StrEnum):
    """A named engine KV-cache layout (values are the names in docs/KERNELS.md)."""

    VLLM_CROSS_LAYER = "vllm_cross_layer"
    VLLM_FLASH_ATTN = "vllm_flash_attn"
    VLLM_FLASHINFER = "vllm_flashinfer"
    VLLM_MLA = "vllm_mla"
    SGLANG_MHA = "sglang_mha"
    SGLANG_MLA = "sglang_mla"

    @property
    def is_mla(self) -> bool:
        """MLA formats store one latent vector per token (kv_size 1)."""
        return self in (KVFormat.VLLM_MLA, KVFormat.SGLANG_MLA)

    @property
    def is_sglang(self) -> bool:
        """SGLang tensors are token-indexed ``[NB*BS, ...]``, so block_size must be given."""
        return self in (KVFormat.SGLANG_MHA, KVFormat.SGLANG_MLA)


def parse_format(kv_format: str | KVFormat) -> KVFormat:
    """Turn a format name into a KVFormat, with an error listing the valid names."""
    try:
        return KVFormat(kv_format)
    except ValueError:
        names = ", ".join(f.value for f in KVFormat)
        raise ValueError(f"kv_format must be one of {names}; got {kv_format!r}") from None


def _is_tensor_list(obj: Any) -> bool:
    return (
        isinstance(obj, Sequence)
        and not isinstance(obj, str | bytes)
        and len(obj) > 0
        and all(isinstance(t, torch.Tensor) for t in obj)
    )


def detect_format(kv_caches: Any) -> KVFormat:
    """Recognise the format of ``kv_caches`` from its nesting and shapes.

    A flash-attn/flashinfer list with exactly 2 blocks is ambiguous and raises ValueError
    asking for ``kv_format``; a 3-d list whose dim 1 has size 1 is read as sglang_mla
    (pass ``kv_format="vllm_mla"`` for a vLLM MLA cache with block_size 1).
    """
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() == 6 and kv_caches.shape[2] == 2:
            return KVFormat.VLLM_CROSS_LAYER
        raise ValueError(
            "a single KV tensor must be vllm_cross_layer [NB, NL, 2, BS, NH, HS]; "
            f"got shape {tuple(kv_caches.shape)}"
        )
    if (
        isinstance(kv_caches, Sequence)
        and len(kv_caches) == 2
        and all(_is_tensor_list(side) for side in kv_caches)
    ):
        return KVFormat.SGLANG_MHA
    if not _is_tensor_list(kv_caches):
        raise ValueError(
            "kv_caches must be a tensor, a non-empty list of tensors, or a (K list, V list) pair; "
            f"got {type(kv_caches).__name__}"
        )
    first = kv_caches[0]
    shape = tuple(first.shape)
    if first.dim() == 5:
        kv_first, kv_second = shape[0] == 2, shape[1] == 2
        if kv_first and kv_second:
            raise ValueError(
                f"layer shape {shape} fits both vllm_flash_attn and vllm_flashinfer; "
                "pass kv_format explicitly"
            )
        if kv_first:
            return KVFormat.VLLM_FLASH_ATTN
        if kv_second:
            return KVFormat.VLLM_FLASHINFER
        raise ValueError(
            f"5-d layer tensors need a K/V dimension of size 2 at dim 0 (vllm_flash_attn) "
            f"or dim 1 (vllm_flashinfer); got shape {shape}"
        )
    if first.dim() == 3:
        if shape[1] == 1:
            return KVFormat.SGLANG_MLA
        return KVFormat.VLLM_MLA
    raise ValueError(
        f"layer tensors must be 5-d (vLLM MHA) or 3-d (MLA); got {first.dim()}-d shape {shape}"
    )
