"""Make vLLM's CPU KV cache shareable with a kvflow server without copying it per step.

First choice, `SharedZeros`: vLLM asks a connector for a KV cache allocation context
(`get_mem_pool_context`) and allocates the KV buffer inside it with `torch.zeros`
(one int8 buffer); within this context a CPU int8 `torch.zeros` returns a tensor from
`kvflow.core.empty_shared` (a fresh segment reads as zeros), so the cache lives
in shared memory from the start and nothing is copied.

Fallback, `SharedKV` (a vLLM that allocates otherwise): vLLM allocates the CPU KV cache itself (one `torch.zeros` buffer that every layer
views, through tensors the connector never sees) before the connector gets it,
so the memory cannot be swapped for a tensor from `kvflow.core.empty_shared`:
the attention layers would keep writing the old buffer. Instead the *pages* are
swapped, at the same virtual addresses: a shared-memory segment of the buffer's
page span is created with `empty_shared`, the buffer's bytes are copied into it,
and the segment is mapped over the buffer with `mmap(MAP_SHARED | MAP_FIXED)`,
piece by piece (so at most one piece is held twice). Every existing view of the
buffer, wherever vLLM keeps it, now reads and writes the segment, which the
server maps too; the copy happens once, at registration.

Only a buffer that has its pages to itself is moved (`owns_its_pages`): one that shares
its first or last page with other heap allocations may see another thread (a ZMQ I/O
thread freeing a message, the allocator's bookkeeping) write those pages between the
copy and the remap; the write is lost and the heap corrupt (glibc aborts later,
anywhere). It must hold `MIN_REMAP_BYTES` or more and glibc's header before it must mark
a chunk mapped on its own: glibc serves even 32 MiB from a heap's free top when one is
that large. vLLM's KV buffers are far larger, and mapped.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvflow.core import empty_shared
from kvflow.core.server.protocol import ShmMemory
from kvflow.core.server.shm import SHM_DIR, shared_memory_of

#: bytes copied and remapped at a time
PIECE_BYTES = 64 << 20
#: the smallest storage moved in place (glibc's largest mmap threshold: other allocators
#: too give allocations this large pages of their own)
MIN_REMAP_BYTES = 32 << 20
#: the bit of glibc's chunk size word (just before the data) marking a chunk mapped alone
_IS_MMAPPED = 0x2


def owns_its_pages(base: int, nbytes: int) -> bool:
    """Whether the allocation at `base` (`nbytes`) has its pages to itself: `MIN_REMAP_BYTES`
    or more, and glibc's size word before it marks a chunk mapped alone. The word is read
    through /proc/self/mem, so an address with nothing mapped before it reads as not
    owned instead of faulting."""
    if nbytes < MIN_REMAP_BYTES:
        return False
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return False
    try:
        word = os.pread(fd, 8, base - 8)
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(word) == 8 and bool(int.from_bytes(word, sys.byteorder) & _IS_MMAPPED)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip


def _remap(address: int, length: int, fd: int, offset: int) -> None:
    flags = mmap.MAP_SHARED | 0x10  # MAP_FIXED
    got = _libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, offset)
    if got != address:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap(MAP_FIXED) over the KV cache failed: {os.strerror(err)}")


class SharedKV:
    """The shared-memory segments now behind some CPU tensors, and aliases of those tensors.

    `alias(t)` is a tensor over the segment with `t`'s shape, strides and dtype:
    the same bytes as `t` (through another mapping), which kvflow's client can
    describe to the server. Keep this object as long as the tensors are registered.
    """

    def __init__(self) -> None:
        #: storage base address -> (page-aligned start, the segment's uint8 tensor)
        self._spans: dict[int, tuple[int, torch.Tensor]] = {}

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """Put `tensor`'s whole storage in shared memory, in place; return its alias.

        ValueError for a tensor off the CPU, or a storage that may share its pages with
        other allocations (`owns_its_pages`)."""
        if tensor.device.type != "cpu":
            raise ValueError(f"only CPU tensors are shared this way, got {tensor.device}")
        if shared_memory_of(tensor) is not None:
            return tensor
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        if base not in self._spans:
            if not owns_its_pages(base, storage.nbytes()):
                raise ValueError(
                    f"a CPU KV buffer of {storage.nbytes()} bytes may share its pages with"
                    " other heap allocations, so it is not moved into shared memory in place"
                    f" (only a mapping of its own of {MIN_REMAP_BYTES >> 20} MiB or more is):"
                    " allocate it with kvflow.core.empty_shared, or inside the connector's"
                    " SharedZeros context"
                )
            self._spans[base] = self._move(base, storage.nbytes())
        start, segment = self._spans[base]
        itemsize = tensor.element_size()
        offset = tensor.data_ptr() - start
        if offset % itemsize:
            raise ValueError(f"tensor at byte {offset} of its pages is not {itemsize}-aligned")
        return segment.view(tensor.dtype).as_strided(
            tuple(tensor.shape), tuple(tensor.stride()), offset // itemsize
        )

    @staticmethod
    def _move(base: int, nbytes: int) -> tuple[int, torch.Tensor]:
        page = mmap.PAGESIZE
        start = base - base % page
        end = -(-(base + max(nbytes, 1)) // page) * page
        length = end - start
        segment = empty_shared((length,), torch.uint8)
        memory = shared_memory_of(segment)
        assert isinstance(memory, ShmMemory)  # empty_shared's tensor is always described
        fd = os.open(os.path.join(SHM_DIR, memory.name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            for off in range(0, length, PIECE_BYTES):
                n = min(PIECE_BYTES, length - off)
                ctypes.memmove(segment.data_ptr() + off, start + off, n)
                _remap(start + off, n, fd, off)
        finally:
            os.close(fd)
        return start, segment


def share_all(tensors: Sequence[torch.Tensor], shared: SharedKV) -> list[torch.Tensor]:
    """`shared.share` of each tensor (CUDA tensors are returned as they are)."""
    return [t if t.device.type != "cpu" else shared.share(t) for t in tensors]


class SharedZeros(TorchFunctionMode):
    """While active, CPU `torch.zeros` of int8 (vLLM's raw KV buffer dtype) and at least
    `min_bytes` come from `empty_shared`; every other call runs as usual."""

    def __init__(self, min_bytes: int = 1 << 16) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        #: the shared tensors handed out (kept alive here too)
        self.allocated: list[torch.Tensor] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros and self._shareable(args, kwargs):
            shape = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            tensor = empty_shared(tuple(int(d) for d in shape), dtype)
            self.allocated.append(tensor)
            return tensor
        return func(*args, **kwargs)

    def _shareable(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        if set(kwargs) - {"dtype", "device"} or not args:
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        shape = args[0] if len(args) == 1 and not isinstance(args[0], int) else args
        try:
            dims = [int(d) for d in shape]
        except TypeError:
            return False
        if kwargs.get("dtype") is not torch.int8:
            return False
        nbytes = 1
        for d in dims:
            nbytes *= d
        return nbytes >= self.min_bytes
