"""Requests through an in-process KVFlowServer reach the engine as the same calls and events;
its status, prefetches, unregistrations and bind errors, seen by a client."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient, KVFlowServer, empty_shared
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.errors import (
    InvalidRequestError,
    KVFlowError,
    PermissionDeniedError,
    UnknownInstanceError,
)
from kvflow.core.server.curve import generate
from kvflow.core.server.protocol import PROTOCOL_VERSION
from kvflow.events import BlockAllocation, EventBus, EventType
from kvflow.events.testing import RecordingSubscriber
from tests.support.engine import CHUNK, caches, events_of, of_type, pairs, small_engine
from tests.support.ops import engine_served
from tests.support.tiers import FaultyTier, memory_tier


@pytest.fixture
def served() -> Iterator[tuple[KVFlowClient, KVFlowServer, RecordingSubscriber]]:
    engine, recorder = small_engine(port=0)
    with engine_served(engine) as (client, server):
        yield client, server, recorder


def _wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _shared(kv: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t in kv:
        s = empty_shared(t.shape, t.dtype)
        s.copy_(t)
        out.append(s)
    return out


def test_allocations_and_session_ends_arrive_as_events(
    served: tuple[KVFlowClient, KVFlowServer, RecordingSubscriber],
) -> None:
    """report_block_allocations publishes the records as BlockAllocations; end_session too."""
    client, server, recorder = served
    kv, kwargs = caches("vllm_flash_attn", seed=1)
    client.register_kv_caches("w0", _shared(kv), model_name="m", **kwargs)
    records = [
        BlockAllocation("r1", [3, 4], list(range(8))),
        BlockAllocation("r2", np.array([5]), torch.tensor([9, 9, 9, 9])),
    ]
    client.report_block_allocations("w0", records)
    client.end_session("r1")
    with pytest.raises(UnknownInstanceError):
        client.report_block_allocations("nobody", records)
    events = events_of(recorder, server.engine)
    (alloc,) = of_type(events, EventType.BLOCK_ALLOCATION)
    assert alloc.attrs["instance_id"] == "w0"
    assert [tuple(map(list, r[1:])) for r in alloc.attrs["records"]] == [
        ([3, 4], list(range(8))),
        ([5], [9, 9, 9, 9]),
    ]
    assert [r.req_id for r in alloc.attrs["records"]] == ["r1", "r2"]
    assert all(isinstance(r, BlockAllocation) for r in alloc.attrs["records"])
    (end,) = of_type(events, EventType.END_SESSION)
    assert end.session_id == "r1"


def test_every_remote_operation_pairs_its_events(
    served: tuple[KVFlowClient, KVFlowServer, RecordingSubscriber],
) -> None:
    """Stores, lookups and retrieves over RPC, failing ones included, each get START and END."""
    client, server, recorder = served
    kv, kwargs = caches("vllm_flash_attn", seed=2)
    client.register_kv_caches("w1", _shared(kv), model_name="m", **kwargs)
    tokens = list(range(2 * CHUNK))
    assert client.store("w1", tokens, [0, 1, 2, 3], request_id="s") == 2 * CHUNK
    assert client.lookup(tokens, model_name="m", request_id="s") == 2 * CHUNK
    assert client.retrieve("w1", tokens, [4, 5, 6, 7], request_id="g") == 2 * CHUNK
    with pytest.raises(InvalidRequestError):
        client.store("w1", list(range(100, 116)), [0, 1, 2, 99], request_id="bad")
    events = events_of(recorder, server.engine)
    done = [(start.type, start.session_id, end.attrs["ok"]) for start, end in pairs(events)]
    assert (EventType.STORE_START, "s", True) in done
    assert (EventType.LOOKUP_START, "s", True) in done
    assert (EventType.RETRIEVE_START, "g", True) in done
    assert (EventType.STORE_START, "bad", False) in done


def test_a_slow_l2_lookup_does_not_hold_up_other_clients() -> None:
    """With an L2 tier that hangs, a lookup waits its L2 timeout on the server's query
    worker while another client's requests are answered at once."""
    tier = FaultyTier(memory_tier())
    tier.hang = {"contains"}
    engine, _ = small_engine(l2_tiers=[tier], l2_timeout_s=1.5, port=0)
    with engine_served(engine) as (slow, server), KVFlowClient(server.endpoint) as other:
        hits: list[int] = []
        asking = threading.Thread(
            target=lambda: hits.append(slow.lookup(list(range(4 * CHUNK)), model_name="m"))
        )
        started = time.monotonic()
        asking.start()
        while tier.calls["contains"] == 0:  # the lookup is now waiting on the tier
            assert time.monotonic() - started < 10
            time.sleep(0.01)
        t0 = time.monotonic()
        other.status()
        other.end_session("r")
        assert time.monotonic() - t0 < 1.0  # not queued behind the 1.5 s lookup
        asking.join(10)
        assert hits == [0]  # the hung tier counted as a miss, within its timeout


