"""A real `kvflow server` process and clients in other processes sharing CPU KV caches.

One server subprocess serves the whole module (short heartbeat timeout, 1 MiB
message limit); clients are this test process and short-lived child processes.
"""

from __future__ import annotations

import glob
import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.errors import (
    AlreadyRegisteredError,
    InvalidRequestError,
    ProtocolError,
    RequestTimeoutError,
    UnknownInstanceError,
)
from kvflow.core.server.protocol import (
    PROTOCOL_VERSION,
    Done,
    EndSession,
    Failed,
    Heartbeat,
    KVCachesDesc,
    Lookup,
    Register,
    Registered,
    Status,
    StatusResult,
    Store,
    TensorDesc,
    Unregister,
    decode_reply,
    encode_request,
)
from kvflow.core.server.sharing import describe_kv_caches
from kvflow.core.server.shm import shared_memory_of
from tests.support import ops

NL, NB, BS, NH, HS = 2, 64, 16, 2, 8  # vllm_flash_attn: NL x [2, NB, BS, NH, HS]
CHUNK = 256
HEARTBEAT_TIMEOUT_S = 2.0


class ServerProcess(ops.ServerProcess):
    """A `kvflow server` with a 0.25 GiB L1 (later flags may say otherwise)."""

    def __init__(self, *flags: str) -> None:
        super().__init__("--l1-size-gb", "0.25", *flags)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess(
        "--disable-observability",
        "--heartbeat-timeout-s",
        str(HEARTBEAT_TIMEOUT_S),
        "--max-message-mb",
        "1",
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.lines)
    assert any("kvflow server stopped" in line for line in srv.lines)


@pytest.fixture
def client(server: ServerProcess) -> Iterator[KVFlowClient]:
    with KVFlowClient(server.endpoint, timeout_s=20) as c:
        yield c


def _kv(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    kv = [empty_shared((2, NB, BS, NH, HS), torch.bfloat16) for _ in range(NL)]
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
    return kv


def _tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(32000), k=n)


def _instance(name: str) -> str:
    return f"{name}-{os.getpid()}-{random.randrange(1 << 30)}"


def test_round_trip_is_bit_exact_into_other_blocks(client: KVFlowClient) -> None:
    """Store from blocks 0..31, look up, retrieve into blocks 32..63: the bytes match."""
    kv = _kv(1)
    iid = _instance("rt")
    client.register_kv_caches(iid, kv, model_name="rt-model")
    tokens = _tokens(2 * CHUNK + 100, seed=1)  # two full chunks and a partial one
    assert client.lookup(tokens, model_name="rt-model") == 0
    assert client.store(iid, tokens, list(range(32)), request_id="r1") == 2 * CHUNK
    assert client.lookup(tokens, model_name="rt-model") == 2 * CHUNK
    dst = list(range(32, 64))
    assert client.retrieve(iid, tokens, dst, request_id="r2") == 2 * CHUNK
    for layer in kv:
        assert torch.equal(layer[:, 32:64], layer[:, 0:32])
    client.end_session("r1")
    client.unregister(iid)
    with pytest.raises(UnknownInstanceError):
        client.store(iid, tokens, list(range(32)), request_id="r3")


def test_ranks_registered_one_after_another_get_workers_of_their_own(
    client: KVFlowClient,
) -> None:
    """Consecutive registrations (the ranks of a TP engine) land on different workers, so
    their transfers run in parallel, even for ids a hash would put on one worker."""
    kv = _kv(2)
    ids = ["rank0", "worker-0"]  # crc32 % 8 == 6 for both
    for iid in ids:
        client.register_kv_caches(iid, kv, model_name="workers")
    try:
        instances = client.status()["server"]["instances"]
        workers = [instances[iid]["worker"] for iid in ids]
        assert workers[0] != workers[1], workers
    finally:
        for iid in ids:
            client.unregister(iid)


