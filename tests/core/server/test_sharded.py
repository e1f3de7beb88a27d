"""A sharded server (`kvflow server --shards 2`): one endpoint, rank r's KV on shard
process r % 2, every request routed or fanned out by the front (docs/SERVER.md, Shards).

A real subprocess server and real clients (one per rank, as a tensor-parallel engine's
workers hold them); CPU caches in shared memory.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvflow.core import KVFlowClient
from kvflow.core.errors import (
    InvalidRequestError,
    KVFlowError,
    PermissionDeniedError,
    RequestTimeoutError,
    UnknownInstanceError,
    UnknownSubscriptionError,
)
from kvflow.core.observe.snapshot import Snapshot
from kvflow.core.server.client import reachable_ipc
from kvflow.core.server.protocol import AdminClear, AdminQuota
from kvflow.core.server.shards import shard_resource
from tests.support import ops
from tests.support.collectors import OTLPReceiver, free_port

WORLD = 2
CHUNK = ops.CHUNK


def _server(*flags: str) -> ops.ServerProcess:
    return ops.ServerProcess("--shards", "2", "--l1-size-gb", "0.25", *flags)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded-disk")


@pytest.fixture(scope="module")
def server(disk: Path) -> Iterator[ops.ServerProcess]:
    srv = _server("--l2-disk", str(disk), "--l2-disk-size-gb", "0.5")
    yield srv
    assert srv.stop() == 0, srv.log()
    assert srv.log().count("kvflow server stopped (event pipeline clean)") == 2, srv.log()


@pytest.fixture
def ranks(server: ops.ServerProcess) -> Iterator[list[KVFlowClient]]:
    """One client per rank, as the workers of a tensor-parallel engine hold them."""
    clients = [KVFlowClient(server.endpoint, timeout_s=20) for _ in range(WORLD)]
    yield clients
    for c in clients:
        c.close()


def _model(name: str) -> str:
    return f"{name}-{os.getpid()}-{random.randrange(1 << 30)}"


def _register(
    clients: list[KVFlowClient], model: str
) -> tuple[list[str], list[list[torch.Tensor]]]:
    iids, caches = [], []
    for rank, client in enumerate(clients):
        kv = ops.shared_kv(rank + 1)
        iid = f"{model}-rank{rank}"
        client.register_kv_caches(iid, kv, model_name=model, world_size=WORLD, rank=rank)
        iids.append(iid)
        caches.append(kv)
    return iids, caches


def _l2_written(client: KVFlowClient) -> None:
    """Wait until every shard's L2 writes are done."""
    deadline = time.monotonic() + 20
    while any(s["l2"]["in_flight"]["write_through"]["calls"] for s in client.status()["shards"]):
        assert time.monotonic() < deadline, "L2 writes did not finish"
        time.sleep(0.05)


def _shard_instances(client: KVFlowClient) -> list[set[str]]:
    return [set(s["server"]["instances"]) for s in client.status()["shards"]]


def test_a_prefix_is_a_hit_once_every_rank_s_shard_holds_it(ranks: list[KVFlowClient]) -> None:
    """Rank r registers on shard r; a lookup counts every rank (the least of the shards'
    answers), a lookup of ranks=[0] asks shard 0 alone; both ranks retrieve bit-exact."""
    model = _model("hit")
    iids, caches = _register(ranks, model)
    shards = _shard_instances(ranks[0])
    assert iids[0] in shards[0] and iids[0] not in shards[1]
    assert iids[1] in shards[1] and iids[1] not in shards[0]
    tokens = ops.tokens(2 * CHUNK + 10, seed=3)
    before = ranks[0].status()["server"]["requests"]
    ranks[0].store(iids[0], tokens, list(range(32)), request_id="s0")
    after = ranks[0].status()["server"]["requests"]
    assert after == before + 1, "the store went to its shard directly, not through the front"
    assert ranks[0].lookup(tokens, model_name=model, world_size=WORLD) == 0, "rank 1 lacks it"
    assert ranks[0].lookup(tokens, model_name=model, world_size=WORLD, ranks=[0]) == 2 * CHUNK
    assert ranks[0].lookup(tokens, model_name=model, world_size=WORLD, ranks=[1]) == 0
    ranks[1].store(iids[1], tokens, list(range(32)), request_id="s1")
    assert ranks[0].lookup(tokens, model_name=model, world_size=WORLD) == 2 * CHUNK
    for rank, client in enumerate(ranks):
        got = client.retrieve(iids[rank], tokens, list(range(32, 64)), request_id=f"r{rank}")
        assert got == 2 * CHUNK
        assert ops.blocks_equal(caches[rank], range(32), range(32, 64))
    ranks[0].end_session("s0")
    for rank, client in enumerate(ranks):
        client.unregister(iids[rank])
        with pytest.raises(UnknownInstanceError):
            client.store(iids[rank], tokens, list(range(32)), request_id="gone")


