"""A gate on L1's segment making: each segment is made only as the test releases a permit,
so a test decides when the segment being made is done (the pin-ahead tests use it)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvflow.core.tiers.hostmem import HostPool


class SegmentGate:
    """Wraps HostPool.make_segment: each segment is made only as a permit is released,
    so the test decides when the one being made is done."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.making = threading.Event()
        self.started = 0
        self.make = HostPool.make_segment

    def __call__(self, pool: HostPool, nbytes: int) -> torch.Tensor:
        self.started += 1
        self.making.set()
        assert self.permits.acquire(timeout=30), "a test forgot to release a segment"
        return self.make(pool, nbytes)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[SegmentGate]:
    """Every HostPool's segments gated for the test's duration (released at its end)."""
    gate = SegmentGate()
    monkeypatch.setattr(HostPool, "make_segment", lambda pool, nbytes: gate(pool, nbytes))
    yield gate
    gate.permits.release(100)  # let any thread still growing L1 finish
