"""A server whose L1 grows ahead of demand: a registration of CUDA caches waits for the
segment being made (opening the client's CUDA memory would queue behind the pinning in
the driver); one of shared memory makes no CUDA call and goes ahead at once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvflow.core import KVFlowClient
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.server.protocol import (
    CudaIpcMemory,
    Failed,
    KVCachesDesc,
    Register,
    TensorDesc,
    decode_reply,
    encode_request,
)
from kvflow.core.server.server import KVFlowServer
from tests.support.ops import raw_reply, serving, shared_kv
from tests.support.segment_gate import SegmentGate


@pytest.fixture
def growing(gate: SegmentGate) -> Iterator[KVFlowServer]:
    """A serving server whose L1 (three 256-MiB segments, one pin thread) is making its
    first segment, held there until the test releases it."""
    config = ServerConfig(
        port=0,
        l1_size_gb=0.75,
        l1_prefault=True,
        l1_pin_threads=1,
        observability=ObservabilityConfig(enabled=False),
    )
    with serving(KVFlowServer(config)) as srv:
        try:
            assert gate.making.wait(10), "L1 did not start growing ahead"
            yield srv
        finally:
            gate.permits.release(100)  # the server's stop waits for L1's pinning


def test_a_shared_memory_registration_does_not_wait_for_the_pinning(
    growing: KVFlowServer, gate: SegmentGate
) -> None:
    """Caches in shared memory are registered (and served) while a segment is being made."""
    with KVFlowClient(growing.endpoint, timeout_s=5) as client:
        client.register_kv_caches("shm", shared_kv(1), model_name="m")
        assert client.status()["instances"]
    assert gate.started == 1  # still the first segment: nothing was released


def _cuda_register() -> Register:
    """A registration of one GPU tensor (a made-up IPC handle: a CPU box cannot open it)."""
    memory = CudaIpcMemory(
        handle=bytes(64), offset=0, alloc_size=4096, device_uuid="GPU-0", device_index=0
    )
    tensor = TensorDesc(
        dtype="bfloat16", shape=(2, 4, 16, 2, 8), strides=(1024, 256, 16, 8, 1), memory=memory
    )
    kv = KVCachesDesc(kind="list", tensors=[tensor])
    return Register(id=41, client="gpu-client", instance_id="gpu", kv_caches=kv, model_name="m")


def test_a_cuda_registration_waits_for_the_segment_being_made(
    growing: KVFlowServer, gate: SegmentGate
) -> None:
    """The server opens a client's CUDA memory only between segments: held while one is
    being made, the registration goes on once it is done (here to fail: no GPU to open
    the handle on, or a handle that opens nothing)."""
    ctx: zmq.Context[zmq.Socket[Any]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(growing.endpoint)
    try:
        sock.send_multipart(encode_request(_cuda_register()))
        assert not sock.poll(500), "a CUDA registration went ahead beside a segment being made"
        gate.permits.release()
        assert sock.poll(10_000), "the registration was not answered once the segment was done"
        reply = decode_reply(sock.recv())
        assert isinstance(reply, Failed) and reply.id == 41, reply
        assert "GPU-0" in reply.message
    finally:
        sock.close()
        ctx.term()


def test_a_cuda_registration_goes_ahead_when_l1_grows_on_demand() -> None:
    """With no pinning ahead (L1 grows as stores need it) there is nothing to wait for:
    the registration goes straight on (here to the error of a handle no GPU opens)."""
    config = ServerConfig(port=0, l1_size_gb=0.05, observability=ObservabilityConfig(enabled=False))
    srv = KVFlowServer(config)
    assert srv.engine.status()["l1_pinning"] is None  # grows on demand
    with serving(srv):
        reply = raw_reply(srv.endpoint, _cuda_register())
    assert isinstance(reply, Failed) and reply.id == 41, reply
    assert "GPU-0" in reply.message