def test_an_instance_registered_again_as_another_rank_moves_shard(
    ranks: list[KVFlowClient],
) -> None:
    """Re-registering an instance id as rank 1 leaves shard 0 (as a one-process server
    replaces the old registration) and serves it on shard 1."""
    client, model = ranks[0], _model("move")
    iid = f"{model}-moving"
    client.register_kv_caches(iid, ops.shared_kv(5), model_name=model, world_size=WORLD, rank=0)
    assert [iid in s for s in _shard_instances(client)] == [True, False]
    kv = ops.shared_kv(6)
    client.register_kv_caches(iid, kv, model_name=model, world_size=WORLD, rank=1)
    assert [iid in s for s in _shard_instances(client)] == [False, True]
    tokens = ops.tokens(CHUNK, seed=6)
    assert client.store(iid, tokens, list(range(16)), request_id="m") == CHUNK
    assert client.lookup(tokens, model_name=model, world_size=WORLD, ranks=[1]) == CHUNK
    client.unregister(iid)


def test_bad_ranks_are_refused_with_the_reason(ranks: list[KVFlowClient]) -> None:
    tokens = ops.tokens(CHUNK, seed=7)
    with pytest.raises(InvalidRequestError, match="rank"):
        ranks[0].lookup(tokens, model_name="m", world_size=WORLD, ranks=[2])
    with pytest.raises(InvalidRequestError, match="rank"):
        ranks[0].lookup(tokens, model_name="m", world_size=WORLD, ranks=[])
    with pytest.raises(KVFlowError, match="prefetch"):
        ranks[0].prefetch_state("0/nothing,1/nothing")
    with pytest.raises(KVFlowError, match="prefetch"):
        ranks[0].prefetch_state("not a sharded id")


def test_a_prefetch_loads_every_shard_s_ranks_back(ranks: list[KVFlowClient]) -> None:
    """With L1 cleared, a prefetch starts on both shards under one id; its state adds
    their chunks up and is done once both are."""
    model = _model("prefetch")
    iids, _ = _register(ranks, model)
    tokens = ops.tokens(2 * CHUNK, seed=8)
    for rank, client in enumerate(ranks):
        client.store(iids[rank], tokens, list(range(32)), request_id=f"p{rank}")
    _l2_written(ranks[0])
    deadline = time.monotonic() + 20
    cleared = ranks[0].admin(AdminClear(model_name=model, tiers=["l1"]))
    assert len(cleared["shards"]) == 2
    pid = ranks[0].prefetch(tokens, model_name=model, world_size=WORLD)
    assert sorted(part.split("/")[0] for part in pid.split(",")) == ["0", "1"]
    state = ranks[0].prefetch_state(pid)
    while state["state"] != "done":
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
        state = ranks[0].prefetch_state(pid)
    assert state["prefetch_id"] == pid
    assert state["chunks"] == 2 * WORLD and state["landed_tokens"] == 2 * CHUNK
    assert ranks[1].lookup(tokens, model_name=model, world_size=WORLD, prefetch=False) == 2 * CHUNK
    for rank, client in enumerate(ranks):
        client.unregister(iids[rank])


