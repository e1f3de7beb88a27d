"""kvflow-owned CUDA streams usable by PyCUDA kernels and by torch (as an ExternalStream)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import device as TorchDevice

from kvflow.cuda.context import pycuda_context
from kvflow.cuda.driver import CU_STREAM_NON_BLOCKING, libcuda
from kvflow.kernels.loader import cuda_available

_default_lock = threading.Lock()
_default_streams: dict[int, TransferStream] = {}


@dataclass(frozen=True, eq=False)
class TransferStream:
    """One CUstream seen both as a PyCUDA Stream and as a torch ExternalStream."""

    handle: int
    pycuda: Any
    torch: torch.cuda.ExternalStream
    device: TorchDevice

    def synchronize(self) -> None:
        """Wait for all work on the stream (releases the GIL while waiting)."""
        assert self.device.index is not None
        with pycuda_context(self.device.index):
            self.pycuda.synchronize()


def _device_index(device: torch.device | str | int) -> int:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"a transfer stream needs a CUDA device; got {dev}")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def new_transfer_stream(
    device: torch.device | str | int, *, high_priority: bool = False
) -> TransferStream:
    """A new non-blocking stream on ``device`` (`high_priority`: the device's greatest
    stream priority, for kernels the engine's own work waits on); RuntimeError without
    CUDA or pycuda."""
    if not cuda_available():
        raise RuntimeError(
            "CUDA transfer streams need a CUDA device visible to torch and pycuda "
            "(pip install 'kvflow[cuda]')"
        )
    index = _device_index(device)
    import pycuda.driver as drv

    with pycuda_context(index):
        stream = drv.Stream(CU_STREAM_NON_BLOCKING)
        handle = int(stream.handle)
        if high_priority:
            libcuda().raise_priority(handle)
    dev = torch.device("cuda", index)
    return TransferStream(handle, stream, torch.cuda.ExternalStream(handle, device=dev), dev)


def current_stream_handle(device_index: int) -> int:
    """The raw CUstream of torch's current stream on a device: what
    `torch.cuda.current_stream(device).cuda_stream` gives, at a tenth of its host cost."""
    return int(torch._C._cuda_getCurrentRawStream(device_index))


def default_transfer_stream(device: torch.device | str | int) -> TransferStream:
    """The per-device stream ``transfer_blocks`` uses when given none (created once)."""
    index = _device_index(device)
    with _default_lock:
        stream = _default_streams.get(index)
        if stream is None:
            stream = new_transfer_stream(index)
            _default_streams[index] = stream
        return stream