#: the most rounding to milliseconds adds to a duration
ROUNDING = 0.0005


def _is_rounded(seconds: object) -> bool:
    """A duration in seconds, as a float rounded to milliseconds."""
    return isinstance(seconds, float) and seconds == round(seconds, 3)


def test_status_describes_the_server_its_instances_and_clients() -> None:
    """status()["server"]: endpoint, pid, limits, counters, authentication, and per instance
    and client the owner and the seconds since registration or last message."""
    before = time.monotonic()
    engine, _ = small_engine(port=0, heartbeat_timeout_s=7.0, max_message_mb=2.0)
    with engine_served(engine) as (client, server):
        kv, kwargs = caches("vllm_flash_attn", seed=4)
        registering = time.monotonic()
        client.register_kv_caches("w4", _shared(kv), model_name="m", **kwargs)
        status = client.status()
        elapsed, since_register = time.monotonic() - before, time.monotonic() - registering
    info = status["server"]
    assert info["endpoint"] == server.endpoint
    assert info["pid"] == os.getpid()
    assert info["protocol_version"] == PROTOCOL_VERSION
    assert (info["heartbeat_timeout_s"], info["max_message_bytes"]) == (7.0, 2 << 20)
    assert info["max_instances"] == engine.config.max_instances
    assert info["workers"] >= 1
    assert info["requests"] >= 1 and info["errors"] == 0 and info["reaped_instances"] == 0
    assert info["cuda_ipc_mappings"] == 0
    assert (info["authentication"], info["authorized_keys"]) == ("none", None)
    assert _is_rounded(info["uptime_s"]) and 0 <= info["uptime_s"] <= elapsed + ROUNDING
    assert list(info["instances"]) == ["w4"]
    instance = info["instances"]["w4"]
    assert instance["client"] == client.client_id
    assert _is_rounded(instance["registered_s_ago"])
    assert 0 <= instance["registered_s_ago"] <= since_register + ROUNDING
    assert list(info["clients"]) == [client.client_id]
    seen = info["clients"][client.client_id]
    assert _is_rounded(seen) and 0 <= seen <= since_register + ROUNDING