def test_admin_operations_reach_every_shard(ranks: list[KVFlowClient]) -> None:
    """A clear empties both shards; a tenant quota is split between them like L1."""
    model = _model("admin")
    iids, _ = _register(ranks, model)
    tokens = ops.tokens(CHUNK, seed=9)
    for rank, client in enumerate(ranks):
        client.store(iids[rank], tokens, list(range(16)), request_id=f"a{rank}")
    assert ranks[0].lookup(tokens, model_name=model, world_size=WORLD) == CHUNK
    _l2_written(ranks[0])  # a write landing after the clear would bring the chunk back
    ranks[0].admin(AdminClear(model_name=model))
    for rank in range(WORLD):
        assert ranks[0].lookup(tokens, model_name=model, world_size=WORLD, ranks=[rank]) == 0
    ranks[0].admin(AdminQuota(kind="model", name=model, limit_gb=0.5))
    for shard in ranks[0].status()["shards"]:
        (row,) = [t for t in shard["server"]["tenants"] if t["tenant"] == model]
        assert row["limit_bytes"] == 1 << 28, "0.5 GiB over two shards: 0.25 GiB each"
    ranks[0].admin(AdminQuota(kind="model", name=model, limit_gb=None))
    for rank, client in enumerate(ranks):
        client.unregister(iids[rank])


def _stored(client: KVFlowClient, sub: str, after_seq: int, position: int, ranks: set[int]) -> Any:
    """Poll until stored records of every rank in `ranks` came (the event bus delivers to
    the KV-event log a moment after a store); the last poll."""
    deadline = time.monotonic() + 10
    while True:
        poll = client.poll_kv_events(sub, after_seq=after_seq, after_log_seq=position)
        if {r.rank for r in poll.records if r.kind == "stored" and r.tier == "l1"} >= ranks:
            return poll
        assert time.monotonic() < deadline, poll
        time.sleep(0.05)


def _stored_by_every_rank(ranks: list[KVFlowClient], model: str, seed: int) -> list[str]:
    """Register every rank of `model` and store one chunk of tokens (`seed`) from each;
    the instance ids."""
    iids, _ = _register(ranks, model)
    tokens = ops.tokens(CHUNK, seed=seed)
    for rank, client in enumerate(ranks):
        client.store(iids[rank], tokens, list(range(16)), request_id=f"{model}-{rank}")
    return iids


def _unsubscribed_and_unregistered(ranks: list[KVFlowClient], sub: str, iids: list[str]) -> None:
    """Unsubscribe `sub` (a poll after that is refused as unknown) and unregister `iids`."""
    ranks[0].unsubscribe_kv_events(sub)
    with pytest.raises(UnknownSubscriptionError):
        ranks[0].poll_kv_events(sub, after_seq=0, after_log_seq=0)
    for rank, client in enumerate(ranks):
        client.unregister(iids[rank])


def test_kv_events_of_one_rank_come_from_its_shard(ranks: list[KVFlowClient]) -> None:
    model = _model("events")
    sub = ranks[0].subscribe_kv_events(model_name=model, rank=1)
    assert sub.subscription.startswith("1:")
    with pytest.raises(InvalidRequestError, match=r"^rank must be an integer in \[0, 1024\)"):
        ranks[0].subscribe_kv_events(model_name=model, rank=-3)  # refused by shard 1
    iids = _stored_by_every_rank(ranks, model, seed=10)
    poll = _stored(ranks[0], sub.subscription, 0, sub.log_seq, {1})
    assert {r.rank for r in poll.records} == {1}
    _unsubscribed_and_unregistered(ranks, sub.subscription, iids)


