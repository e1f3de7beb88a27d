"""Reusable page-locked host and device buffers for uploading transfers' block ids.

Uploading a request's few KB of ids through a fresh pinned tensor cost about 0.1 ms
of host time per op on the GPU machine (a pinned allocation, an event per copy, both
before the op's first copy could start). An `IdBuffer` is allocated once and handed
out in consecutive pieces; its owner calls `reset()` once every transfer that used
it has finished, which the owner knows (a mover resets after waiting on its streams).
"""

from __future__ import annotations

import numpy as np
import torch

from kvflow.cuda.enqueue import copy_async
from kvflow.kernels.streams import TransferStream

#: int32 slots a new buffer starts with (64 KiB; a request of 16k blocks fits)
DEFAULT_SLOTS = 1 << 14


class IdBuffer:
    """Bump-allocated int32 ids: pinned on the host, resident on one CUDA device.

    `upload` copies through the driver (`kvflow.cuda.enqueue`), so torch records
    nothing per copy. A request that does not fit gets a larger pair of buffers; the
    old pair is kept until `reset()`, since work already queued may still read it.
    """

    def __init__(self, device: torch.device, slots: int = DEFAULT_SLOTS) -> None:
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"an IdBuffer needs an indexed CUDA device, got {device}")
        self.device = device
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._allocate(slots)

    def _allocate(self, slots: int) -> None:
        self._host = torch.empty(slots, dtype=torch.int32, pin_memory=True)
        self._host_np = self._host.numpy()
        self._dev = torch.empty(slots, dtype=torch.int32, device=self.device)
        self._used = 0

    def upload(self, parts: tuple[np.ndarray, ...], stream: TransferStream) -> int:
        """Copy the parts (integer arrays, flattened, cast to int32) end to end into the
        buffer, asynchronously on `stream`; returns their device address, valid until `reset`."""
        n = sum(int(p.size) for p in parts)
        if self._used + n > len(self._host_np):
            self._retired.append((self._host, self._dev))
            self._allocate(max(2 * len(self._host_np), n))
        start = self._used
        at = start
        dev = self._dev.data_ptr()
        for part in parts:
            self._host_np[at : at + part.size] = part.reshape(-1)
            at += part.size
        self._used = at
        if n:
            host = self._host.data_ptr()
            copy_async(dev + 4 * start, host + 4 * start, 4 * n, stream.handle)
        return dev + 4 * start

    def reset(self) -> None:
        """Reuse the buffer from its start: every transfer that used it must have finished."""
        self._retired.clear()
        self._used = 0
