"""Format detection and KV layout discovery from registered tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.kernels import KVFormat, KVLayout, detect_format
from kvflow.kernels.synthetic import make_kv_caches


@pytest.mark.parametrize("noncontiguous", [False, True])
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_every_format_is_detected_and_described(fmt: KVFormat, noncontiguous: bool) -> None:
    """Detection finds the format; the layout reports layers, blocks, block size and groups."""
    caches, kw = make_kv_caches(
        fmt,
        num_layers=3,
        num_blocks=5,
        block_size=4,
        num_heads=2,
        head_size=8,
        noncontiguous=noncontiguous,
    )
    assert detect_format(caches) is fmt
    layout = KVLayout.from_kv_caches(caches, block_size=kw.get("block_size"))
    assert layout.format is fmt
    assert (layout.num_layers, layout.num_blocks, layout.block_size) == (3, 5, 4)
    assert layout.device == torch.device("cpu")
    heads = 1 if fmt.is_mla else 2
    kv = 1 if fmt.is_mla else 2
    assert layout.layout_desc(8) == [((kv, 3, 8, heads * 8), torch.bfloat16)]
    assert layout.chunk_nbytes(8) == kv * 3 * 8 * heads * 8 * 2


def test_groups_follow_first_layer_order_and_concatenate() -> None:
    """Layers group by (heads, head size, dtype) in order of first layer; offsets add up."""
    specs = [(4, 16, torch.float16), (2, 8, torch.int8), (4, 16, torch.float16), (2, 8, torch.int8)]
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASHINFER, layer_specs=specs)
    layout = KVLayout.from_kv_caches(caches, **kw)
    assert [g.layers for g in layout.groups] == [(0, 2), (1, 3)]
    assert layout.layout_desc(4) == [((2, 2, 4, 64), torch.float16), ((2, 2, 4, 16), torch.int8)]
    assert layout.group_offsets(4) == [0, 2 * 2 * 4 * 64 * 2]
    assert layout.chunk_nbytes(4) == 2048 + 2 * 2 * 4 * 16


def test_stride_descriptor_uses_the_real_strides_of_a_permuted_view() -> None:
    """An HND-permuted flash-attn layer gives head stride BS*HS and token stride HS (bytes)."""
    caches, kw = make_kv_caches(
        KVFormat.VLLM_FLASH_ATTN,
        num_blocks=3,
        block_size=4,
        num_heads=2,
        head_size=8,
        noncontiguous=True,
    )
    layout = KVLayout.from_kv_caches(caches, **kw)
    k, v = layout.stride_desc(0, 0), layout.stride_desc(0, 1)
    assert (k.block, k.token, k.head) == (2 * 4 * 8 * 2, 8 * 2, 4 * 8 * 2)
    assert v.base_ptr - k.base_ptr == 3 * 2 * 4 * 8 * 2
    assert k.base_ptr == caches[0].data_ptr()


def test_sglang_formats_need_block_size_and_vllm_block_size_must_agree() -> None:
    """SGLang tensors hold tokens, so block_size is required; vLLM's must match the shape."""
    caches, _ = make_kv_caches(KVFormat.SGLANG_MHA)
    with pytest.raises(ValueError, match="sglang_mha needs block_size"):
        KVLayout.from_kv_caches(caches)
    caches, _ = make_kv_caches(KVFormat.SGLANG_MLA, num_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="not a multiple of block_size 5"):
        KVLayout.from_kv_caches(caches, block_size=5)
    caches, _ = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, block_size=4)
    with pytest.raises(ValueError, match="block_size=16 disagrees"):
        KVLayout.from_kv_caches(caches, block_size=16)


def test_explicit_format_is_honoured_and_checked() -> None:
    """kv_format overrides detection (e.g. vLLM MLA with block_size 1); bad names are listed."""
    caches = [torch.zeros(6, 1, 32, dtype=torch.bfloat16)]
    assert detect_format(caches) is KVFormat.SGLANG_MLA
    layout = KVLayout.from_kv_caches(caches, kv_format="vllm_mla")
    assert (layout.num_blocks, layout.block_size) == (6, 1)
    with pytest.raises(ValueError, match="kv_format must be one of vllm_cross_layer"):
        KVLayout.from_kv_caches(caches, kv_format="paged")
    with pytest.raises(ValueError, match="vllm_flash_attn layers must be"):
        KVLayout.from_kv_caches([torch.zeros(3, 2, 4, 2, 8)], kv_format=KVFormat.VLLM_FLASH_ATTN)