def test_kv_events_of_every_rank_merge_across_the_shards(ranks: list[KVFlowClient]) -> None:
    """A subscription without a rank (a cache-aware router's) reads every shard: records
    of both ranks in time order, numbered for it; its positions are the front's, and a
    poll from an earlier one gets the same records again (a lost reply). It is its
    client's alone, as on one process."""
    model = _model("merged")
    sub = ranks[0].subscribe_kv_events(model_name=model)
    assert sub.subscription.startswith("all:")
    iids = _stored_by_every_rank(ranks, model, seed=13)
    poll = _stored(ranks[0], sub.subscription, 5, sub.log_seq, {0, 1})
    assert poll.epoch == sub.epoch and poll.lost == 0
    assert [r.seq for r in poll.records] == list(range(6, 6 + len(poll.records)))
    assert [r.ts_ns for r in poll.records] == sorted(r.ts_ns for r in poll.records)
    again = ranks[0].poll_kv_events(sub.subscription, after_seq=5, after_log_seq=sub.log_seq)
    assert again.records[: len(poll.records)] == poll.records
    later = ranks[0].poll_kv_events(
        sub.subscription, after_seq=poll.records[-1].seq, after_log_seq=poll.next_log_seq
    )
    assert all(r.ts_ns >= poll.records[-1].ts_ns for r in later.records)
    with pytest.raises(PermissionDeniedError, match="belongs to another client"):
        ranks[1].poll_kv_events(sub.subscription, after_seq=0, after_log_seq=sub.log_seq)
    with pytest.raises(InvalidRequestError, match="not a position this subscription was given"):
        ranks[0].poll_kv_events(sub.subscription, after_seq=0, after_log_seq=10**9)
    for bad, value in (("after_seq", -1), ("after_log_seq", -1), ("max_records", 0)):
        numbers = {"after_seq": 0, "after_log_seq": 0, "max_records": 8, bad: value}
        with pytest.raises(InvalidRequestError, match=f"^{bad} must be >= [01], got {value}$"):
            ranks[0].poll_kv_events(sub.subscription, **numbers)
    _unsubscribed_and_unregistered(ranks, sub.subscription, iids)


def test_status_is_the_front_s_and_every_shard_s(ranks: list[KVFlowClient]) -> None:
    status = ranks[0].status()
    front = status["server"]
    assert front["shards"] == 2 and len(front["shard_pids"]) == 2
    assert [s["server"]["pid"] for s in status["shards"]] == front["shard_pids"]
    assert all(s["config"]["l1_size_gb"] == 0.125 for s in status["shards"])


def test_a_hung_shard_holds_up_only_what_needs_it(ranks: list[KVFlowClient]) -> None:
    """SIGSTOP of shard 1: a lookup of rank 0 is still answered, one that needs rank 1
    times out for its client, a status comes after 5 s with shard 1's place saying so;
    once the shard runs again, so does everything."""
    model, tokens = _model("hang"), ops.tokens(CHUNK, seed=12)
    pids = ranks[0].status()["server"]["shard_pids"]
    os.kill(pids[1], signal.SIGSTOP)
    try:
        with KVFlowClient(ranks[0].endpoint, timeout_s=1.0) as quick:
            assert quick.lookup(tokens, model_name=model, world_size=WORLD, ranks=[0]) == 0
            with pytest.raises(RequestTimeoutError):
                quick.lookup(tokens, model_name=model, world_size=WORLD)
        with KVFlowClient(ranks[0].endpoint, timeout_s=15.0) as patient:
            began = time.monotonic()
            status = patient.status()  # what an operator asks first: the others still show
            assert time.monotonic() - began < 10
            assert status["shards"][1] == {"error": "shard 1 did not answer within 5 s"}
            assert status["shards"][0]["server"]["pid"] == pids[0]
            assert Snapshot.of(status).tiers["l1"].capacity_bytes == 0.125 * (1 << 30)
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert ranks[1].lookup(tokens, model_name=model, world_size=WORLD) == 0


def test_a_killed_shard_stops_the_whole_server() -> None:
    """SIGKILL of shard 1: the front stops the other shard and exits 1, naming it."""
    srv = _server()
    with KVFlowClient(srv.endpoint, timeout_s=10) as client:
        pids = client.status()["server"]["shard_pids"]
    os.kill(pids[1], signal.SIGKILL)
    assert srv.proc.wait(30) == 1, srv.log()
    srv.stop()
    assert "shard 1" in srv.log() and "exited with code -9" in srv.log()
    deadline = time.monotonic() + 10
    while _alive(pids[0]):
        assert time.monotonic() < deadline, "shard 0 outlived its front"
        time.sleep(0.1)


def test_a_front_killed_outright_takes_its_shards_with_it() -> None:
    """SIGKILL of the front (no chance to stop anything): the kernel's parent-death
    signal stops each shard, and nothing keeps holding the GPUs' memory."""
    srv = _server()
    with KVFlowClient(srv.endpoint, timeout_s=10) as client:
        pids = client.status()["server"]["shard_pids"]
    srv.proc.kill()
    srv.stop()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a shard outlived its front"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


