"""Shared-memory tensors and KV cache descriptions: what a server can map, and what it refuses."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import mmap
import os
import pathlib
import re
import secrets
import stat
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvflow.core import empty_shared
from kvflow.core.errors import InvalidRequestError
from kvflow.core.server import shm
from kvflow.core.server.protocol import KVCachesDesc, ShmMemory, TensorDesc
from kvflow.core.server.sharing import describe_kv_caches, open_kv_caches, view_described
from kvflow.core.server.shm import (
    SHM_DIR,
    is_shared,
    map_segment,
    map_shared,
    release_segment,
    shared_memory_of,
)

#: a size no process can map (beyond any user address space), though tmpfs takes it as a length
UNMAPPABLE = 2**62


@contextlib.contextmanager
def _segment_file(size: int) -> Iterator[str]:
    """A file under /dev/shm named as empty_shared names segments, made by hand (any size)."""
    name = f"kvflow-{os.getpid()}-{10**9 + secrets.randbelow(10**9)}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    try:
        yield name
    finally:
        os.unlink(path)


def _mapped(addr: int, name: str) -> bool:
    """Whether this process has `name`'s segment mapped at `addr` (per /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span = line.split(maxsplit=1)[0]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= addr < end and name in line:
                return True
    return False


def _own_segment_names() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"kvflow-{os.getpid()}-")}


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


def test_an_int_shape_is_one_dimension() -> None:
    """empty_shared(n, dtype) is a vector of n elements, like torch.empty(n)."""
    t = empty_shared(10, torch.float32)
    assert t.shape == (10,)
    assert is_shared(t)


def test_zero_sized_dimensions_give_an_empty_shared_tensor() -> None:
    """A shape with a 0 dimension is allowed (as in torch): an empty tensor in a one-page segment."""
    t = empty_shared((0, 4), torch.float16)
    assert t.shape == (0, 4) and t.numel() == 0
    mem = shared_memory_of(t)
    assert mem is not None and mem.size == mmap.PAGESIZE


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (2.0,), ("4",)])
def test_bad_shapes_are_refused_naming_the_shape(shape: Any) -> None:
    """Negative or non-integer dimensions raise ValueError quoting the shape given."""
    with pytest.raises(ValueError) as info:
        empty_shared(shape, torch.float32)
    assert str(info.value) == f"shape must be non-negative integers, got {shape!r}"


def test_a_dtype_that_is_not_a_torch_dtype_is_refused() -> None:
    """A dtype given by name (or anything but a torch.dtype) raises TypeError quoting it."""
    with pytest.raises(TypeError) as info:
        empty_shared((4,), "float32")  # type: ignore[arg-type]
    assert str(info.value) == "dtype must be a torch.dtype, got 'float32'"


def test_segments_are_readable_by_their_owner_only() -> None:
    """A segment holds KV data: its file is mode 0600 whatever the umask."""
    t = empty_shared((16,), torch.uint8)
    mem = shared_memory_of(t)
    assert mem is not None
    mode = os.stat(os.path.join(SHM_DIR, mem.name)).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_a_segment_too_large_to_map_fails_and_leaves_no_name_behind() -> None:
    """When mapping the new segment fails, the OS error comes through and its name is removed."""
    before = _own_segment_names()
    try:
        with pytest.raises(OSError):
            empty_shared((UNMAPPABLE,), torch.uint8)
    finally:
        left = _own_segment_names() - before
        for name in left:  # (a sparse file, but do not leave it behind either way)
            os.unlink(os.path.join(SHM_DIR, name))
    assert left == set()


def test_a_freed_segment_address_is_not_taken_for_shared_memory() -> None:
    """Once a segment is freed, ordinary memory later mapped at its address is not shared."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    map_fixed_noreplace = 0x100000  # Linux >= 4.17: map exactly there, or fail
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_fixed_noreplace
    size = mmap.PAGESIZE
    for _ in range(5):  # another thread may take the freed address first: try another
        t = empty_shared((size,), torch.uint8)
        base = t.untyped_storage().data_ptr()
        del t
        gc.collect()
        addr = libc.mmap(base, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if addr == base:
            break
        if addr not in (None, ctypes.c_void_p(-1).value):
            libc.munmap(addr, size)
    else:
        pytest.fail("could not map anything at a freed segment's address")
    try:
        ordinary = torch.frombuffer((ctypes.c_uint8 * size).from_address(base), dtype=torch.uint8)
        assert ordinary.data_ptr() == base
        assert not is_shared(ordinary)
        assert shared_memory_of(ordinary) is None
        del ordinary
    finally:
        gc.collect()
        libc.munmap(base, size)


def test_a_segment_whose_name_was_removed_elsewhere_frees_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If something else unlinked the name first, freeing the tensor raises nothing."""
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    t = empty_shared((64,), torch.uint8)
    mem = shared_memory_of(t)
    assert mem is not None
    os.unlink(os.path.join(SHM_DIR, mem.name))
    del t
    gc.collect()
    assert unraisable == []


def test_an_empty_segment_is_refused_and_a_one_byte_segment_maps() -> None:
    """A zero-length segment cannot be mapped (clear refusal); any non-empty one can."""
    with _segment_file(0) as name, pytest.raises(InvalidRequestError) as info:
        map_shared(ShmMemory(name=name, size=0, offset=0))
    assert str(info.value) == (
        f"cannot map shared-memory segment {name!r}: cannot map an empty segment"
    )
    with _segment_file(1) as name:
        tensor, segment = map_segment(ShmMemory(name=name, size=1, offset=0))
        assert tensor.shape == (1,) and int(tensor[0]) == 0
        assert segment.size == 1
        del tensor
        assert release_segment(segment)


