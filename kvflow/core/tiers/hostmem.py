"""Host memory for L1: a few large segments, pinned when CUDA is present.

Pinning is slow per call, so L1 grows in large segments and carves objects out of
them (see `kvflow.core.tiers.l1`); this module only owns the memory and hands out views.
Segments are ordinary host allocations page-locked with `cudaHostRegister`, not
torch's pinned-memory allocator: torch records a CUDA event for every asynchronous
copy touching memory of that allocator and polls them all at its next allocation,
which cost each store or retrieve up to 0.3 ms of host time (docs/perf-journal.md).
Without CUDA a pool may instead fault its segments in when it makes them
(`prefault`), so that no store pays the first touch of L1 memory (docs/SERVER.md).
"""

from __future__ import annotations

import mmap
import weakref

import torch


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (then host memory is pinned)."""
    return torch.cuda.is_available()


#: cudaHostRegisterPortable: pinned for every device's context, not only the one current
#: on the pinning thread (a server copies into L1 from every GPU of its host)
REGISTER_PORTABLE = 1


def _pin(segment: torch.Tensor) -> None:
    """Page-lock `segment`'s memory for asynchronous copies from any GPU (cudaHostRegister)."""
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(segment.data_ptr(), segment.numel(), REGISTER_PORTABLE)
    if rc != cudart.cudaError.success:
        raise MemoryError(f"cudaHostRegister of {segment.numel()} bytes failed: {rc}")


def _resident_segment(nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory whose pages are all faulted in, one page fault at a time.

    Neither `MAP_POPULATE` nor letting `cudaHostRegister` fault the pages in: both fault
    a whole segment in one call under the process's memory-map lock (~0.5 s a GiB), and
    every other thread's mmap, munmap and CUDA call waited for it (an event record or a
    kernel launch and sync 1-2 s on the H200 while two threads pinned). A fault per page
    takes that lock only for itself, and registering resident pages takes ~0.06 s a GiB.
    """
    segment = torch.empty(nbytes, dtype=torch.uint8)
    segment[:: mmap.PAGESIZE].fill_(0)  # the first byte of every page, whatever the offset
    segment[-1:].fill_(0)  # and of the last page, which a start inside a page leaves out
    return segment


def _unpin_all(pointers: list[int]) -> None:
    """Undo `_pin` for every registered segment start in `pointers`, and forget them."""
    while pointers:
        torch.cuda.cudart().cudaHostUnregister(pointers.pop())


class HostPool:
    """Byte segments of host memory; views into them are L1 objects' storage."""

    def __init__(self, *, pinned: bool | None = None, prefault: bool = False) -> None:
        """`pinned` (default: when CUDA is present) page-locks every segment; `prefault`
        faults an unpinned pool's segments in as they are made (pinning already does)."""
        self.pinned = cuda_present() if pinned is None else pinned
        self.prefault = prefault and not self.pinned
        self._segments: list[torch.Tensor] = []
        self._bases: list[int] = []  # each segment's address, for copies by address
        self._registered: list[int] = []
        # unpin when the pool goes without release(), while its segments are still alive
        weakref.finalize(self, _unpin_all, self._registered)

    @property
    def slow_to_make(self) -> bool:
        """Whether making a segment costs real time (pinning or faulting it in), so L1
        should make its segments ahead of demand, in the background."""
        return self.pinned or self.prefault

    def add_segment(self, nbytes: int) -> int:
        """Allocate a new segment of `nbytes`; returns its index."""
        return self.adopt(self.make_segment(nbytes))

    def make_segment(self, nbytes: int) -> torch.Tensor:
        """Allocate (and pin or fault in, as the pool does) `nbytes` of host memory, not
        yet part of the pool: the slow half of `add_segment` (~0.16 s per GiB pinned),
        safe to run on any thread, with no lock held."""
        if not (self.pinned or self.prefault):
            return torch.empty(nbytes, dtype=torch.uint8)
        seg = _resident_segment(nbytes)
        if self.pinned:
            _pin(seg)
        return seg

    def adopt(self, segment: torch.Tensor) -> int:
        """Make a segment from `make_segment` part of the pool; returns its index (call
        from one thread at a time: L1 does, under its lock)."""
        if self.pinned:
            self._registered.append(segment.data_ptr())
        self._segments.append(segment)
        self._bases.append(segment.data_ptr())
        return len(self._segments) - 1

    def discard(self, segment: torch.Tensor) -> None:
        """Undo `make_segment` for a segment the pool never adopted."""
        if self.pinned:
            _unpin_all([segment.data_ptr()])

    def view(self, segment: int, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 bytes [offset, offset + nbytes) of a segment (shares memory)."""
        return self._segments[segment][offset : offset + nbytes]

    def address(self, segment: int, offset: int) -> int:
        """The host address of byte `offset` of a segment (what `view(...).data_ptr()`
        gives, without making a tensor: a driver copy needs only this)."""
        return self._bases[segment] + offset

    def release_segment(self, segment: int) -> None:
        """Unpin and drop one segment, whose index stays taken (L1 shrinking; no object
        may live there any more)."""
        base = self._bases[segment]
        if base in self._registered:
            self._registered.remove(base)
            _unpin_all([base])
        self._segments[segment] = torch.empty(0, dtype=torch.uint8)
        self._bases[segment] = 0

    def release(self) -> None:
        """Unpin and drop every segment (a view still held elsewhere keeps its bytes,
        no longer pinned, until it goes)."""
        _unpin_all(self._registered)
        self._segments.clear()
        self._bases.clear()
