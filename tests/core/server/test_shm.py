"""Shared-memory tensors and KV cache descriptions: what a server can map, and what it refuses."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from kvflow.core import empty_shared
from kvflow.core.errors import InvalidRequestError
from kvflow.core.server.protocol import KVCachesDesc, ShmMemory, TensorDesc
from kvflow.core.server.sharing import describe_kv_caches, open_kv_caches, view_described
from kvflow.core.server.shm import SHM_DIR, is_shared, map_shared, shared_memory_of


def test_empty_shared_is_a_contiguous_tensor_in_a_named_segment() -> None:
    """The tensor has the asked shape and dtype, and its segment exists under /dev/shm."""
    t = empty_shared((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    mem = shared_memory_of(t)
    assert mem is not None and mem.offset == 0
    assert os.path.exists(os.path.join(SHM_DIR, mem.name))
    assert mem.size >= t.numel() * 2


def test_views_report_their_byte_offset() -> None:
    """A slice or permuted view of a shared tensor is still shared, at its own offset."""
    t = empty_shared((4, 8), torch.float32)
    view = t[2:, 3:]
    mem = shared_memory_of(view)
    assert mem is not None and mem.offset == (2 * 8 + 3) * 4
    assert is_shared(t.t())
    assert not is_shared(torch.zeros(4))


def test_a_second_mapping_sees_the_same_memory() -> None:
    """map_shared views the very same bytes (what the server process does)."""
    t = empty_shared((16,), torch.int8)
    t.copy_(torch.arange(16, dtype=torch.int8))
    mem = shared_memory_of(t)
    assert mem is not None
    other = map_shared(mem)
    assert other[:16].view(torch.int8).tolist() == list(range(16))
    other[0] = 99
    assert int(t[0]) == 99


def test_segment_name_is_unlinked_when_the_last_view_dies() -> None:
    """Freeing every view removes the name; an existing mapping elsewhere stays valid."""
    t = empty_shared((1024,), torch.uint8)
    mem = shared_memory_of(t)
    assert mem is not None
    mapped = map_shared(mem)
    t.fill_(7)
    path = os.path.join(SHM_DIR, mem.name)
    del t
    gc.collect()
    assert not os.path.exists(path)
    assert int(mapped[1000]) == 7


@pytest.mark.parametrize(
    "name, match",
    [
        ("../../etc/passwd", "not made by kvflow"),
        ("other-app-segment", "not made by kvflow"),
        ("kvflow-1-1-00000000", "does not exist"),
    ],
)
def test_map_shared_refuses_foreign_or_missing_segments(name: str, match: str) -> None:
    """Only names empty_shared makes are opened, and only if they still exist."""
    with pytest.raises(InvalidRequestError, match=match):
        map_shared(ShmMemory(name=name, size=4096, offset=0))


def test_map_shared_refuses_a_size_mismatch() -> None:
    """A description whose size differs from the segment's is refused."""
    t = empty_shared((10,), torch.float32)
    mem = shared_memory_of(t)
    assert mem is not None
    with pytest.raises(InvalidRequestError, match="described as"):
        map_shared(ShmMemory(name=mem.name, size=mem.size * 2, offset=0))


