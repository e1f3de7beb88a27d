"""Hardening against hostile and careless clients (issue 18; ../shared/SPEC.md section 10).

Each test runs a real `kvflow server` process: ownership and takeover of
instances, --max-instances with a fixed worker pool (threads and fds do not grow
with registrations), shared-memory mappings released at unregister and reap,
invalid UTF-8 in a header, and the "server stopped" line with event logs on.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.errors import (
    ERRORS_BY_CODE,
    AlreadyRegisteredError,
    CapacityError,
    PermissionDeniedError,
    ProtocolError,
    UnknownInstanceError,
)
from kvflow.core.server.protocol import PROTOCOL_VERSION, Failed, decode_reply
from kvflow.events import BlockAllocation
from tests.core.server.test_server import ServerProcess

NB, BS, NH, HS = 16, 16, 2, 8
CHUNK = 256
HEARTBEAT_TIMEOUT_S = 1.5
MAX_INSTANCES = 24


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        "--disable-observability",
        "--heartbeat-timeout-s",
        str(HEARTBEAT_TIMEOUT_S),
        "--max-instances",
        str(MAX_INSTANCES),
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.lines)


def _client(server: ServerProcess, client_id: str | None = None) -> KVFlowClient:
    return KVFlowClient(server.endpoint, timeout_s=20, client_id=client_id)


def _kv() -> list[torch.Tensor]:
    kv = [empty_shared((2, NB, BS, NH, HS), torch.float16)]
    kv[0].copy_(torch.randn(kv[0].shape).half())
    return kv


def _iid(name: str) -> str:
    return f"{name}-{os.getpid()}-{random.randrange(1 << 30)}"


def _shm_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum("/dev/shm/kvflow-" in line for line in maps)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _wait(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# -- item 10: ownership and takeover ----------------------------------------------------------


def test_permission_denied_is_a_known_code() -> None:
    assert ERRORS_BY_CODE["permission_denied"] is PermissionDeniedError


def test_other_clients_cannot_touch_an_instance(server: ServerProcess) -> None:
    """Store, retrieve, report and unregister from another client: permission_denied."""
    kv = _kv()
    iid = _iid("owned")
    tokens = list(range(CHUNK))
    with _client(server) as owner, _client(server) as intruder:
        owner.register_kv_caches(iid, kv, model_name="own")
        assert owner.store(iid, tokens, list(range(16)), request_id="a") == CHUNK
        with pytest.raises(PermissionDeniedError, match="belongs to another client"):
            intruder.store(iid, tokens, list(range(16)), request_id="b")
        before = kv[0].clone()
        with pytest.raises(PermissionDeniedError):
            intruder.retrieve(iid, tokens, list(range(16)), request_id="c")
        assert torch.equal(kv[0], before)  # nothing overwritten
        with pytest.raises(PermissionDeniedError):
            intruder.report_block_allocations(iid, [BlockAllocation("r", [1], [2])])
        with pytest.raises(PermissionDeniedError):
            intruder.unregister(iid)
        assert iid in owner.status()["server"]["instances"]
        # lookup needs no instance
        assert intruder.lookup(tokens, model_name="own") == CHUNK
        assert owner.retrieve(iid, tokens, list(range(16)), request_id="d") == CHUNK
        owner.report_block_allocations(iid, [BlockAllocation("r", [1], [2])])
        owner.unregister(iid)


def test_registered_by_another_client_says_reaping_and_takeover(server: ServerProcess) -> None:
    """A held id is refused with a hint; takeover=True takes it; the old owner is then denied."""
    kv = _kv()
    iid = _iid("held")
    with _client(server) as first, _client(server) as second:
        first.register_kv_caches(iid, kv, model_name="held")
        with pytest.raises(AlreadyRegisteredError, match="--heartbeat-timeout-s") as info:
            second.register_kv_caches(iid, kv, model_name="held")
        assert "takeover=True" in str(info.value)
        second.register_kv_caches(iid, kv, model_name="held", takeover=True)
        assert first.status()["server"]["instances"][iid]["client"] == second.client_id
        with pytest.raises(PermissionDeniedError):
            first.store(iid, list(range(CHUNK)), list(range(16)), request_id="x")
        assert second.store(iid, list(range(CHUNK)), list(range(16)), request_id="y") == CHUNK
        second.unregister(iid)


def test_a_restarted_client_with_the_same_id_re_registers_at_once(server: ServerProcess) -> None:
    """Same client identity: the old registration is released and replaced, no wait."""
    kv = _kv()
    iid = _iid("restart")
    client_id = f"engine-{iid}"
    crashed = _client(server, client_id)
    crashed.register_kv_caches(iid, kv, model_name="restart")
    crashed.close()  # as if the process died: no unregister
    with _client(server, client_id) as again:
        maps = _shm_maps(server.proc.pid)
        again.register_kv_caches(iid, kv, model_name="restart")
        assert _shm_maps(server.proc.pid) == maps  # the old mapping was released
        assert list(again.status()["server"]["instances"]).count(iid) == 1
        assert again.store(iid, list(range(CHUNK)), list(range(16)), request_id="z") == CHUNK
        again.unregister(iid)


# -- item 1: --max-instances and a fixed worker pool -------------------------------------------


def test_max_instances_refused_and_threads_fds_bounded(server: ServerProcess) -> None:
    """Registrations up to --max-instances add no threads or fds; one more is refused."""
    pid = server.proc.pid
    kv = _kv()
    with _client(server) as client:
        assert client.status()["server"]["max_instances"] == MAX_INSTANCES
        threads, fds = _threads(pid), _fds(pid)
        held = len(client.status()["server"]["instances"])
        ids = [_iid(f"flood{i}") for i in range(MAX_INSTANCES - held)]
        for iid in ids:
            client.register_kv_caches(iid, kv, model_name="flood")
        assert _threads(pid) <= threads
        assert _fds(pid) <= fds + 4  # no socket or thread per instance
        with pytest.raises(CapacityError, match="--max-instances"):
            client.register_kv_caches(_iid("one-too-many"), kv, model_name="flood")
        for iid in ids:  # every "registered" instance is really served
            assert client.store(iid, list(range(CHUNK)), list(range(16)), request_id=iid) == CHUNK
        for iid in ids:
            client.unregister(iid)
        client.register_kv_caches(ids[0], kv, model_name="flood")  # room again
        client.unregister(ids[0])


# -- item 6: shared memory released at unregister and reap ------------------------------------


def test_unregister_and_reap_unmap_shared_memory(server: ServerProcess) -> None:
    """/dev/shm mappings of the server drop as soon as an instance is unregistered or reaped."""
    pid = server.proc.pid
    before = _shm_maps(pid)
    kv = [empty_shared((2, NB, BS, NH, HS), torch.float16) for _ in range(3)]
    with _client(server) as client:
        iid = _iid("unmap")
        client.register_kv_caches(iid, kv, model_name="unmap")
        assert _shm_maps(pid) == before + 3
        client.store(iid, list(range(CHUNK)), list(range(16)), request_id="u")
        client.unregister(iid)
        assert _shm_maps(pid) == before
    silent = _client(server)
    iid = _iid("reaped")
    silent.register_kv_caches(iid, kv, model_name="unmap")
    assert _shm_maps(pid) == before + 3
    silent.close()  # stops heartbeating: the server reaps it
    with _client(server) as watcher:
        _wait(
            lambda: iid not in watcher.status()["server"]["instances"],
            HEARTBEAT_TIMEOUT_S * 5,
            "not reaped",
        )
        _wait(lambda: _shm_maps(pid) == before, 5, "reaped instance still mapped")
        with pytest.raises(UnknownInstanceError, match="reaped"):
            watcher.unregister(iid)


# -- item 4: invalid UTF-8 -----------------------------------------------------------------------


def test_invalid_utf8_in_a_header_is_a_protocol_error(server: ServerProcess) -> None:
    """A string field with invalid UTF-8 gets a protocol error, not internal, no error log."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    try:
        for field, op in (("client", "status"), ("prefetch_id", "prefetch_state")):
            header = {"op": op, "v": PROTOCOL_VERSION, "id": 41, field: "\x00MARK"}
            if field != "client":
                header["client"] = "c"
            frame = msgspec.msgpack.encode(header).replace(b"\x00MARK", b"\xffMARK")
            sock.send_multipart([frame])
            assert sock.poll(10_000), "no reply"
            reply = decode_reply(sock.recv())
            assert isinstance(reply, Failed), reply
            assert reply.code == ProtocolError.code, reply
            assert reply.id == 41
    finally:
        sock.close()
        ctx.term()
    assert not any("UnicodeDecodeError" in line for line in server.lines)
    assert not any("internal error" in line for line in server.lines)


# -- item 8: the stopped line --------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ("--prometheus-port", "0"),  # event logs on: the engine's pipeline owns the handler
        ("--disable-logging", "--prometheus-port", "0"),
        ("--disable-observability",),
    ],
)
def test_stopped_line_is_logged_whatever_the_logging_flags(flags: tuple[str, ...]) -> None:
    srv = ServerProcess(*flags)
    assert srv.stop() == 0, "".join(srv.lines)
    _wait(
        lambda: any("kvflow server stopped" in line for line in srv.lines),
        5,
        "no stopped line:\n" + "".join(srv.lines),
    )
