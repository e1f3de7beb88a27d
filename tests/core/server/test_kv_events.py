"""The server's KV-event stream seen by subscribing clients: stored and removed records per
tier with owner and chunk hashes, per-subscription numbering, bounded replay, expiry with
the client, and a restart that subscribers see."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient, KVFlowServer, empty_shared
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.keys import chain_hashes
from kvflow.core.errors import InvalidRequestError, PermissionDeniedError, UnknownSubscriptionError
from kvflow.core.server.kv_subscriber import KVEventStream
from kvflow.subscribers.kv_events import KVRecord
from tests.support.collectors import free_port
from tests.support.engine import CHUNK, caches, small_engine
from tests.support.ops import engine_served


def _register(client: KVFlowClient, iid: str, model: str = "m", **kw: Any) -> dict[str, Any]:
    kv, kwargs = caches("vllm_flash_attn", seed=1, **kw)
    shared = []
    for t in kv:
        s = empty_shared(t.shape, t.dtype)
        s.copy_(t)
        shared.append(s)
    client.register_kv_caches(iid, shared, model_name=model, **kwargs)
    return kwargs


def _hashes(tokens: list[int]) -> list[bytes]:
    return chain_hashes(np.asarray(tokens, dtype="<i4"), CHUNK)


def _drain(stream: KVEventStream, engine: CacheEngine) -> list[KVRecord]:
    assert engine.bus.flush(5.0)
    return stream.poll().records


def test_stores_and_evictions_become_numbered_records_with_owner_and_hashes() -> None:
    """A store's chunks arrive as one `stored` CPU record of its owner with the chained
    chunk hashes; chunks L1 evicts for a later store arrive as `removed`; the subscription
    numbers its records 1, 2, 3 whatever the log's own positions."""
    # L1 holds 4 chunks of this instance (2 layers x 2 x 2 blocks x 4 tokens x heads x dim)
    engine, _ = small_engine(port=0, l1_bytes=4 * 8192)
    with engine_served(engine) as (client, _server):
        _register(client, "w0", num_layers=2, num_heads=2, head_size=64)
        stream = KVEventStream(client, model_name="m")
        first = list(range(4 * CHUNK))
        assert client.store("w0", first, list(range(8)), request_id="a") == 4 * CHUNK
        (stored,) = _drain(stream, engine)
        assert (stored.seq, stored.kind, stored.tier, stored.medium) == (1, "stored", "l1", "CPU")
        assert (stored.model_name, stored.world_size, stored.rank, stored.cache_salt) == (
            "m", 1, 0, None,
        )  # fmt: skip
        assert stored.chunk_hashes == _hashes(first)
        other = list(range(1000, 1000 + 2 * CHUNK))
        client.store("w0", other, [8, 9, 10, 11], request_id="b", cache_salt="s")
        records = _drain(stream, engine)
        kinds = [(r.seq, r.kind, r.cache_salt) for r in records]
        assert kinds == [(2, "removed", None), (3, "stored", "s")]
        # L1 evicts a prefix's tail first: the first store's last chunk, then the one before
        assert records[0].chunk_hashes == _hashes(first)[2:][::-1]
        assert records[1].chunk_hashes == _hashes(other)
        assert all(r.log_seq > 0 for r in records)


