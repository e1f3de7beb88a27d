"""Moving chunk bytes between an instance's KV blocks and L1 objects.

`CpuMover` gathers/scatters straight between CPU caches and L1 bytes.
`CudaMover` pipelines through GPU staging slots on two streams: the block kernel
runs on `kernel_stream` while the previous chunk's copy runs on `copy_stream`;
CUDA events order each slot's reuse, so the host only enqueues and waits once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from kvflow.kernels import KVLayout, TransferStream, new_transfer_stream, transfer_blocks

#: GPU bytes a CudaMover may use for staging (at least 2 slots of one chunk each).
STAGING_BUDGET_BYTES = 256 << 20
MAX_SLOTS = 4


class Mover(Protocol):
    """Copies chunks for one instance; enqueue then `wait()` (CPU movers finish at once)."""

    #: the stream each direction's last step runs on, for END events (None = host)
    store_stream: Any
    retrieve_stream: Any

    def store(self, block_ids: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        """Enqueue: chunk c's blocks (row c of block_ids) -> dsts[c] (uint8 L1 bytes)."""
        ...

    def retrieve(
        self, srcs: Sequence[torch.Tensor], block_ids: torch.Tensor, skip_blocks: Sequence[int]
    ) -> None:
        """Enqueue: srcs[c] -> chunk c's blocks, leaving its first skip_blocks[c] untouched."""
        ...

    def wait(self) -> None:
        """Block until everything enqueued has finished (raises the transfer's error)."""
        ...

    def close(self) -> None: ...


class CpuMover:
    """Synchronous moves for CPU-resident caches, through the kernels' CPU path."""

    store_stream: Any = None
    retrieve_stream: Any = None

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def store(self, block_ids: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        for c, dst in enumerate(dsts):
            transfer_blocks(
                self.layout, dst.view(1, -1), block_ids[c : c + 1], direction="gather",
                backend="cpu",
            )  # fmt: skip

    def retrieve(
        self, srcs: Sequence[torch.Tensor], block_ids: torch.Tensor, skip_blocks: Sequence[int]
    ) -> None:
        for c, src in enumerate(srcs):
            transfer_blocks(
                self.layout, src.view(1, -1), block_ids[c : c + 1], direction="scatter",
                skip_blocks=[skip_blocks[c]] if skip_blocks[c] else None, backend="cpu",
            )  # fmt: skip

    def wait(self) -> None:
        return None

    def close(self) -> None:
        return None


class CudaMover:
    """Pipelined GPU moves: staging slots, a kernel stream and a copy stream."""

    def __init__(self, layout: KVLayout, chunk_nbytes: int) -> None:
        self.layout = layout
        self.device = layout.device
        self.chunk_nbytes = chunk_nbytes
        self.n_slots = max(2, min(MAX_SLOTS, STAGING_BUDGET_BYTES // max(chunk_nbytes, 1)))
        self.kernel_stream: TransferStream = new_transfer_stream(self.device)
        self.copy_stream: TransferStream = new_transfer_stream(self.device)
        self.store_stream = self.copy_stream
        self.retrieve_stream = self.kernel_stream
        self._staging: torch.Tensor | None = None
        self._filled = [torch.cuda.Event() for _ in range(self.n_slots)]
        self._drained = [torch.cuda.Event() for _ in range(self.n_slots)]

    def _slots(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(
                (self.n_slots, self.chunk_nbytes), dtype=torch.uint8, device=self.device
            )
        return self._staging

    def _after_caller(self, stream: TransferStream) -> None:
        """Order our first step after the caller's pending work on its current stream."""
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        stream.torch.wait_event(ready)

    def store(self, block_ids: torch.Tensor, dsts: Sequence[torch.Tensor]) -> None:
        staging = self._slots()
        ks, cs = self.kernel_stream, self.copy_stream
        ids = block_ids.to(self.device, non_blocking=True)
        self._after_caller(ks)
        for c, dst in enumerate(dsts):
            s = c % self.n_slots
            if c >= self.n_slots:
                ks.torch.wait_event(self._drained[s])
            transfer_blocks(
                self.layout, staging[s : s + 1], ids[c : c + 1], direction="gather",
                backend="cuda", stream=ks,
            )  # fmt: skip
            self._filled[s].record(ks.torch)
            cs.torch.wait_event(self._filled[s])
            with torch.cuda.stream(cs.torch):
                dst.copy_(staging[s], non_blocking=True)
            self._drained[s].record(cs.torch)

    def retrieve(
        self, srcs: Sequence[torch.Tensor], block_ids: torch.Tensor, skip_blocks: Sequence[int]
    ) -> None:
        staging = self._slots()
        ks, cs = self.kernel_stream, self.copy_stream
        ids = block_ids.to(self.device, non_blocking=True)
        self._after_caller(cs)
        for c, src in enumerate(srcs):
            s = c % self.n_slots
            if c >= self.n_slots:
                cs.torch.wait_event(self._drained[s])
            with torch.cuda.stream(cs.torch):
                staging[s].copy_(src, non_blocking=True)
            self._filled[s].record(cs.torch)
            ks.torch.wait_event(self._filled[s])
            transfer_blocks(
                self.layout, staging[s : s + 1], ids[c : c + 1], direction="scatter",
                skip_blocks=[skip_blocks[c]] if skip_blocks[c] else None, backend="cuda",
                stream=ks,
            )  # fmt: skip
            self._drained[s].record(ks.torch)

    def wait(self) -> None:
        self.kernel_stream.synchronize()
        self.copy_stream.synchronize()

    def close(self) -> None:
        self.wait()
        self._staging = None