def test_a_segment_too_large_to_map_is_refused_with_the_os_reason() -> None:
    """A mapping the OS refuses is an InvalidRequestError carrying errno and its text."""
    with _segment_file(UNMAPPABLE) as name, pytest.raises(InvalidRequestError) as info:
        map_shared(ShmMemory(name=name, size=UNMAPPABLE, offset=0))
    prefix = f"cannot map shared-memory segment {name!r}: "
    message = str(info.value)
    assert message.startswith(prefix)
    reason = re.fullmatch(r"\[Errno (\d+)\] (.+)", message[len(prefix) :])
    assert reason is not None, message
    assert reason[2] == os.strerror(int(reason[1]))


def test_a_symlinked_segment_name_is_not_followed() -> None:
    """A segment name that is a symlink is refused with the OS's reason, not opened."""
    with _segment_file(mmap.PAGESIZE) as target:
        name = f"kvflow-{os.getpid()}-{10**9 - 1}-{secrets.token_hex(4)}"
        link = os.path.join(SHM_DIR, name)
        os.symlink(os.path.join(SHM_DIR, target), link)
        try:
            with pytest.raises(InvalidRequestError) as info:
                map_shared(ShmMemory(name=name, size=mmap.PAGESIZE, offset=0))
        finally:
            os.unlink(link)
    assert str(info.value) == (
        f"cannot open shared-memory segment {name!r}: {os.strerror(errno.ELOOP)}"
    )


def test_map_segment_maps_the_whole_segment() -> None:
    """The Segment behind map_segment's tensor has the segment's size; the tensor spans it."""
    t = empty_shared((100,), torch.int32)
    mem = shared_memory_of(t)
    assert mem is not None
    tensor, segment = map_segment(mem)
    assert segment.size == mem.size == tensor.numel()
    assert not segment.closed
    del tensor
    assert release_segment(segment)


def test_release_segment_unmaps_at_once_when_nothing_views_it() -> None:
    """With no view left, release_segment unmaps now (and says so); releasing again is a no-op."""
    t = empty_shared((4096,), torch.uint8)
    mem = shared_memory_of(t)
    assert mem is not None
    tensor, segment = map_segment(mem)
    addr = tensor.data_ptr()
    assert _mapped(addr, mem.name)
    del tensor
    assert release_segment(segment) is True
    assert segment.closed
    assert not _mapped(addr, mem.name)
    assert release_segment(segment) is True
    assert is_shared(t)  # the owner's own mapping is untouched


def test_release_segment_keeps_the_mapping_while_a_view_lives() -> None:
    """A live view keeps the segment mapped: release says False, every time, until it dies."""
    t = empty_shared((4096,), torch.uint8)
    t.fill_(5)
    mem = shared_memory_of(t)
    assert mem is not None
    tensor, segment = map_segment(mem)
    addr = tensor.data_ptr()
    part = tensor[10:20]
    del tensor
    assert release_segment(segment) is False
    assert release_segment(segment) is False
    assert not segment.closed and _mapped(addr, mem.name)
    assert part.tolist() == [5] * 10
    del part
    assert release_segment(segment) is True
    assert not _mapped(addr, mem.name)


def test_release_segment_collects_a_view_kept_only_by_a_reference_cycle() -> None:
    """A view that only a garbage cycle still holds does not stop the unmap."""
    t = empty_shared((4096,), torch.uint8)
    mem = shared_memory_of(t)
    assert mem is not None
    gc.disable()  # keep the cycle until release_segment's own collection
    try:
        tensor, segment = map_segment(mem)
        addr = tensor.data_ptr()
        cycle: list[Any] = [tensor[:8]]
        cycle.append(cycle)
        del tensor, cycle
        assert release_segment(segment) is True
    finally:
        gc.enable()
    assert not _mapped(addr, mem.name)


def test_a_late_finalizer_of_a_reused_address_keeps_the_new_segment() -> None:
    """A segment's finalizer runs after its mapping is gone, so a new segment can already
    sit at the same address: the late finalizer must not make the new one look unshared.
    (The finalizer is called by hand, with the dead segment's name, to make the interleaving
    deterministic.)"""
    tensor = shm.empty_shared((64,), torch.uint8)
    base = tensor.untyped_storage().data_ptr()
    dead = "kvflow-0-0-00000000"
    shm._release(base, dead, os.path.join(shm.SHM_DIR, dead))
    assert shm.is_shared(tensor)
    memory = shm.shared_memory_of(tensor)
    assert memory is not None and memory.name != dead


def test_a_late_finalizer_still_unlinks_its_name_when_its_address_was_forgotten(
    tmp_path: pathlib.Path,
) -> None:
    """When a newer segment at the same address was released first, the late finalizer
    finds no entry for that address; it must still unlink its own name (no /dev/shm
    file left behind). (Called by hand, as above, for a deterministic interleaving.)"""
    leftover = tmp_path / "kvflow-0-0-00000001"
    leftover.write_bytes(b"x")
    forgotten = 1 << 47  # an address no live segment has
    shm._release(forgotten, leftover.name, str(leftover))
    assert not leftover.exists()