def test_a_filter_skips_other_models_and_numbering_stays_dense() -> None:
    """Records of a model the subscription did not ask for are not delivered, and the
    subscription's own numbers have no holes where they were."""
    engine, _ = small_engine(port=0)
    with engine_served(engine) as (client, _server):
        _register(client, "wa", model="a")
        _register(client, "wb", model="b")
        only_b = KVEventStream(client, model_name="b")
        every = KVEventStream(client)
        client.store("wa", list(range(CHUNK)), [0, 1], request_id="1")
        client.store("wb", list(range(CHUNK)), [0, 1], request_id="2")
        client.store("wa", list(range(50, 50 + CHUNK)), [2, 3], request_id="3")
        client.store("wb", list(range(50, 50 + CHUNK)), [2, 3], request_id="4")
        assert engine.bus.flush(5.0)
        b_records = only_b.poll().records
        assert [(r.seq, r.model_name) for r in b_records] == [(1, "b"), (2, "b")]
        assert [r.log_seq for r in b_records] == [2, 4]
        assert [r.model_name for r in every.poll().records] == ["a", "b", "a", "b"]
        # an owner no engine could have is refused naming what is out of range
        for world_size, rank, named in (
            (None, -3, "rank"),
            (2, 2, "rank"),
            (0, None, "world_size"),
        ):
            with pytest.raises(InvalidRequestError, match=f"^{named} must be an integer in"):
                client.subscribe_kv_events(model_name="b", world_size=world_size, rank=rank)
        assert client.subscribe_kv_events(world_size=2, rank=1).epoch  # in range: taken


def test_a_lost_reply_is_replayed_and_an_old_position_is_told_what_it_lost() -> None:
    """Polling again from the same position returns the same records with the same
    numbers (a reply lost on the way); a position the bounded log dropped gets what is
    left and how many log records were lost."""
    engine, _ = small_engine(port=0, kv_events_chunks=3)
    with engine_served(engine) as (client, _server):
        _register(client, "w0")
        sub = client.subscribe_kv_events()
        for i in range(5):
            client.store(
                "w0", list(range(i * 100, i * 100 + CHUNK)), [2 * i, 2 * i + 1], request_id=str(i)
            )
        assert engine.bus.flush(5.0)
        again = [
            client.poll_kv_events(sub.subscription, after_seq=7, after_log_seq=3) for _ in range(2)
        ]
        assert again[0] == again[1]
        assert [(r.seq, r.log_seq) for r in again[0].records] == [(8, 4), (9, 5)]
        assert again[0].lost == 0
        old = client.poll_kv_events(sub.subscription, after_seq=0, after_log_seq=0)
        assert old.lost == 2  # log records 1 and 2 were dropped (3 chunks kept)
        assert [(r.seq, r.log_seq) for r in old.records] == [(1, 3), (2, 4), (3, 5)]
        for bad, value in (("after_seq", -1), ("after_log_seq", -1), ("max_records", 0)):
            numbers = {"after_seq": 0, "after_log_seq": 0, "max_records": 8, bad: value}
            with pytest.raises(InvalidRequestError, match=f"^{bad} must be >= [01], got {value}$"):
                client.poll_kv_events(sub.subscription, **numbers)


def test_a_subscription_expires_with_its_client_and_belongs_to_it() -> None:
    """Another client may not poll a subscription; one whose client stays silent past the
    heartbeat timeout is dropped, and the stream then resubscribes and replays from where
    it was, losing nothing the log still holds."""
    engine, _ = small_engine(port=0, heartbeat_timeout_s=0.5)
    with engine_served(engine) as (client, server):
        stream = KVEventStream(client, model_name="m")
        assert stream.poll().records == []
        with (
            KVFlowClient(server.endpoint, timeout_s=20) as other,
            pytest.raises(PermissionDeniedError),
        ):
            other.poll_kv_events(stream.subscription or "", after_seq=0, after_log_seq=0)
        with KVFlowClient(server.endpoint, timeout_s=20) as writer:
            kv, kwargs = caches("vllm_flash_attn", seed=1)
            shared = [empty_shared(t.shape, t.dtype) for t in kv]
            writer.register_kv_caches("w0", shared, model_name="m", **kwargs)
            old = stream.subscription
            deadline = time.monotonic() + 10
            while server.status()["server"]["kv_events"]["subscriptions"]:
                writer.status()  # the writer stays alive; the subscriber is silent
                assert time.monotonic() < deadline, "the silent client's subscription stayed"
                time.sleep(0.1)
            writer.store("w0", list(range(CHUNK)), [0, 1], request_id="x")
            assert engine.bus.flush(5.0)
            with pytest.raises(UnknownSubscriptionError, match="subscribe again"):
                client.poll_kv_events(old or "", after_seq=0, after_log_seq=0)
            batch = stream.poll()
            assert stream.subscription != old
            assert batch.reset is None and batch.lost == 0
            assert [(r.seq, r.kind) for r in batch.records] == [(1, "stored")]