def test_cuda_ipc_mappings_are_zero_without_gpu_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA IPC handle is open on a CPU-only server, whether or not the IPC module
    was ever loaded."""
    engine, _ = small_engine(port=0)
    server = KVFlowServer(engine.config, engine=engine)
    try:
        monkeypatch.delitem(sys.modules, "kvflow.core.server.ipc", raising=False)
        assert server.status()["server"]["cuda_ipc_mappings"] == 0
        monkeypatch.undo()
        importlib.import_module("kvflow.core.server.ipc")
        assert server.status()["server"]["cuda_ipc_mappings"] == 0
    finally:
        server.close()
        engine.bus.stop(5.0)


def test_prefetch_over_rpc_brings_l2_chunks_back_into_l1() -> None:
    """client.prefetch starts loading a salted request's L2-resident chunks into L1 and
    prefetch_state reports them landed; bad arguments and unknown models or ids are the
    engine's errors, answered by the server's query worker."""
    engine, recorder = small_engine(port=0, l2_tiers=[memory_tier()])
    with engine_served(engine) as (client, _):
        kv, kwargs = caches("vllm_flash_attn", seed=5)
        client.register_kv_caches("w5", _shared(kv), model_name="m", **kwargs)
        tokens = list(range(2 * CHUNK))
        assert client.store("w5", tokens, [0, 1, 2, 3], request_id="s", cache_salt="salt") == (
            2 * CHUNK
        )
        _wait_for(lambda: client.status()["l2"]["tiers"]["mem"]["stored"] == 2)
        engine.l1.drop_where(lambda key: True)  # the chunks are now in L2 only
        prefetch_id = client.prefetch(tokens, model_name="m", cache_salt="salt", request_id="p")
        _wait_for(lambda: client.prefetch_state(prefetch_id)["state"] == "done")
        state = client.prefetch_state(prefetch_id)
        assert state["landed_tokens"] == 2 * CHUNK
        with pytest.raises(InvalidRequestError, match="token_ids must be 1-D"):
            client.prefetch([[1, 2]], model_name="m")
        with pytest.raises(UnknownInstanceError, match="'nobody'"):
            client.prefetch(tokens, model_name="nobody")
        with pytest.raises(UnknownInstanceError, match=r"world_size 2 rank\(s\) \[0, 1\]"):
            client.prefetch(tokens, model_name="m", world_size=2)
        with pytest.raises(UnknownInstanceError, match="'pf-unknown'"):
            client.prefetch_state("pf-unknown")
        assert client.status()["server"]["errors"] >= 1
    (start,) = of_type(events_of(recorder, engine), EventType.PREFETCH_START)
    assert start.session_id == "p"


def test_unregister_releases_the_instance_everywhere() -> None:
    """After unregister the instance is gone from the server's status and the engine's, its
    id is free for another client, and the reply carries the server's handling time."""
    engine, _ = small_engine(port=0)
    with engine_served(engine) as (client, server):
        kv, kwargs = caches("vllm_flash_attn", seed=6)
        client.register_kv_caches("w6", _shared(kv), model_name="m", **kwargs)
        client.unregister("w6")
        assert client.last_server_time_s > 0
        status = client.status()
        assert status["server"]["instances"] == {}
        assert "w6" not in status["instances"]
        with KVFlowClient(server.endpoint, timeout_s=20) as other:
            other.register_kv_caches("w6", _shared(kv), model_name="m", **kwargs)
            other.unregister("w6")


def _small_config() -> ServerConfig:
    """small_engine's configuration, for engines of a CacheEngine subclass."""
    return ServerConfig(
        chunk_size=CHUNK,
        l1_size_gb=(1 << 20) / (1 << 30),
        observability=ObservabilityConfig(prometheus_port=0),
        port=0,
    )


def _started_bus() -> EventBus:
    bus = EventBus(capacity=1000)
    bus.start()
    return bus


class _BrokenUnregisterEngine(CacheEngine):
    """A real engine whose unregister fails (as a flush or an unmap could)."""

    def unregister(self, instance_id: str) -> None:
        raise KVFlowError(f"cannot unregister {instance_id!r}: flush failed")


def test_a_failed_unregister_reaches_the_client_and_is_counted() -> None:
    """An unregister the engine refuses is answered with the engine's error, counted in
    the server's errors; the server still forgets the instance."""
    engine = _BrokenUnregisterEngine(_small_config(), bus=_started_bus())
    with engine_served(engine) as (client, _):
        kv, kwargs = caches("vllm_flash_attn", seed=7)
        client.register_kv_caches("w7", _shared(kv), model_name="m", **kwargs)
        with pytest.raises(KVFlowError, match="cannot unregister 'w7': flush failed"):
            client.unregister("w7")
        assert client.last_server_time_s > 0
        info = client.status()["server"]
        assert (info["errors"], info["instances"]) == (1, {})


