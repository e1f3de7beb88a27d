"""CUDA IPC: share GPU KV tensors and the engine's "KV written" event across processes.

The client exports the IPC handle of each tensor's allocation base (PyCUDA
`mem_get_ipc_handle`) plus the tensor's byte offset in it; the server opens each
handle once per registration and views it as a torch tensor. The engine's
interprocess CUDA event is recorded by the client before every store and waited
on by the server, so a store never reads KV the engine has not finished writing.
PyCUDA is imported lazily: CPU-only installs never need it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvflow.core.errors import InvalidRequestError
from kvflow.core.server.protocol import CudaIpcMemory
from kvflow.cuda.context import pycuda_context
from kvflow.kernels.loader import pycuda_importable

_lock = threading.Lock()
#: IPC handle -> its open mapping, while any tensor views it (a handle opens once per process).
_mappings: weakref.WeakValueDictionary[bytes, CudaMapping] = weakref.WeakValueDictionary()


@contextmanager
def _driver_on(index: int) -> Iterator[Any]:
    """pycuda.driver with the device's primary context (torch's) current; a clear error
    when PyCUDA is missing."""
    if not pycuda_importable():
        raise InvalidRequestError(
            "sharing GPU tensors with a kvflow server needs PyCUDA (pip install 'kvflow[cuda]')"
        )
    import pycuda.driver as drv

    with pycuda_context(index):
        yield drv


def device_uuid(index: int) -> str:
    """The stable identity of a visible GPU (indices differ between processes)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index_of(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; InvalidRequestError if it is not visible."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise InvalidRequestError(f"GPU {uuid} is not visible to the kvflow server")


def cuda_ipc_memory_of(tensor: torch.Tensor) -> CudaIpcMemory:
    """Describe a GPU tensor's memory: its allocation's IPC handle and its byte offset."""
    index = tensor.device.index if tensor.device.index is not None else 0
    ptr = tensor.data_ptr()
    with _driver_on(index) as drv:
        try:
            base, size = drv.mem_get_address_range(ptr)
            handle = bytes(drv.mem_get_ipc_handle(base))
        except drv.Error as exc:
            raise InvalidRequestError(
                f"cannot export a CUDA IPC handle for a tensor on cuda:{index} ({exc}); its"
                " memory must come from cudaMalloc (not expandable segments or a"
                " cudaMallocAsync pool)"
            ) from None
    return CudaIpcMemory(
        handle=handle,
        offset=ptr - int(base),
        alloc_size=int(size),
        device_uuid=device_uuid(index),
        device_index=index,
    )


class CudaMapping:
    """An opened IPC handle: a `__cuda_array_interface__` view of its device bytes.

    Counts the registrations' tensors that use it; `release_cuda_ipc` closes the
    mapping when the last one is released, so an unregistered instance's GPU
    memory is unmapped at once rather than when the garbage collector runs.
    """

    def __init__(self, ptr: int, nbytes: int, mapping: Any, device: int, handle: bytes) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }
        self._mapping = mapping
        self.device = device
        self.handle = handle
        self.users = 0

    @property
    def closed(self) -> bool:
        return self._mapping is None


def open_cuda_ipc(memory: CudaIpcMemory) -> tuple[torch.Tensor, CudaMapping]:
    """The whole allocation `memory` lives in, as a uint8 tensor on this process's GPU,
    and its mapping (pass it to `release_cuda_ipc` once no tensor views it).

    Each handle is opened once per process; opening it again while it is in use
    reuses the mapping (CUDA refuses to open one handle twice).
    """
    index = device_index_of(memory.device_uuid)
    with _lock:
        holder = _mappings.get(memory.handle)
        if holder is not None:
            holder.users += 1
    if holder is None:
        with _driver_on(index) as drv:
            try:
                mapping = drv.IPCMemoryHandle(  # PyCUDA accepts only a bytearray
                    bytearray(memory.handle), drv.ipc_mem_flags.LAZY_ENABLE_PEER_ACCESS
                )
            except Exception as exc:  # PyCUDA raises its own LogicError/RuntimeError
                raise InvalidRequestError(f"cannot open CUDA IPC memory handle: {exc}") from None
        holder = CudaMapping(int(mapping), memory.alloc_size, mapping, index, memory.handle)
        holder.users = 1
        with _lock:
            _mappings[memory.handle] = holder
    return torch.as_tensor(holder, device=f"cuda:{index}"), holder


def release_cuda_ipc(holder: CudaMapping) -> None:
    """One user fewer; the last one closes the mapping (every tensor on it must be gone)."""
    with _lock:
        holder.users -= 1
        if holder.users > 0 or holder._mapping is None:
            return
        mapping, holder._mapping = holder._mapping, None
        if _mappings.get(holder.handle) is holder:
            del _mappings[holder.handle]
    with _driver_on(holder.device):
        torch.cuda.synchronize(holder.device)  # no queued copy may still read the memory
        mapping.close()


def open_mappings() -> int:
    """How many IPC handles this process has open (for tests and status)."""
    with _lock:
        return sum(not h.closed for h in _mappings.values())


def make_interprocess_event() -> torch.cuda.Event:
    """The event a client records after the engine writes KV (shared with the server)."""
    return torch.cuda.Event(interprocess=True)


def open_interprocess_event(handle: bytes, device: int) -> torch.cuda.Event:
    """Open a client's interprocess event in the server."""
    try:
        return torch.cuda.Event.from_ipc_handle(device, handle)
    except Exception as exc:  # torch raises RuntimeError for a bad handle
        raise InvalidRequestError(f"cannot open the engine's CUDA IPC event: {exc}") from None


def open_interprocess_events(
    handles: list[bytes], device: int, expected: int, what: str
) -> list[torch.cuda.Event]:
    """Open `expected` interprocess events of a Register, counted before any is opened;
    InvalidRequestError naming `what` (their count and order) for another count."""
    if len(handles) != expected:
        raise InvalidRequestError(f"{what}: got {len(handles)} events, expected {expected}")
    return [open_interprocess_event(h, device) for h in handles]