@pytest.mark.parametrize(
    "make",
    [
        lambda: empty_shared((2, 8, 16, 2, 4), torch.float16),  # one tensor
        lambda: [empty_shared((2, 8, 16, 2, 4), torch.float16) for _ in range(3)],  # a list
        lambda: (  # a (K list, V list) pair
            [empty_shared((128, 2, 4), torch.bfloat16) for _ in range(2)],
            [empty_shared((128, 2, 4), torch.bfloat16) for _ in range(2)],
        ),
        lambda: [empty_shared((8, 2, 16, 4, 2), torch.float32).permute(0, 1, 3, 2, 4)],  # HND view
    ],
)
def test_described_kv_caches_reopen_with_the_same_nesting_and_memory(make: object) -> None:
    """Rebuilt tensors keep nesting, shape, strides and dtype, and alias the client's memory."""
    kv = make()  # type: ignore[operator]
    opened = open_kv_caches(describe_kv_caches(kv)).kv_caches

    def flat(x: object) -> list[torch.Tensor]:
        if isinstance(x, torch.Tensor):
            return [x]
        return [t for item in x for t in flat(item)]  # type: ignore[attr-defined]

    def nesting(x: object) -> object:
        """The container types and lengths, down to the tensors ("T")."""
        if isinstance(x, torch.Tensor):
            return "T"
        assert isinstance(x, list | tuple), type(x)
        return (type(x).__name__, [nesting(item) for item in x])

    assert nesting(opened) == nesting(kv)  # one tensor stays one tensor, not a list of one
    for src, dst in zip(flat(kv), flat(opened), strict=True):
        assert (dst.shape, dst.stride(), dst.dtype) == (src.shape, src.stride(), src.dtype)
        src.copy_(torch.randn(src.shape).to(src.dtype))
        assert torch.equal(dst, src)


def test_unshared_cpu_tensor_is_a_clear_error() -> None:
    """Registering an ordinary CPU tensor with a server names empty_shared."""
    with pytest.raises(InvalidRequestError, match=r"kv_caches\[1\].*empty_shared"):
        describe_kv_caches([empty_shared((4, 4), torch.float16), torch.zeros(4, 4)])


@pytest.mark.parametrize(
    "kv, match",
    [
        ("text", "must be a tensor"),
        ([3], r"kv_caches\[0\] must be a torch.Tensor"),
    ],
)
def test_malformed_kv_caches_are_rejected(kv: object, match: str) -> None:
    """Anything but a tensor, a list of tensors or a pair of lists is refused."""
    with pytest.raises(InvalidRequestError, match=match):
        describe_kv_caches(kv)


def test_unsupported_dtype_is_rejected() -> None:
    """Only the KV dtypes of docs/KERNELS.md can be registered."""
    with pytest.raises(InvalidRequestError, match="float64"):
        describe_kv_caches(empty_shared((4,), torch.float64))


@pytest.mark.parametrize(
    "dtype, shape, strides, offset, match",
    [
        ("float16", (4, 4), (4, 1), 4096, "needs"),  # past the end
        ("float16", (100, 100), (100, 1), 0, "needs"),  # larger than the segment
        ("float32", (4,), (1,), 2, "multiple of 4"),  # misaligned
        ("float64", (4,), (1,), 0, "dtype"),  # not a KV dtype
        ("float16", (4, 4), (4,), 0, "same"),  # strides do not match shape
        ("float16", (4,), (-1,), 0, "negative"),
        ("float16", (), (), 0, "same"),  # no dims
    ],
)
def test_hostile_descriptions_are_bounds_checked(
    dtype: str, shape: tuple[int, ...], strides: tuple[int, ...], offset: int, match: str
) -> None:
    """A description reaching outside its memory, misaligned or malformed is refused."""
    raw = torch.zeros(4096, dtype=torch.uint8)
    desc = TensorDesc(dtype, shape, strides, ShmMemory(name="x", size=4096, offset=offset))
    with pytest.raises(InvalidRequestError, match=match):
        view_described(raw, desc, "kv_caches tensor 0")


def test_open_refuses_empty_or_inconsistent_nesting() -> None:
    """No tensors, or a 'tensor' kind with several, is refused."""
    with pytest.raises(InvalidRequestError, match=r"1\.\.4096"):
        open_kv_caches(KVCachesDesc(kind="list", tensors=[]))
    t = empty_shared((4,), torch.float16)
    tdesc = describe_kv_caches(t).tensors[0]
    with pytest.raises(InvalidRequestError, match="one tensor"):
        open_kv_caches(KVCachesDesc(kind="tensor", tensors=[tdesc, tdesc]))
