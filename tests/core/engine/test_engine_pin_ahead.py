"""An engine whose L1 grows ahead of demand: a registration runs between segments, not
beside one being made (on a GPU its CUDA calls would queue behind the pinning)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvflow.core.tiers.hostmem import HostPool
from kvflow.kernels import KVFormat
from tests.support.engine import CHUNK, caches, small_engine


class SegmentGate:
    """Stands in for HostPool.make_segment: each segment is made only as a permit is
    released, so the test decides when the one being made is done."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.making = threading.Event()
        self.started = 0

    def __call__(self, nbytes: int) -> torch.Tensor:  # not a method: no pool argument
        self.started += 1
        self.making.set()
        assert self.permits.acquire(timeout=30), "a test forgot to release a segment"
        return torch.empty(nbytes, dtype=torch.uint8)  # never touched: nothing to fault in


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[SegmentGate]:
    gate = SegmentGate()
    monkeypatch.setattr(HostPool, "make_segment", gate)
    yield gate
    gate.permits.release(100)  # let any thread still growing L1 finish


def test_a_registration_waits_for_the_segment_being_made_not_for_the_whole_l1(
    gate: SegmentGate,
) -> None:
    """Registered while a segment is being made, the instance is added once that segment
    is done, before the next one starts; the rest of L1 grows afterwards."""
    engine, _ = small_engine(l1_bytes=3 << 30, l1_prefault=True, l1_pin_threads=1)
    assert gate.making.wait(10), "L1 did not start growing ahead"
    kv, kw = caches(KVFormat.VLLM_FLASH_ATTN.value, seed=1)
    registered = threading.Event()

    def register() -> None:
        engine.register_kv_caches("a", kv, model_name="m", **kw)
        registered.set()

    registering = threading.Thread(target=register)
    registering.start()
    assert not registered.wait(0.3), "registered while a segment was being made"
    gate.permits.release()  # the first segment is done; the next ones wait for a permit
    assert registered.wait(10), "the registration waited beyond the segment being made"
    registering.join(10)
    assert gate.started <= 2  # the third segment waits for the second's permit
    gate.permits.release(100)
    for _ in range(1000):
        state = engine.status()["l1_pinning"]
        if not state["pinning"]:
            break
        threading.Event().wait(0.01)
    assert state["pinned_bytes"] == 3 << 30 and state["failed"] is None
    tokens = np.arange(2 * CHUNK, dtype=np.int32)
    assert engine.store("a", tokens, [0, 1, 2, 3], request_id="r") == 2 * CHUNK  # it serves
    assert engine.lookup(tokens, model_name="m") == 2 * CHUNK
    engine.close()