@pytest.mark.parametrize(
    ("caches", "message"),
    [
        (torch.zeros(2, 3, 4), "a single KV tensor must be vllm_cross_layer"),
        ([], "non-empty list"),
        ("kv", "non-empty list"),
        ([torch.zeros(2, 2, 4, 2, 8)], "fits both vllm_flash_attn and vllm_flashinfer"),
        ([torch.zeros(3, 3, 4, 2, 8)], "K/V dimension of size 2"),
        ([torch.zeros(3, 4)], "must be 5-d"),
    ],
)
def test_tensors_fitting_no_format_are_rejected(caches: object, message: str) -> None:
    """Detection explains what shapes it expected."""
    with pytest.raises(ValueError, match=message):
        detect_format(caches)


def test_mixed_devices_and_disagreeing_block_counts_are_rejected() -> None:
    """All layers must share one device, block count, block size and a supported dtype."""
    cpu = torch.zeros(2, 4, 4, 2, 8)
    with pytest.raises(ValueError, match="mixed devices"):
        KVLayout.from_kv_caches([cpu, torch.zeros(2, 4, 4, 2, 8, device="meta")])
    with pytest.raises(ValueError, match="block counts disagree"):
        KVLayout.from_kv_caches([cpu, torch.zeros(2, 5, 4, 2, 8)])
    with pytest.raises(ValueError, match="block sizes disagree"):
        KVLayout.from_kv_caches([cpu, torch.zeros(2, 4, 8, 2, 8)])
    with pytest.raises(ValueError, match=r"unsupported dtype torch\.float64"):
        KVLayout.from_kv_caches([torch.zeros(2, 4, 4, 2, 8, dtype=torch.float64)])
    keys = [torch.zeros(16, 2, 8)]
    with pytest.raises(ValueError, match="1 K layers but 2 V layers"):
        KVLayout.from_kv_caches((keys, keys * 2), block_size=4)
    with pytest.raises(ValueError, match=r"K .* and V .* disagree"):
        KVLayout.from_kv_caches((keys, [torch.zeros(16, 2, 8, dtype=torch.int8)]), block_size=4)


def test_head_dimension_must_be_contiguous() -> None:
    """A head whose elements are strided cannot be copied as bytes: clear error."""
    t = torch.zeros(2, 4, 4, 8, 2).transpose(3, 4)
    with pytest.raises(ValueError, match="head dimension must be contiguous"):
        KVLayout.from_kv_caches([t])


@pytest.mark.parametrize("chunk_tokens", [0, 6, -4])
def test_chunk_tokens_must_be_a_positive_multiple_of_block_size(chunk_tokens: int) -> None:
    """Chunks hold whole blocks."""
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, block_size=4)
    with pytest.raises(ValueError, match="positive multiple of block_size 4"):
        KVLayout.from_kv_caches(caches, **kw).chunk_nbytes(chunk_tokens)


def test_validate_block_ids_reports_the_offending_id() -> None:
    """validate_block_ids names the bad id and the valid range."""
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=8)
    layout = KVLayout.from_kv_caches(caches, **kw)
    layout.validate_block_ids(torch.tensor([[0, 7]]))
    with pytest.raises(ValueError, match=r"block id 9 out of range.*0\.\.7"):
        layout.validate_block_ids(torch.tensor([[0, 9]]))


def test_validate_block_ids_takes_numpy_arrays_alike() -> None:
    """numpy ids get the same checks: range, and an integer dtype of 32 or 64 bits."""
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=8)
    layout = KVLayout.from_kv_caches(caches, **kw)
    layout.validate_block_ids(np.array([[0, 7]], dtype=np.int32))
    with pytest.raises(ValueError, match=r"block id -1 out of range"):
        layout.validate_block_ids(np.array([[-1, 2]]))
    with pytest.raises(ValueError, match="int64 or int32; got float64"):
        layout.validate_block_ids(np.array([[0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"torch\.Tensor or numpy array; got list"):
        layout.validate_block_ids([[0, 1]])  # type: ignore[arg-type]


def test_repeated_block_names_the_smallest_repeated_id() -> None:
    """The repeat check scatter and a retrieve's whole table share: None when distinct."""
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=8)
    layout = KVLayout.from_kv_caches(caches, **kw)
    assert layout.repeated_block(np.array([3, 0, 7, 1], dtype=np.int32)) is None
    assert layout.repeated_block(np.array([5, 2, 5, 2, 6], dtype=np.int64)) == 2
    assert layout.repeated_block(np.empty(0, dtype=np.int32)) is None