def test_disk_write_through_is_a_storage_record_and_disk_eviction_removes(
    tmp_path: Path,
) -> None:
    """A chunk written through to the disk tier arrives as `stored` with medium STORAGE
    and tier disk; the disk evicting it for newer chunks arrives as `removed`."""
    chunk_bytes = 2 * 2 * 2 * 4 * 1 * 16 * 4  # layers x K/V x blocks x tokens x heads x dim x f32
    engine, _ = small_engine(
        port=0, l2_disk_paths=(str(tmp_path),), l2_disk_size_gb=2.5 * chunk_bytes / (1 << 30)
    )
    with engine_served(engine) as (client, _server):
        _register(client, "w0", num_layers=2, num_heads=1, head_size=16, dtype=torch.float32)
        stream = KVEventStream(client)
        tokens = [list(range(i * 100, i * 100 + CHUNK)) for i in range(3)]
        disk: list[KVRecord] = []
        for i, t in enumerate(tokens):
            client.store("w0", t, [2 * i, 2 * i + 1], request_id=str(i))
            deadline = time.monotonic() + 10
            # each write-through, and the third's eviction of the first, in turn
            while len(disk) < i + 1 + (i == 2):
                assert engine.bus.flush(5.0)
                disk += [r for r in stream.poll().records if r.tier == "disk"]
                assert time.monotonic() < deadline, "no disk record came"
        stored = [r for r in disk if r.kind == "stored"]
        assert [r.chunk_hashes for r in stored] == [_hashes(t) for t in tokens]
        assert {r.medium for r in disk} == {"STORAGE"}
        (removed,) = [r for r in disk if r.kind == "removed"]
        assert removed.chunk_hashes == _hashes(tokens[0])


def test_kv_events_off_refuse_subscriptions() -> None:
    """With --kv-events-chunks 0 nothing is logged and subscribing says why."""
    engine, _ = small_engine(port=0, kv_events_chunks=0)
    with engine_served(engine) as (client, server):
        with pytest.raises(InvalidRequestError, match="--kv-events-chunks 0"):
            client.subscribe_kv_events()
        assert server.status()["server"]["kv_events"] is None


def test_a_server_restart_is_visible_to_the_stream() -> None:
    """A server restarted on the same endpoint has a new epoch: the stream's next poll says
    "restart" and then delivers the new server's records, numbered on."""
    port = free_port()
    engine, _ = small_engine(port=port)
    server = KVFlowServer(engine.config, engine=engine)
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    with KVFlowClient(server.endpoint, timeout_s=20) as client:
        try:
            _register(client, "w0")
            stream = KVEventStream(client)
            client.store("w0", list(range(CHUNK)), [0, 1], request_id="a")
            assert engine.bus.flush(5.0)
            assert [r.seq for r in stream.poll().records] == [1]
            first_epoch = stream.epoch
        finally:
            server.request_stop()
            serving.join(20)
        engine2, _ = small_engine(port=port)
        with engine_served(engine2) as (writer, _server2):
            batch = stream.poll()
            assert batch.reset == "restart" and batch.records == []
            assert stream.epoch != first_epoch
            _register(writer, "w1")
            writer.store("w1", list(range(CHUNK)), [0, 1], request_id="b")
            assert engine2.bus.flush(5.0)
            assert [(r.seq, r.log_seq) for r in stream.poll().records] == [(2, 1)]
