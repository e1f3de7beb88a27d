"""CacheEngine events: START/END pairs on every path, and the other event types' attrs."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.keys import chain_hashes
from kvflow.core.errors import InvalidRequestError, KVFlowError, TransferError
from kvflow.core.tiers.base import ObjectKey
from kvflow.events import BlockAllocation, EventBus, EventType
from kvflow.subscribers import build_subscribers
from kvflow.subscribers.testing import MetricsCapture
from tests.support.engine import BLOCK, CHUNK, caches, events_of, of_type, pairs, small_engine

TOKENS = np.arange(2 * CHUNK + 1, dtype=np.int32)
BLOCKS = [3, 1, 4, 0, 5]


def test_every_start_has_one_end_on_success() -> None:
    """store, lookup and retrieve each publish a START/END pair with tokens and bytes."""
    engine, recorder = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    engine.store("a", TOKENS, BLOCKS, request_id="q")
    engine.lookup(TOKENS, model_name="m", request_id="q")
    engine.retrieve("a", TOKENS, BLOCKS, request_id="q")
    events = events_of(recorder, engine)
    done = {start.type: end.attrs for start, end in pairs(events)}
    nbytes = 2 * engine.status()["instances"]["a"]["chunk_nbytes"]
    hashes = done[EventType.LOOKUP_START]["chunk_hashes"]  # the two full chunks' keys
    assert len(hashes) == 2 and all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    assert done[EventType.STORE_START] == {
        "instance_id": "a", "model_name": "m", "tokens": 2 * CHUNK, "bytes": nbytes,
        "ok": True, "error": None, "chunk_hashes": hashes, "chunk_bytes": nbytes // 2,
        "held_tokens": 2 * CHUNK, "tokens_by_tier": {"l1": 2 * CHUNK},
    }  # fmt: skip
    assert done[EventType.RETRIEVE_START]["chunk_hashes"] == hashes
    assert (
        done[EventType.LOOKUP_START]["chunk_size"],
        done[EventType.LOOKUP_START]["world_size"],
    ) == (CHUNK, 1)
    assert done[EventType.RETRIEVE_START]["bytes"] == nbytes
    assert done[EventType.RETRIEVE_START]["hit_tokens"] == 2 * CHUNK
    lookup = done[EventType.LOOKUP_START]
    assert (lookup["requested_tokens"], lookup["hit_tokens"], lookup["ok"]) == (
        len(TOKENS),
        2 * CHUNK,
        True,
    )
    starts = of_type(events, EventType.STORE_START)
    assert starts[0].session_id == "q" and starts[0].attrs["tokens"] == len(TOKENS)
    engine.close()


def test_a_failing_transfer_ends_its_op_and_leaves_nothing_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy that raises: TransferError, a failed END, no L1 object, usage back to zero."""
    engine, recorder = small_engine()
    kv, kw = caches("vllm_flashinfer", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    mover = engine._instance("a").mover

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("copy engine on fire")

    monkeypatch.setattr(mover, "store", broken)
    with pytest.raises(TransferError, match="copy engine on fire"):
        engine.store("a", TOKENS, BLOCKS, request_id="q")
    assert engine.lookup(TOKENS, model_name="m") == 0
    assert engine.l1_stats()["usage_bytes"] == 0 and engine.l1_stats()["writing"] == 0
    monkeypatch.setattr(mover, "retrieve", broken)
    monkeypatch.undo()
    engine.store("a", TOKENS, BLOCKS, request_id="q")
    monkeypatch.setattr(mover, "retrieve", broken)
    with pytest.raises(TransferError):
        engine.retrieve("a", TOKENS, BLOCKS, request_id="q")
    events = events_of(recorder, engine)
    ends = [end.attrs for _, end in pairs(events) if end.type != EventType.LOOKUP_END]
    assert [(e["ok"], e["error"]) for e in ends] == [
        (False, "transfer_failed"),
        (True, None),
        (False, "transfer_failed"),
    ]
    assert ends[0]["tokens"] == 0 and ends[0]["bytes"] == 0
    assert "copy engine on fire" in ends[0]["error_message"]
    assert not of_type(events, EventType.L1_READ)
    assert engine.l1_stats()["objects"] == 2
    # the failed retrieve unpinned what it read: both objects can go (pinned ones stay), so
    # failed retrieves cannot slowly make L1 unevictable
    assert engine.l1.drop_where(lambda key: True) == 2
    assert engine.l1_stats()["objects"] == 0
    engine.close()


def test_invalid_requests_still_pair_start_and_end() -> None:
    """Validation failures after START publish a failed END naming the error code."""
    engine, recorder = small_engine()
    kv, kw = caches("vllm_mla", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    with pytest.raises(InvalidRequestError):
        engine.store("a", TOKENS, [0], request_id="q")
    with pytest.raises(InvalidRequestError):
        engine.retrieve("a", TOKENS, BLOCKS, request_id="q", skip_first_n_tokens=1)
    with pytest.raises(InvalidRequestError):
        engine.lookup(TOKENS, model_name="")
    ends = [end.attrs for _, end in pairs(events_of(recorder, engine))]
    assert len(ends) == 3
    assert all(e["ok"] is False and e["error"] == "invalid_argument" for e in ends)
    engine.close()


def test_register_allocations_sessions_and_l1_events() -> None:
    """REGISTER/UNREGISTER, BLOCK_ALLOCATION, END_SESSION, L1_WRITE/READ/EVICT attrs."""
    kv, kw = caches("vllm_cross_layer", seed=1)
    engine, recorder = small_engine()
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    nbytes = engine.status()["instances"]["a"]["chunk_nbytes"]
    engine.close()
    engine, recorder = small_engine(l1_bytes=3 * nbytes)
    engine.register_kv_caches("a", kv, model_name="m", world_size=2, rank=1, **kw)
    rec = BlockAllocation("q", [3, 1], list(range(2 * BLOCK)))
    engine.report_block_allocations("a", [rec])
    engine.store("a", TOKENS, BLOCKS, request_id="q")
    engine.retrieve("a", TOKENS, BLOCKS, request_id="q")
    engine.store("a", TOKENS + 1000, BLOCKS, request_id="q2")
    engine.end_session("q")
    engine.unregister("a")
    events = events_of(recorder, engine)
    (reg,) = of_type(events, EventType.REGISTER)
    assert reg.attrs == {
        "instance_id": "a", "model_name": "m", "world_size": 2, "rank": 1,
        "kv_format": "vllm_cross_layer", "num_layers": 2, "num_blocks": 16, "block_size": BLOCK,
    }  # fmt: skip
    assert of_type(events, EventType.UNREGISTER)[0].attrs == reg.attrs
    (alloc,) = of_type(events, EventType.BLOCK_ALLOCATION)
    assert alloc.attrs == {"instance_id": "a", "model_name": "m", "block_size": BLOCK,
                           "records": (rec,)}  # fmt: skip
    # L1_WRITE and L1_EVICT name the objects (for the KV-event stream)
    first, second = (
        [ObjectKey(h, "m", 2, 1, None) for h in chain_hashes(t[: 2 * CHUNK], CHUNK)]
        for t in (TOKENS, TOKENS + 1000)
    )
    writes = of_type(events, EventType.L1_WRITE)
    assert [w.attrs for w in writes] == [
        {"chunks": 2, "bytes": 2 * nbytes, "keys": first},
        {"chunks": 2, "bytes": 2 * nbytes, "keys": second},
    ]
    assert of_type(events, EventType.L1_READ)[0].attrs == {"chunks": 2, "bytes": 2 * nbytes}
    # L1 held 3 chunks: the second store evicted one of the first's (L1's LRU picks which)
    (evict,) = of_type(events, EventType.L1_EVICT)
    assert (evict.attrs["chunks"], evict.attrs["bytes"]) == (1, nbytes)
    assert len(evict.attrs["keys"]) == 1 and evict.attrs["keys"][0] in first
    (end,) = of_type(events, EventType.END_SESSION)
    assert end.session_id == "q"
    engine.close()


def test_bad_allocation_records_are_refused() -> None:
    """Records must be (req_id, block ids, token ids) with a non-empty request id."""
    engine, _ = small_engine()
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    with pytest.raises(InvalidRequestError, match="sequence of BlockAllocation"):
        engine.report_block_allocations("a", "oops")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"records\[0\].req_id"):
        engine.report_block_allocations("a", [("", [1], [2])])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match=r"records\[1\]"):
        engine.report_block_allocations("a", [("q", [1], [2]), ("q", 5)])  # type: ignore[list-item]
    engine.close()


