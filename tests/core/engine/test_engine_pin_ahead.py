"""An engine whose L1 grows ahead of demand: an instance on a GPU is registered between
segments, not beside one being made (its CUDA calls would queue behind the pinning);
one in host memory makes no CUDA call and does not wait."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.kernels import KVFormat
from tests.support.engine import CHUNK, caches, small_engine
from tests.support.segment_gate import SegmentGate


def _growing_engine(gate: SegmentGate) -> CacheEngine:
    """An engine whose L1 (three 256-MiB segments, one pin thread) is making its first."""
    engine, _ = small_engine(l1_bytes=3 << 28, l1_prefault=True, l1_pin_threads=1)
    assert gate.making.wait(10), "L1 did not start growing ahead"
    return engine


def _register_in_background(engine: CacheEngine, device: str) -> threading.Event:
    kv, kw = caches(KVFormat.VLLM_FLASH_ATTN.value, seed=1, device=torch.device(device))
    registered = threading.Event()

    def register() -> None:
        engine.register_kv_caches("a", kv, model_name="m", **kw)
        registered.set()

    threading.Thread(target=register, daemon=True).start()
    return registered


def _finish_growing(engine: CacheEngine, gate: SegmentGate) -> None:
    gate.permits.release(100)
    for _ in range(1000):
        state = engine.status()["l1_pinning"]
        if not state["pinning"]:
            break
        threading.Event().wait(0.01)
    assert state["pinned_bytes"] == 3 << 28 and state["failed"] is None


def test_an_instance_in_host_memory_registers_while_a_segment_is_being_made(
    gate: SegmentGate,
) -> None:
    """CPU caches need no CUDA call: the registration does not wait for the pinning."""
    engine = _growing_engine(gate)
    registered = _register_in_background(engine, "cpu")
    assert registered.wait(10), "a CPU registration waited for L1's growth"
    assert gate.started == 1
    _finish_growing(engine, gate)
    tokens = np.arange(2 * CHUNK, dtype=np.int32)
    assert engine.store("a", tokens, [0, 1, 2, 3], request_id="r") == 2 * CHUNK
    assert engine.lookup(tokens, model_name="m") == 2 * CHUNK
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_instance_on_a_gpu_registers_between_segments(gate: SegmentGate) -> None:
    """Registered while a segment is being made, a CUDA instance is added once that
    segment is done, before the next one starts (not after the whole L1)."""
    engine = _growing_engine(gate)
    registered = _register_in_background(engine, "cuda:0")
    assert not registered.wait(0.3), "registered while a segment was being made"
    gate.permits.release()  # the first segment is done; the next ones wait for a permit
    assert registered.wait(30), "the registration waited beyond the segment being made"
    assert gate.started <= 2  # the third segment waits for the second's permit
    _finish_growing(engine, gate)
    engine.close()
