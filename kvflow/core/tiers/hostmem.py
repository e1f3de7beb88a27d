"""Host memory for L1: a few large segments, pinned when CUDA is present.

Pinning is slow per call, so L1 grows in large segments and carves objects out of
them (see `kvflow.core.tiers.l1`); this module only owns the memory and hands out views.
Segments are ordinary host allocations page-locked with `cudaHostRegister`, not
torch's pinned-memory allocator: torch records a CUDA event for every asynchronous
copy touching memory of that allocator and polls them all at its next allocation,
which cost each store or retrieve up to 0.3 ms of host time (docs/perf-journal.md).
"""

from __future__ import annotations

import weakref

import torch


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (then host memory is pinned)."""
    return torch.cuda.is_available()


def _pin(segment: torch.Tensor) -> None:
    """Page-lock `segment`'s memory for asynchronous copies (cudaHostRegister)."""
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(segment.data_ptr(), segment.numel(), 0)
    if rc != cudart.cudaError.success:
        raise MemoryError(f"cudaHostRegister of {segment.numel()} bytes failed: {rc}")


def _unpin_all(pointers: list[int]) -> None:
    """Undo `_pin` for every registered segment start in `pointers`, and forget them."""
    while pointers:
        torch.cuda.cudart().cudaHostUnregister(pointers.pop())


class HostPool:
    """Byte segments of host memory; views into them are L1 objects' storage."""

    def __init__(self, *, pinned: bool | None = None) -> None:
        self.pinned = cuda_present() if pinned is None else pinned
        self._segments: list[torch.Tensor] = []
        self._bases: list[int] = []  # each segment's address, for copies by address
        self._registered: list[int] = []
        # unpin when the pool goes without release(), while its segments are still alive
        weakref.finalize(self, _unpin_all, self._registered)

    def add_segment(self, nbytes: int) -> int:
        """Allocate a new segment of `nbytes`; returns its index."""
        seg = torch.empty(nbytes, dtype=torch.uint8)
        if self.pinned:
            _pin(seg)
            self._registered.append(seg.data_ptr())
        self._segments.append(seg)
        self._bases.append(seg.data_ptr())
        return len(self._segments) - 1

    def view(self, segment: int, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 bytes [offset, offset + nbytes) of a segment (shares memory)."""
        return self._segments[segment][offset : offset + nbytes]

    def address(self, segment: int, offset: int) -> int:
        """The host address of byte `offset` of a segment (what `view(...).data_ptr()`
        gives, without making a tensor: a driver copy needs only this)."""
        return self._bases[segment] + offset

    def release(self) -> None:
        """Unpin and drop every segment (a view still held elsewhere keeps its bytes,
        no longer pinned, until it goes)."""
        _unpin_all(self._registered)
        self._segments.clear()
        self._bases.clear()