def test_retrieve_skips_whole_blocks_and_rejects_unaligned_skips(client: KVFlowClient) -> None:
    """skip_first_n_tokens leaves its blocks untouched; a non-multiple of block_size is refused."""
    kv = _kv(2)
    iid = _instance("skip")
    client.register_kv_caches(iid, kv, model_name="skip-model")
    tokens = _tokens(CHUNK, seed=2)
    client.store(iid, tokens, list(range(16)), request_id="s1")
    before = [layer[:, 16:18].clone() for layer in kv]
    hit = client.retrieve(iid, tokens, list(range(16, 32)), request_id="s2", skip_first_n_tokens=32)
    assert hit == CHUNK
    for layer, old in zip(kv, before, strict=True):
        assert torch.equal(layer[:, 16:18], old)  # the two skipped blocks
        assert torch.equal(layer[:, 18:32], layer[:, 2:16])
    with pytest.raises(InvalidRequestError, match="multiple of the block_size"):
        client.retrieve(iid, tokens, list(range(16)), request_id="s3", skip_first_n_tokens=5)
    client.unregister(iid)


def test_pair_and_single_tensor_layouts_round_trip(client: KVFlowClient) -> None:
    """sglang_mha (K list, V list) and vllm_cross_layer (one tensor) register and copy exactly."""
    k = [empty_shared((NB * BS, NH, HS), torch.float16) for _ in range(NL)]
    v = [empty_shared((NB * BS, NH, HS), torch.float16) for _ in range(NL)]
    for t in k + v:
        t.copy_(torch.randn(t.shape).half())
    cross = empty_shared((NB, NL, 2, BS, NH, HS), torch.float32)
    cross.copy_(torch.randn(cross.shape))
    tokens = _tokens(CHUNK, seed=3)
    for name, kv in (("sgl", (k, v)), ("cross", cross)):
        iid = _instance(name)
        client.register_kv_caches(iid, kv, model_name=f"{name}-model", block_size=BS)
        assert client.store(iid, tokens, list(range(16)), request_id=name) == CHUNK
        assert client.retrieve(iid, tokens, list(range(40, 56)), request_id=name) == CHUNK
        client.unregister(iid)
    for t in k + v:
        assert torch.equal(t[40 * BS : 56 * BS], t[0 : 16 * BS])
    assert torch.equal(cross[40:56], cross[0:16])


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from kvflow.core import KVFlowClient, empty_shared
    endpoint, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    client = KVFlowClient(endpoint, timeout_s=30)
    gen = torch.Generator().manual_seed(rank)
    kv = [empty_shared((2, 64, 16, 2, 8), torch.float16) for _ in range(2)]
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=gen).half())
    iid = f"tp-{mode}-rank{rank}"
    client.register_kv_caches(iid, kv, model_name="tp-" + mode, world_size=2, rank=rank)
    if mode == "hang":
        print("registered", flush=True)
        sys.stdin.read()
    tokens = list(range(1000, 1512))
    n = client.store(iid, tokens, list(range(32)), request_id=f"req{rank}")
    if rank == 0:
        client.store(iid, list(range(5000, 5256)), list(range(16)), request_id="only0")
    got = client.retrieve(iid, tokens, list(range(32, 64)), request_id=f"back{rank}")
    same = all(torch.equal(t[:, 32:64], t[:, 0:32]) for t in kv)
    client.unregister(iid)
    client.close()
    print("ok", n, got, same, flush=True)
    """
)


def _child(endpoint: str, rank: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, endpoint, str(rank), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_client_processes_share_a_world(server: ServerProcess, client: KVFlowClient) -> None:
    """Two engine processes (ranks 0 and 1 of world 2) store at once; a hit needs both ranks."""
    children = [_child(server.endpoint, rank, "tp") for rank in (0, 1)]
    outputs = [child.communicate(timeout=120) for child in children]
    for child, (out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
        assert out.split() == ["ok", "512", "512", "True"], out + err
    assert client.lookup(list(range(1000, 1512)), model_name="tp-tp", world_size=2) == 512
    # only rank 0 stored this prefix: not a hit for the world of two
    assert client.lookup(list(range(5000, 5256)), model_name="tp-tp", world_size=2) == 0
    assert client.lookup(list(range(5000, 5256)), model_name="tp-tp", world_size=1) == 0


def test_a_killed_client_is_reaped(server: ServerProcess, client: KVFlowClient) -> None:
    """A client process killed mid-session loses its instances after the heartbeat timeout."""
    child = _child(server.endpoint, 0, "hang")
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "registered"
        status = client.status()["server"]
        assert "tp-hang-rank0" in status["instances"]
        reaped_before = status["reaped_instances"]
        # well past the timeout: only the child's heartbeat thread keeps it alive (it makes
        # no other call); a shorter wait would pass with the heartbeat loop gone
        time.sleep(HEARTBEAT_TIMEOUT_S * 2.5)
        status = client.status()["server"]
        assert "tp-hang-rank0" in status["instances"], (
            "a live, idle client was reaped: its heartbeats did not reach the server"
        )
        assert status["reaped_instances"] == reaped_before
        child.kill()
        child.wait(10)
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S * 4

        # the server forgets the registration, then its worker unregisters the instance
        # from the engine (after the instance's queued work): wait for both
        def held(status: dict[str, Any]) -> bool:
            return "tp-hang-rank0" in status["server"]["instances"] or (
                "tp-hang-rank0" in status["instances"]
            )

        while held(status := client.status()):
            assert time.monotonic() < deadline, "instance was not reaped"
            time.sleep(0.1)
        reaping = re.compile(
            rf"[ :]reaping instance 'tp-hang-rank0': client [0-9a-f]{{32}} silent for over"
            rf" {HEARTBEAT_TIMEOUT_S:.1f} s \[kvflow\.server\]$"
        )
        assert any(reaping.search(line.rstrip()) for line in server.lines), server.log()[-2000:]
        assert status["server"]["reaped_instances"] == reaped_before + 1
        with pytest.raises(UnknownInstanceError, match="reaped"):
            client.store("tp-hang-rank0", list(range(CHUNK)), list(range(16)), request_id="x")
        # registered again, then unregistered: no longer "reaped", just not registered
        client.register_kv_caches("tp-hang-rank0", _kv(9), model_name="tp-again")
        client.unregister("tp-hang-rank0")
        with pytest.raises(
            UnknownInstanceError, match=r"^instance 'tp-hang-rank0' is not registered$"
        ):
            client.store("tp-hang-rank0", list(range(CHUNK)), list(range(16)), request_id="y")
    finally:
        child.kill()
        child.wait(10)
        for path in glob.glob(f"/dev/shm/kvflow-{child.pid}-*"):
            os.unlink(path)  # SIGKILL left them: nobody else will


def test_unregister_waits_for_the_transfers_queued_before_it(
    raw: zmq.Socket[bytes], client: KVFlowClient
) -> None:
    """Stores pipelined on one socket, then an Unregister: every store completes (the
    instance is released on its worker after them), then the unregister is done."""
    kv = _kv(5)
    iid = _instance("retire")
    client.register_kv_caches(iid, kv, model_name="retire-model")
    n, owner = 8, client.client_id
    blocks = np.arange(4 * CHUNK // BS, dtype=np.int32)  # all 64 blocks: four chunks
    for i in range(n):  # back to back: the server reads them all before the stores finish
        tokens = np.asarray(_tokens(4 * CHUNK, seed=100 + i), dtype=np.int32)
        store = Store(instance_id=iid, request_id=f"retire-{i}", id=i + 1, client=owner)
        raw.send_multipart(encode_request(store, (tokens, blocks)))
    raw.send_multipart(encode_request(Unregister(instance_id=iid, id=n + 1, client=owner)))
    replies: dict[int, Done | Failed] = {}
    for _ in range(n + 1):
        reply = _reply(raw, 60)
        assert isinstance(reply, Done | Failed)
        replies[reply.id] = reply
    assert sorted(replies) == list(range(1, n + 2))
    for i in range(1, n + 1):  # a store failing "unknown instance" ran after the unregister
        done = replies[i]
        assert isinstance(done, Done) and done.value == 4 * CHUNK, done
    assert isinstance(replies[n + 1], Done), replies[n + 1]
    assert iid not in client.status()["server"]["instances"]
    last = _tokens(4 * CHUNK, seed=100 + n - 1)
    assert client.lookup(last, model_name="retire-model") == 4 * CHUNK


# -- hostile input ----------------------------------------------------------------------------


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    yield sock
    sock.close()
    ctx.term()


def _reply(sock: zmq.Socket[bytes], timeout_s: float = 10) -> object:
    assert sock.poll(int(timeout_s * 1000)), "no reply"
    return decode_reply(sock.recv())


def test_malformed_frames_get_protocol_error_replies(raw: zmq.Socket[bytes]) -> None:
    """Garbage, unknown ops, wrong payload counts and versions each get one error reply;
    eight frames (the most a message may have) are read, nine are refused unread."""
    status = msgspec.msgpack.encode({"op": "status", "v": PROTOCOL_VERSION, "id": 4})
    for frames, match in (
        ([status] + [b"xx"] * 7, "payload"),
        ([status] + [b"xx"] * 8, "frames"),
        ([b"\xc1\xc1"], "malformed"),
        ([msgspec.msgpack.encode({"op": "teleport", "v": PROTOCOL_VERSION, "id": 9})], "malformed"),
        ([msgspec.msgpack.encode({"op": "status", "v": PROTOCOL_VERSION}), b"xx"], "payload"),
        ([msgspec.msgpack.encode({"op": "status", "v": PROTOCOL_VERSION + 7, "id": 3})], "version"),
        ([b""] * 20, "frames"),
    ):
        raw.send_multipart(frames)
        reply = _reply(raw)
        assert isinstance(reply, Failed) and reply.code == ProtocolError.code
        assert match in reply.message


def test_fuzzed_messages_never_stop_the_server(
    raw: zmq.Socket[bytes], client: KVFlowClient
) -> None:
    """Hundreds of random multipart messages each get an error reply; the server keeps serving."""
    rng = random.Random(7)
    n = 300
    for _ in range(n):
        frames = [rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(1, 4))]
        raw.send_multipart(frames)
    replies = [_reply(raw) for _ in range(n)]
    assert all(isinstance(r, Failed) and r.code == ProtocolError.code for r in replies)
    assert client.status()["server"]["errors"] >= n


def test_a_registration_tells_the_client_to_beat_four_times_per_timeout(
    raw: zmq.Socket[bytes], client: KVFlowClient
) -> None:
    """The reply's heartbeat interval is a quarter of --heartbeat-timeout-s: a client
    whose beat or two is lost (a slow network, a busy host) is still not reaped."""
    iid, kv = _instance("beat"), _kv(5)  # kv: alive until the server has mapped it
    request = Register(instance_id=iid, kv_caches=describe_kv_caches(kv), model_name="m")
    raw.send_multipart(encode_request(request))
    reply = _reply(raw)
    assert isinstance(reply, Registered), reply
    assert reply.heartbeat_interval_s == HEARTBEAT_TIMEOUT_S / 4
    raw.send_multipart(encode_request(Unregister(instance_id=iid)))
    assert isinstance(_reply(raw), Done)


def test_the_loop_s_own_answers_carry_their_id_and_handling_time(raw: zmq.Socket[bytes]) -> None:
    """A beat gets `Done` (an error reply would make every client's beat fail), a status
    its `StatusResult`, an end of session `Done`: each with its request's id and the
    server's handling time in nanoseconds."""
    for request, reply_type in (
        (Heartbeat(id=41), Done),
        (Status(id=42), StatusResult),
        (EndSession(request_id="gone", id=43), Done),
    ):
        raw.send_multipart(encode_request(request))
        reply = _reply(raw)
        assert isinstance(reply, reply_type) and reply.id == request.id, reply
        assert isinstance(reply.server_ns, int) and reply.server_ns > 0, reply


def test_register_descriptions_outside_their_memory_are_refused(
    raw: zmq.Socket[bytes], client: KVFlowClient
) -> None:
    """A hostile description (too large, wrong dtype, foreign segment) gets invalid_argument."""
    seg = empty_shared((1024,), torch.float16)
    mem = shared_memory_of(seg)
    assert mem is not None
    bad = [
        TensorDesc("float16", (2, 64, 16, 2, 8), (32768, 512, 16, 8, 1), mem),  # past the end
        TensorDesc("float64", (16,), (1,), mem),
        TensorDesc("float16", (16,), (1,), msgspec.structs.replace(mem, name="../../etc/passwd")),
    ]
    for tdesc in bad:
        request = Register(
            instance_id=_instance("hostile"),
            kv_caches=KVCachesDesc(kind="list", tensors=[tdesc]),
            model_name="hostile",
        )
        raw.send_multipart(encode_request(request))
        reply = _reply(raw)
        assert isinstance(reply, Failed) and reply.code == InvalidRequestError.code, reply
    assert not any(i.startswith("hostile") for i in client.status()["server"]["instances"])


def test_bad_arguments_get_clear_errors_and_nothing_half_written(client: KVFlowClient) -> None:
    """Unknown instance, out-of-range blocks, mismatched K/V shapes: errors; no partial store."""
    kv = _kv(4)
    iid = _instance("bad")
    client.register_kv_caches(iid, kv, model_name="bad-model")
    client.register_kv_caches(iid, kv, model_name="bad-model")  # its own: replaced
    with (
        KVFlowClient(client.endpoint, timeout_s=20) as other,
        pytest.raises(AlreadyRegisteredError, match="takeover=True"),
    ):
        other.register_kv_caches(iid, kv, model_name="bad-model")
    tokens = _tokens(2 * CHUNK, seed=4)
    with pytest.raises(UnknownInstanceError, match="nope"):
        client.store("nope", tokens, list(range(32)), request_id="x")
    blocks = [*range(16), NB + 5, *range(17, 32)]  # chunk 1 has a bad block
    with pytest.raises(InvalidRequestError, match="out of range"):
        client.store(iid, tokens, blocks, request_id="x")
    with pytest.raises(InvalidRequestError, match="out of range"):
        client.store(iid, tokens, [-1, *range(1, 32)], request_id="x")
    assert client.lookup(tokens, model_name="bad-model") == 0  # nothing half-written is visible
    k = [empty_shared((NB * BS, NH, HS), torch.float16)]
    v = [empty_shared((NB * BS, NH, HS * 2), torch.float16)]
    with pytest.raises(InvalidRequestError):
        client.register_kv_caches(_instance("kv-mismatch"), (k, v), model_name="m")
    with pytest.raises(InvalidRequestError, match="world_size"):
        client.lookup(tokens, model_name="bad-model", world_size=0)
    client.unregister(iid)


def test_oversized_messages(server: ServerProcess, client: KVFlowClient) -> None:
    """Over the limit: an error reply; over twice the limit: dropped, and the server goes on."""
    with pytest.raises(
        ProtocolError,
        match=r"^message of \d+ bytes exceeds the server's limit of 1048576 bytes \(--max-message-mb\)$",
    ):
        client.lookup(np.zeros(300_000, dtype=np.int32), model_name="big")  # 1.2 MB > 1 MiB
    with (
        KVFlowClient(server.endpoint, timeout_s=1.5) as short,
        pytest.raises(RequestTimeoutError, match="no reply"),
    ):
        short.lookup(np.zeros(600_000, dtype=np.int32), model_name="big")  # 2.4 MB
    assert client.lookup([1, 2, 3], model_name="big") == 0


def test_a_message_of_exactly_the_limit_is_served(server: ServerProcess) -> None:
    """The limit is the largest message served: a lookup of exactly 1 MiB is answered."""
    for pad in range(4):  # a model name that brings the header to a whole number of tokens
        request = Lookup(id=5, model_name="big" + "x" * pad)
        header = len(encode_request(request, (np.zeros(0, dtype=np.int32),))[0])
        if (1048576 - header) % 4 == 0:
            break
    token_ids = np.zeros((1048576 - header) // 4, dtype=np.int32)
    assert len(encode_request(request, (token_ids,))[0]) + token_ids.nbytes == 1048576
    reply = ops.raw_reply(server.endpoint, request, (token_ids,))
    assert isinstance(reply, Done) and reply.id == 5 and reply.value == 0, reply


def test_client_threads_share_one_client(client: KVFlowClient) -> None:
    """Several threads call one client at once; each gets its own answers."""
    kv = _kv(5)
    iid = _instance("threads")
    client.register_kv_caches(iid, kv, model_name="thr-model")
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            tokens = _tokens(CHUNK, seed=100 + i)
            for _ in range(5):
                assert client.lookup([i], model_name="thr-model") == 0
            assert (
                client.store(iid, tokens, list(range(i * 16, i * 16 + 16)), request_id=f"t{i}")
                == CHUNK
            )
            assert client.lookup(tokens, model_name="thr-model") == CHUNK
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    client.unregister(iid)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time the process `pid` has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_sleeps_between_its_ticks(server: ServerProcess) -> None:
    """With nothing to serve the main loop waits in its poll (reaping every 0.1 s), so
    the process uses a few percent of a core at most, not a spinning loop's whole one."""
    time.sleep(0.5)  # the module's earlier requests are answered
    before = _cpu_seconds(server.proc.pid)
    time.sleep(2.0)
    assert _cpu_seconds(server.proc.pid) - before < 0.3


def test_status_command_prints_the_running_servers_status(server: ServerProcess) -> None:
    """`kvflow status --endpoint` prints the server's status as JSON; a dead endpoint exits 1."""
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "status", "--endpoint", server.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    status = msgspec.json.decode(done.stdout)
    assert status["server"]["endpoint"] == server.endpoint
    assert status["server"]["protocol_version"] == PROTOCOL_VERSION
    assert "l1" in status


def test_no_server_is_a_timeout_naming_the_endpoint() -> None:
    """Calling a server that is not there fails after timeout_s, naming the endpoint."""
    with (
        KVFlowClient("tcp://127.0.0.1:9", timeout_s=0.3) as c,
        pytest.raises(RequestTimeoutError, match=r"127\.0\.0\.1:9\b"),
    ):
        c.status()


def test_a_lookup_over_the_wire_counts_the_ranks_it_names(client: KVFlowClient) -> None:
    """A server holding rank 1 of a world of two (its rank 0 served elsewhere) answers a
    lookup for rank 1 alone; a bad rank list is an error reply naming it, and the
    server keeps serving."""
    kv = _kv(3)
    iid, model = _instance("r1"), _instance("model")
    client.register_kv_caches(iid, kv, model_name=model, world_size=2, rank=1)
    tokens = _tokens(2 * CHUNK, 3)
    assert client.store(iid, tokens, list(range(2 * CHUNK // BS)), request_id="r1") == 2 * CHUNK
    assert client.lookup(tokens, model_name=model, world_size=2) == 0
    assert client.lookup(tokens, model_name=model, world_size=2, ranks=[1]) == 2 * CHUNK
    assert client.lookup(tokens, model_name=model, world_size=2, ranks=(0,)) == 0
    with pytest.raises(InvalidRequestError, match=r"ranks must be .* in \[0, 2\)"):
        client.lookup(tokens, model_name=model, world_size=2, ranks=[2])
    assert client.lookup(tokens, model_name=model, world_size=2, ranks=[1]) == 2 * CHUNK
    client.unregister(iid)
