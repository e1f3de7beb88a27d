"""Host memory for L1: a few large segments, pinned when CUDA is present.

Pinning is slow per call, so L1 grows in large segments and carves objects out of
them (see `kvflow.core.l1`); this module only owns the memory and hands out views.
"""

from __future__ import annotations

import torch


def cuda_present() -> bool:
    """Whether torch sees a CUDA device (then host memory is pinned)."""
    return torch.cuda.is_available()


class HostPool:
    """Byte segments of host memory; views into them are L1 objects' storage."""

    def __init__(self, *, pinned: bool | None = None) -> None:
        self.pinned = cuda_present() if pinned is None else pinned
        self._segments: list[torch.Tensor] = []

    def add_segment(self, nbytes: int) -> int:
        """Allocate a new segment of `nbytes`; returns its index."""
        seg = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._segments.append(seg)
        return len(self._segments) - 1

    def view(self, segment: int, offset: int, nbytes: int) -> torch.Tensor:
        """The uint8 bytes [offset, offset + nbytes) of a segment (shares memory)."""
        return self._segments[segment][offset : offset + nbytes]

    def release(self) -> None:
        """Drop every segment (the memory returns when no view is left)."""
        self._segments.clear()
