"""Requests through an in-process KVFlowServer reach the engine as the same calls and events."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient, KVFlowServer, empty_shared
from kvflow.core.errors import InvalidRequestError, UnknownInstanceError
from kvflow.events import BlockAllocation, EventType
from kvflow.events.testing import RecordingSubscriber
from tests.support.engine import CHUNK, caches, events_of, of_type, pairs, small_engine
from tests.support.tiers import FaultyTier, memory_tier


@pytest.fixture
def served() -> Iterator[tuple[KVFlowClient, KVFlowServer, RecordingSubscriber]]:
    engine, recorder = small_engine(port=0)
    server = KVFlowServer(engine.config, engine=engine)
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    with KVFlowClient(server.endpoint, timeout_s=20) as client:
        yield client, server, recorder
    server.request_stop()
    serving.join(20)
    engine.bus.stop(5.0)


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
    server = KVFlowServer(engine.config, engine=engine)
    serving = threading.Thread(target=server.serve_forever)
    serving.start()
    try:
        with KVFlowClient(server.endpoint) as slow, KVFlowClient(server.endpoint) as other:
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
    finally:
        server.request_stop()
        serving.join(20)
        engine.bus.stop(5.0)
