"""A small engine on a recording bus, block readers and START/END pairing checks.

The engine and server tests use them to drive a CacheEngine on CPU caches and
assert on what it moved and published.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.tiers.base import StorageTier
from kvflow.events import END_TO_START, START_TO_END, Event, EventBus, EventType
from kvflow.events.testing import RecordingSubscriber
from kvflow.kernels.synthetic import block_bytes as block_bytes  # re-exported for the tests
from kvflow.kernels.synthetic import make_kv_caches

BLOCK = 4
CHUNK = 8  # two blocks per chunk
GIB = 1 << 30


class TensorChunks:
    """Host tensors as a mover's `HostChunks`, so tests drive a mover without an L1."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._tensors[index]

    def address(self, index: int, nbytes: int) -> int:
        tensor = self._tensors[index]
        if tensor.nbytes != nbytes or not tensor.is_contiguous():
            raise ValueError(f"chunk {index} is not {nbytes} contiguous bytes")
        return int(tensor.data_ptr())


def small_engine(
    *,
    l1_bytes: int = 1 << 20,
    chunk_size: int = CHUNK,
    l2_tiers: Sequence[StorageTier] | None = None,
    **config: Any,
) -> tuple[CacheEngine, RecordingSubscriber]:
    """An engine with `l1_bytes` of L1 on a started bus that records every event;
    `l2_tiers` and further ServerConfig fields (l2_disk_paths, l2_write_back...) as given."""
    bus = EventBus(capacity=100_000)
    recorder = RecordingSubscriber()
    bus.register(recorder)
    bus.start()
    server_config = ServerConfig(
        chunk_size=chunk_size,
        l1_size_gb=l1_bytes / GIB,
        observability=ObservabilityConfig(prometheus_port=0),
        **config,
    )
    return CacheEngine(server_config, bus=bus, l2_tiers=l2_tiers), recorder


def caches(fmt: str, seed: int, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """Random KV caches of `fmt` (block size BLOCK) and their registration kwargs."""
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 16)
    return make_kv_caches(fmt, generator=torch.Generator().manual_seed(seed), **kw)


def events_of(recorder: RecordingSubscriber, engine: CacheEngine) -> list[Event]:
    """Every event the engine published so far, once delivered."""
    assert engine.bus.flush(5.0)
    return list(recorder.events)


def pairs(events: list[Event]) -> Iterator[tuple[Event, Event]]:
    """(START, END) pairs in call order; asserts each START has exactly one END and vice versa."""
    starts: dict[int, Event] = {}
    ends: dict[int, Event] = {}
    for ev in events:
        if ev.type in START_TO_END:
            assert ev.op_id is not None and ev.op_id not in starts
            starts[ev.op_id] = ev
        elif ev.type in END_TO_START:
            assert ev.op_id is not None and ev.op_id not in ends, f"two ENDs for {ev.op_id}"
            ends[ev.op_id] = ev
    assert starts.keys() == ends.keys(), "unpaired START or END"
    for op_id in sorted(starts):  # op ids follow the order the calls began
        start = starts[op_id]
        end = ends[op_id]
        assert end.type == START_TO_END[start.type]
        assert end.session_id == start.session_id
        yield start, end


def of_type(events: list[Event], etype: EventType) -> list[Event]:
    """The events of one type, in order."""
    return [e for e in events if e.type == etype]