def test_inflight_gauges_return_to_zero_and_metrics_follow_the_ops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the metrics subscriber on the bus: inflight is 0 when idle, even after failures."""
    capture = MetricsCapture()
    bus = EventBus(capacity=10_000)
    config = ServerConfig(
        chunk_size=CHUNK,
        l1_size_gb=(1 << 20) / (1 << 30),
        observability=ObservabilityConfig(prometheus_port=0, logging_enabled=False),
    )
    engine = CacheEngine(config, bus=bus)
    pipeline = build_subscribers(
        config.observability, bus=bus, meter_provider=capture.provider, l1_stats=engine.l1_stats
    )
    bus.start()
    kv, kw = caches("sglang_mha", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    engine.store("a", TOKENS, BLOCKS, request_id="q")
    engine.retrieve("a", TOKENS, BLOCKS, request_id="q")
    monkeypatch.setattr(engine._instance("a").mover, "store", _raise)
    with pytest.raises(TransferError):
        engine.store("a", TOKENS + 1, BLOCKS, request_id="q2")
    with pytest.raises(InvalidRequestError):
        engine.retrieve("a", TOKENS, BLOCKS, request_id="q", skip_first_n_tokens=3)
    assert bus.flush(5.0)
    assert capture.total("kvflow.inflight.stores") == 0
    assert capture.total("kvflow.inflight.retrieves") == 0
    assert capture.total("kvflow.store.requests", outcome="ok") == 1
    assert capture.total("kvflow.store.requests", outcome="error") == 1
    assert capture.total("kvflow.retrieve.requests", outcome="error") == 1
    assert capture.total("kvflow.l1.usage_bytes") == engine.l1_stats()["usage_bytes"] > 0
    assert capture.total("kvflow.l1.objects") == 2
    engine.close()
    assert pipeline.shutdown(5.0)
    capture.shutdown()


def _raise(*args: object, **kwargs: object) -> None:
    raise RuntimeError("injected failure")


def test_an_engine_builds_its_own_pipeline_from_config_and_closes_it() -> None:
    """Without a bus, the engine builds bus + subscribers from config and stops them on close."""
    config = ServerConfig(
        chunk_size=CHUNK,
        l1_size_gb=(1 << 20) / (1 << 30),
        observability=ObservabilityConfig(prometheus_port=0, log_level="warning"),
    )
    engine = CacheEngine(config)
    assert engine.bus.running
    kv, kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    engine.store("a", TOKENS, BLOCKS, request_id="q")
    assert engine.close(5.0)
    assert not engine.bus.running
    assert engine.close()
    with pytest.raises(KVFlowError, match="closed"):
        engine.lookup(TOKENS, model_name="m")
