"""Synthetic KV caches: seeded, random in every byte, strided on request, one spec per cross-layer."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import KVFormat
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import flat_tensors, same_bytes


def _seeded(fmt: KVFormat, seed: int, **kw: object) -> object:
    caches, _ = make_kv_caches(fmt, generator=torch.Generator().manual_seed(seed), **kw)  # type: ignore[arg-type]
    return caches


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_a_seed_fixes_every_byte(fmt: KVFormat) -> None:
    """The same generator seed gives the same bytes; another seed different ones."""
    assert same_bytes(_seeded(fmt, 1), _seeded(fmt, 1))
    assert not same_bytes(_seeded(fmt, 1), _seeded(fmt, 2))


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_noncontiguous_gives_strided_views(fmt: KVFormat) -> None:
    """`noncontiguous` makes every tensor a strided view; the default keeps them contiguous."""
    assert all(t.is_contiguous() for t in flat_tensors(_seeded(fmt, 0)))
    assert not any(t.is_contiguous() for t in flat_tensors(_seeded(fmt, 0, noncontiguous=True)))


def test_sglang_formats_carry_their_block_size() -> None:
    """SGLang caches are per token, so the registration kwargs name the block size."""
    for fmt in KVFormat:
        _, kw = make_kv_caches(fmt, block_size=4)
        assert kw["kv_format"] is fmt
        assert kw.get("block_size") == (4 if fmt.is_sglang else None)


def test_cross_layer_refuses_mixed_layer_specs() -> None:
    """One cross-layer tensor holds a single (num_heads, head_size, dtype)."""
    specs = [(2, 8, torch.bfloat16), (4, 8, torch.bfloat16)]
    with pytest.raises(ValueError, match="one"):
        make_kv_caches(KVFormat.VLLM_CROSS_LAYER, layer_specs=specs)