def test_a_shard_that_cannot_start_stops_the_start(tmp_path: Path) -> None:
    """A disk path that is a file: the shards cannot make their directories; the server
    exits at once with the shard's reason."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(RuntimeError, match="shard 0"):
        _server("--l2-disk", str(blocker))


def test_probes_answer_for_the_shards() -> None:
    port = free_port()
    with _server("--probe-port", str(port)) as srv:
        deadline = time.monotonic() + 20
        code, body = ops.get_json(f"http://127.0.0.1:{port}/readyz")
        while code != 200:
            assert time.monotonic() < deadline, body
            time.sleep(0.2)
            code, body = ops.get_json(f"http://127.0.0.1:{port}/readyz")
        assert ops.get_json(f"http://127.0.0.1:{port}/healthz")[0] == 200
        with KVFlowClient(srv.endpoint, timeout_s=10) as client:
            assert client.status()["server"]["probe_port"] == port


def test_top_reads_a_sharded_server_as_the_sum_of_its_shards(ranks: list[KVFlowClient]) -> None:
    """`kvflow top` and `kvflow report` read the status through Snapshot.of: a sharded
    status is its shards' numbers added up (L1 capacity: both shares), not the front's
    empty own part."""
    model = _model("top")
    iids, _ = _register(ranks, model)
    tokens = ops.tokens(CHUNK, seed=11)
    for rank, client in enumerate(ranks):
        client.store(iids[rank], tokens, list(range(16)), request_id=f"t{rank}")
    status = ranks[0].status()
    whole = Snapshot.of(status)
    parts = [Snapshot.of(s) for s in status["shards"]]
    assert all(p.totals["store.requests"] >= 1 for p in parts)
    assert whole.totals["store.requests"] == sum(p.totals["store.requests"] for p in parts)
    assert whole.tiers["l1"].capacity_bytes == 0.25 * (1 << 30)
    assert whole.instances == sum(p.instances for p in parts) >= 2
    assert model in whole.models and whole.endpoint == ranks[0].endpoint
    for rank, client in enumerate(ranks):
        client.unregister(iids[rank])


def test_only_an_ipc_socket_this_process_may_write_is_reached_directly(tmp_path: Path) -> None:
    sock = tmp_path / "shard-0"
    assert not reachable_ipc(f"ipc://{sock}"), "no such socket here (another container)"
    sock.write_text("")
    assert reachable_ipc(f"ipc://{sock}")
    sock.chmod(0o400)
    assert os.access(sock, os.W_OK) or not reachable_ipc(f"ipc://{sock}")
    assert not reachable_ipc("tcp://127.0.0.1:5555")


def test_each_shard_exports_its_metrics_as_a_resource_of_its_own() -> None:
    """Over OTLP the shards' streams (same names, one per process) carry `kvflow.shard`
    and a `service.instance.id` each, so a collector keeps them apart."""
    receiver = OTLPReceiver()
    try:
        with _server("--otlp-endpoint", receiver.endpoint, "--export-interval-s", "0.5"):
            deadline = time.monotonic() + 30
            while len({r.get("kvflow.shard") for r in receiver.resources()} - {None}) < 2:
                assert time.monotonic() < deadline, receiver.resources()
                time.sleep(0.2)
        shards = {r["kvflow.shard"]: r for r in receiver.resources() if "kvflow.shard" in r}
        assert set(shards) == {"0", "1"}
        ids = {r["service.instance.id"] for r in shards.values()}
        assert len(ids) == 2 and all(i.endswith(("/shard-0", "/shard-1")) for i in ids)
        assert all(r["service.name"] == "kvflow" for r in shards.values())
    finally:
        receiver.close()


def test_an_operator_s_resource_attributes_are_kept() -> None:
    given = shard_resource({"OTEL_RESOURCE_ATTRIBUTES": "team=kv,service.instance.id=a"}, 1, 7)
    assert given == "team=kv,service.instance.id=a,kvflow.shard=1"
    assert shard_resource({}, 0, 7).startswith("kvflow.shard=0,service.instance.id=")
