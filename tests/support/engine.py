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
from kvflow.kernels.formats import KVFormat
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

    def region(self, index: int) -> int:
        """The allocation the tensor's bytes belong to (its storage)."""
        return int(self._tensors[index].untyped_storage().data_ptr())


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


def _block_pieces(kv_caches: Any, kwargs: dict[str, Any], block: int) -> list[torch.Tensor]:
    """Block `block` of every layer's K and V (or MLA latent), indexed straight from the
    tensors as the engine formats lay them out (docs/KERNELS.md's format table): each piece
    is [block_size, heads, head_size] or [block_size, dim] in logical token order."""
    fmt = KVFormat(kwargs["kv_format"])
    if fmt is KVFormat.VLLM_CROSS_LAYER:  # [blocks, layers, 2, block_size, heads, head_size]
        return [kv_caches[block, layer, kv] for layer in range(kv_caches.shape[1]) for kv in (0, 1)]
    if fmt is KVFormat.VLLM_FLASH_ATTN:  # layers x [2, blocks, block_size, heads, head_size]
        return [layer[kv, block] for layer in kv_caches for kv in (0, 1)]
    if fmt is KVFormat.VLLM_FLASHINFER:  # layers x [blocks, 2, block_size, heads, head_size]
        return [layer[block, kv] for layer in kv_caches for kv in (0, 1)]
    if fmt is KVFormat.VLLM_MLA:  # layers x [blocks, block_size, dim]
        return [layer[block] for layer in kv_caches]
    rows = slice(block * kwargs["block_size"], (block + 1) * kwargs["block_size"])
    if fmt is KVFormat.SGLANG_MHA:  # (K layers, V layers) x [tokens, heads, head_size]
        keys, values = kv_caches
        return [t[rows] for pair in zip(keys, values, strict=True) for t in pair]
    assert fmt is KVFormat.SGLANG_MLA, fmt  # layers x [tokens, 1, dim]
    return [layer[rows, 0] for layer in kv_caches]


def block_bytes(kv_caches: Any, kwargs: dict[str, Any], block_ids: Sequence[int]) -> torch.Tensor:
    """Each listed block's bytes, one row per block: what round-trip checks compare.

    Read by plain indexing of the caches, block by block (a Python loop), never through
    KVLayout or the transfer code the engine moves blocks with: a bug shared by the
    engine's gather and scatter (wrong block, wrong layer, wrong token order) shows here
    instead of cancelling out. Rows of caches in different formats holding the same KV
    compare equal (layer by layer, K then V, tokens in order).
    """
    rows = []
    for block in block_ids:
        pieces = _block_pieces(kv_caches, kwargs, block)
        rows.append(torch.cat([p.cpu().contiguous().view(torch.uint8).view(-1) for p in pieces]))
    return torch.stack(rows) if rows else torch.empty((0, 0), dtype=torch.uint8)


def caches(fmt: str, seed: int, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """Random KV caches of `fmt` (block size BLOCK) and their registration kwargs."""
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("num_blocks", 16)
    return make_kv_caches(fmt, generator=torch.Generator().manual_seed(seed), **kw)


def register_world(engine: CacheEngine, world_size: int, model_name: str = "m") -> None:
    """Register ranks 0..world_size-1 of `model_name` as instances "tp<rank>" (random
    vllm_flash_attn caches, seeded by rank)."""
    for rank in range(world_size):
        kv, kw = caches("vllm_flash_attn", seed=rank)
        engine.register_kv_caches(
            f"tp{rank}", kv, model_name=model_name, world_size=world_size, rank=rank, **kw
        )


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


class ToldSignal:
    """A LayerSignal that logs its marks in order, with the server's reply (`enqueued`,
    passed to `CacheEngine.retrieve`) among them."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def ready(self, layer: int, stream: Any) -> None:
        self.log.append(f"layer {layer}")

    def failed(self, first_layer: int) -> None:
        self.log.append(f"failed from {first_layer}")

    def enqueued(self, stream: Any, hit_tokens: int) -> None:
        self.log.append(f"reply {hit_tokens}")