def test_a_busy_port_is_an_os_error_naming_it() -> None:
    """A second server on a port in use fails with OSError naming host and port."""
    engine, _ = small_engine(port=0)
    first = KVFlowServer(engine.config, engine=engine)
    try:
        port = int(first.endpoint.rsplit(":", 1)[1])
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            KVFlowServer(replace(engine.config, port=port), engine=engine)
    finally:
        first.close()
        engine.bus.stop(5.0)


def test_a_curve_server_ties_instances_to_client_keys(tmp_path: Path) -> None:
    """With CURVE, status says so and counts the authorised keys; an instance may be taken
    over by a client holding the same key (whatever its client id), never by another key."""
    server_public, server_secret = generate(tmp_path / "server", "server")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    secrets = {}
    for name in ("alice", "bob"):
        public, secrets[name] = generate(tmp_path / name, name)
        shutil.copy(public, authorized)
    engine, _ = small_engine(
        port=0, curve_secret_key=str(server_secret), curve_authorized_keys=str(authorized)
    )

    def keyed(who: str, client_id: str) -> dict[str, Any]:
        return {
            "client_id": client_id,
            "curve_server_key": server_public,
            "curve_key": secrets[who],
        }

    kv, kwargs = caches("vllm_flash_attn", seed=8)
    with engine_served(engine, **keyed("alice", "alice app")) as (alice, server):
        info = alice.status()["server"]
        assert (info["authentication"], info["authorized_keys"]) == ("curve", 2)
        alice.register_kv_caches("w8", _shared(kv), model_name="m", **kwargs)
        with (
            KVFlowClient(server.endpoint, timeout_s=20, **keyed("bob", "bob app")) as bob,
            pytest.raises(PermissionDeniedError, match="another CURVE key"),
        ):
            bob.register_kv_caches("w8", _shared(kv), model_name="m", takeover=True, **kwargs)
        with KVFlowClient(server.endpoint, timeout_s=20, **keyed("alice", "restarted")) as again:
            again.register_kv_caches("w8", _shared(kv), model_name="m", takeover=True, **kwargs)
            owner = again.status()["server"]["instances"]["w8"]["client"]
            assert owner.endswith(" restarted")
            again.unregister("w8")


class _GatedRegisterEngine(CacheEngine):
    """A real engine whose registration of "doomed" waits for `gate`, then fails."""

    def __init__(self, config: ServerConfig, bus: EventBus) -> None:
        super().__init__(config, bus=bus)
        self.entered = threading.Event()
        self.gate = threading.Event()

    def register_kv_caches(self, instance_id: str, kv_caches: Any, **kwargs: Any) -> None:
        if instance_id == "doomed":
            self.entered.set()
            self.gate.wait(30)
            raise InvalidRequestError("the doomed registration fails")
        super().register_kv_caches(instance_id, kv_caches, **kwargs)


def test_an_unregister_queued_behind_a_failing_registration_succeeds() -> None:
    """Unregistering an instance whose registration is still being served: the registration
    then fails, and the unregister, served after it, has nothing to release but succeeds."""
    engine = _GatedRegisterEngine(_small_config(), _started_bus())
    with engine_served(engine) as (client, server):
        kv, kwargs = caches("vllm_flash_attn", seed=9)
        refused: list[str] = []
        handling_times: list[float] = []

        def register() -> None:
            try:
                client.register_kv_caches("doomed", _shared(kv), model_name="m", **kwargs)
            except InvalidRequestError as exc:
                refused.append(str(exc))

        def unregister() -> None:
            client.unregister("doomed")
            handling_times.append(client.last_server_time_s)

        registering = threading.Thread(target=register)
        registering.start()
        assert engine.entered.wait(20)  # the registration is now on its worker, held
        unregistering = threading.Thread(target=unregister)
        unregistering.start()
        # the server forgets the instance when it queues the unregister behind it
        _wait_for(lambda: "doomed" not in server.status()["server"]["instances"])
        engine.gate.set()
        registering.join(30)
        unregistering.join(30)
    assert refused == ["the doomed registration fails"]
    assert len(handling_times) == 1 and handling_times[0] > 0
