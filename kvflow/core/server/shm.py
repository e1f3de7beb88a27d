"""CPU tensors in POSIX shared memory, so a kvflow server process can map an engine's KV.

`empty_shared` creates a segment under /dev/shm and returns a tensor viewing it;
`shared_memory_of` describes any view of such a tensor (segment name + byte
offset) and `map_shared` maps a described segment in the server. A segment's
name is unlinked when the creating process frees its last view (or exits);
mappings already open elsewhere stay valid.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import math
import mmap
import os
import re
import secrets
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kvflow.core.errors import InvalidRequestError
from kvflow.core.server.protocol import FdMemory, ShmMemory

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvflow-"
# Only names empty_shared can produce: no path separators, no other programs' segments.
_NAME_RE = re.compile(r"^kvflow-[0-9]+-[0-9]+-[0-9a-f]{8}$")

_counter = itertools.count()
_lock = threading.Lock()
#: mmap base address -> (segment name, segment size) for segments this process created.
_segments: dict[int, tuple[str, int]] = {}
#: mmap base address -> (fd, size) of whole memfds another allocator mapped (share_memfd).
_memfds: dict[int, tuple[int, int]] = {}
MEMFD_PREFIX = "/memfd:"


def empty_shared(shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor backed by a new POSIX shared-memory segment."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(dims) * itemsize
    size = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, size)
        segment = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    raw = torch.frombuffer(segment, dtype=torch.uint8)  # keeps `segment` alive
    base = raw.data_ptr()
    with _lock:
        _segments[base] = (name, size)
    weakref.finalize(segment, _release, base, name, path)
    return raw[:nbytes].view(dtype).view(dims)


def _release(base: int, name: str, path: str) -> None:
    """Forget a segment whose last view died, and unlink its name.

    The mapping is already gone when this runs, so another thread's new segment may
    have the same base address by now: only this segment's own entry is dropped.
    """
    with _lock:
        if _segments.get(base, ("",))[0] == name:
            del _segments[base]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def is_shared(tensor: torch.Tensor) -> bool:
    """Whether `tensor` views memory created by `empty_shared` in this process."""
    return shared_memory_of(tensor) is not None


def shared_memory_of(tensor: torch.Tensor) -> ShmMemory | FdMemory | None:
    """The segment (or shared memfd) and byte offset `tensor` views, or None if it is not
    in shared memory."""
    if tensor.device.type != "cpu":
        return None
    base = tensor.untyped_storage().data_ptr()
    with _lock:
        entry = _segments.get(base)
        memfd = _memfds.get(base)
    if entry is not None:
        name, size = entry
        return ShmMemory(name=name, size=size, offset=tensor.data_ptr() - base)
    if memfd is not None:
        fd, size = memfd
        return FdMemory(pid=os.getpid(), fd=fd, size=size, offset=tensor.data_ptr() - base)
    return None


def share_memfd(buffer: torch.Tensor, fd: int) -> None:
    """Declare that `buffer` maps the memfd `fd` of this process from its first byte (an
    allocator's own shared memory: SGLang's host pool with its shm allocator), so that
    views of it describe as FdMemory and a server on this host maps the same pages.

    Raises ValueError when `fd` is not a memfd or does not hold the buffer's bytes, or
    `buffer` does not start its storage. `forget_memfd` undoes it (before the memory goes).
    """
    if buffer.device.type != "cpu":
        raise ValueError(f"share_memfd needs a CPU tensor, got one on {buffer.device}")
    base = buffer.untyped_storage().data_ptr()
    if buffer.data_ptr() != base:
        raise ValueError("share_memfd needs the tensor that starts the memfd's mapping")
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise ValueError(f"fd {fd} cannot be shared: {exc.strerror}") from None
    if not target.startswith(MEMFD_PREFIX):
        raise ValueError(f"fd {fd} is {target!r}, not a memfd")
    nbytes = buffer.untyped_storage().nbytes()
    if size < nbytes:
        raise ValueError(f"memfd {fd} has {size} bytes, fewer than the buffer's {nbytes}")
    with _lock:
        _memfds[base] = (fd, size)


def forget_memfd(buffer: torch.Tensor) -> None:
    """Undo `share_memfd` (the memfd may be closed and its memory reused afterwards)."""
    with _lock:
        _memfds.pop(buffer.untyped_storage().data_ptr(), None)


def map_shared(memory: ShmMemory) -> torch.Tensor:
    """Map a described segment (server side) as a uint8 tensor of the whole segment.

    The mapping lives as long as the returned tensor or any view of it; see
    `map_segment` to unmap it deterministically.
    """
    return map_segment(memory)[0]


class Segment:
    """A MAP_SHARED mapping of a whole segment that keeps no file descriptor open.

    (Python's mmap.mmap keeps a dup of the file's descriptor per mapping until it
    is closed: one fd per registered segment, which a registration flood turns
    into fd exhaustion.) `buffer` is a ctypes array over the mapping; the mapping
    is unmapped when that array dies (its last tensor view with it), or at once by
    `release_segment` when nothing else views it.
    """

    __slots__ = ("_unmap", "buffer", "size")

    def __init__(self, fd: int, size: int) -> None:
        if size <= 0:
            raise ValueError("cannot map an empty segment")
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.size = size
        self.buffer: Any = (ctypes.c_uint8 * size).from_address(addr)
        self._unmap = weakref.finalize(self.buffer, _libc.munmap, addr, size)

    @property
    def closed(self) -> bool:
        return not self._unmap.alive


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_segment(memory: ShmMemory) -> tuple[torch.Tensor, Segment]:
    """`map_shared`'s tensor and the Segment behind it, for `release_segment` to unmap.

    Raises
    InvalidRequestError for a name empty_shared could not have made, a segment
    that no longer exists, or a size that differs from the description.
    """
    if not _NAME_RE.match(memory.name):
        raise InvalidRequestError(
            f"shared-memory segment name {memory.name!r} was not made by kvflow.core.empty_shared"
        )
    path = os.path.join(SHM_DIR, memory.name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise InvalidRequestError(
            f"shared-memory segment {memory.name!r} does not exist (freed by its owner?)"
        ) from None
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot open shared-memory segment {memory.name!r}: {exc.strerror}"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size != memory.size:
            raise InvalidRequestError(
                f"shared-memory segment {memory.name!r} has {size} bytes, described as {memory.size}"
            )
        segment = Segment(fd, size)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"cannot map shared-memory segment {memory.name!r}: {exc}"
        ) from None
    finally:
        os.close(fd)
    return torch.frombuffer(segment.buffer, dtype=torch.uint8), segment


def map_memfd(memory: FdMemory) -> tuple[torch.Tensor, Segment]:
    """Map a client's memfd (server side), like `map_segment`, through /proc/<pid>/fd/<fd>.

    Raises InvalidRequestError when the process or descriptor does not exist (or is
    this server's own), the descriptor is not a memfd, or its size differs.
    """
    where = f"fd {memory.fd} of process {memory.pid}"
    if memory.pid == os.getpid() or memory.pid < 1 or memory.fd < 0:
        raise InvalidRequestError(f"{where} cannot be a client's memfd")
    path = f"/proc/{memory.pid}/fd/{memory.fd}"
    try:
        target = os.readlink(path)
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise InvalidRequestError(
            f"cannot open {where} (is the client on this host, running as this user?):"
            f" {exc.strerror}"
        ) from None
    try:
        if not target.startswith(MEMFD_PREFIX):
            raise InvalidRequestError(f"{where} is {target!r}, not a memfd")
        size = os.fstat(fd).st_size
        if size != memory.size:
            raise InvalidRequestError(f"{where} has {size} bytes, described as {memory.size}")
        segment = Segment(fd, size)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot map {where}: {exc}") from None
    finally:
        os.close(fd)
    return torch.frombuffer(segment.buffer, dtype=torch.uint8), segment


def release_segment(segment: Segment) -> bool:
    """Unmap `segment` now if no tensor views it any more; False (and left mapped) otherwise.

    torch.frombuffer holds one reference to the buffer per live storage, and
    unmapping under a live view would leave it dangling: the reference count
    tells whether any view is left.
    """
    buffer = segment.buffer
    if buffer is None:
        return True
    # getrefcount sees: the segment's attribute, `buffer`, getrefcount's own argument
    if sys.getrefcount(buffer) > 3:
        gc.collect()  # a view kept alive only by a reference cycle
        if sys.getrefcount(buffer) > 3:
            return False
    del buffer
    segment.buffer = None  # the array dies here, and its finalizer unmaps
    return segment.closed
