"""Admin operations and who may call them (docs/OPERATIONS.md; issue 42).

Real `kvflow server` processes and real sockets: with CURVE, only keys listed in
--admin-keys are admins; without CURVE, only loopback peers are. A refused caller gets
`permission_denied` for every admin request and changes nothing; every call, allowed
or refused, is a log line naming the caller. `kvflow admin` drives the same requests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvflow import cli
from kvflow.core import KVFlowClient
from kvflow.core.errors import DrainingError, InvalidRequestError, PermissionDeniedError
from kvflow.core.server.curve import generate
from kvflow.core.server.protocol import (
    AdminClear,
    AdminDrain,
    AdminQuota,
    AdminRequest,
    AdminResize,
)
from kvflow.core.tiers.quota import salt_label
from kvflow.events import EventType
from kvflow.subscribers.eventlog_read import LogReader
from tests.support.ops import BS, CHUNK, NL, ServerProcess, shared_kv, tokens, wait_for

EVERY_ADMIN_REQUEST: list[AdminRequest] = [
    AdminClear(everything=True),
    AdminResize(l1_size_gb=0.01),
    AdminDrain(),
    AdminDrain(undrain=True),
    AdminQuota(kind="salt", name="tenant-secret", limit_gb=0.001),
]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("admin-keys")
    found: dict[str, Path] = {}
    for name in ("server", "operator", "engine"):
        public, secret = generate(root / name, name)
        found[name], found[f"{name}_public"] = secret, public
    for folder, names in (("authorized", ("operator", "engine")), ("admins", ("operator",))):
        (root / folder).mkdir()
        for name in names:
            shutil.copy(found[f"{name}_public"], root / folder)
        found[folder] = root / folder
    return found


@pytest.fixture(scope="module")
def curve_server(keys: dict[str, Path]) -> Iterator[ServerProcess]:
    srv = _admin_server(keys, "--l1-size-gb", "0.05")
    yield srv
    assert srv.stop() == 0, srv.log()


def _curve_client(
    srv: ServerProcess, keys: dict[str, Path], name: str, client_id: str | None = None
) -> KVFlowClient:
    return KVFlowClient(
        srv.endpoint, timeout_s=20, client_id=client_id,
        curve_server_key=keys["server_public"], curve_key=keys[name],
    )  # fmt: skip


def _admin_server(keys: dict[str, Path], *flags: str) -> ServerProcess:
    """A CURVE server whose admins are `keys`' operator's, without metrics, plus `flags`."""
    return ServerProcess(
        *flags, "--disable-metrics",
        "--curve-secret-key", str(keys["server"]),
        "--curve-authorized-keys", str(keys["authorized"]),
        "--admin-keys", str(keys["admins"]),
    )  # fmt: skip


def test_only_a_listed_curve_key_is_an_admin(
    curve_server: ServerProcess, keys: dict[str, Path]
) -> None:
    """The engine's key is authorised to connect but not listed as an admin: every admin
    request is refused and changes nothing; the operator's key runs them all. Each call
    is logged with the caller's key, the salt only by its label."""
    with _curve_client(curve_server, keys, "engine") as engine:
        before = engine.status()
        for request in EVERY_ADMIN_REQUEST:
            with pytest.raises(PermissionDeniedError, match="--admin-keys"):
                engine.admin(request)
        after = engine.status()
        assert after["l1"]["capacity_bytes"] == before["l1"]["capacity_bytes"]
        assert after["server"]["drain"]["draining"] is False
        assert all(t["limit_bytes"] is None for t in after["server"]["tenants"])
    with _curve_client(curve_server, keys, "operator") as operator:
        for request in EVERY_ADMIN_REQUEST:
            operator.admin(request)
            assert operator.last_server_time_s > 0  # the reply carries its handling time
        status = operator.status()
        assert status["l1"]["capacity_bytes"] == int(0.01 * (1 << 30))
        limits = {t["tenant"]: t["limit_bytes"] for t in status["server"]["tenants"]}
        assert limits[salt_label("tenant-secret")] == int(0.001 * (1 << 30))
    engine_key = keys["engine_public"].read_text().split('"')[1]
    operator_key = keys["operator_public"].read_text().split('"')[1]
    log = wait_for(lambda: "admin quota" in curve_server.log() and curve_server.log())
    refused = [line for line in log.splitlines() if "refused for" in line]
    assert len(refused) == len(EVERY_ADMIN_REQUEST)
    assert all(engine_key in line for line in refused)
    done = [line for line in log.splitlines() if " by " in line and "admin " in line]
    assert len(done) == len(EVERY_ADMIN_REQUEST) and all(operator_key in x for x in done)
    assert "tenant-secret" not in log


def test_every_admin_call_is_an_admin_event_naming_its_caller(
    keys: dict[str, Path], tmp_path: Path
) -> None:
    """A refused call (the engine's key, not listed) and an admin's calls that succeed or
    fail each publish one ADMIN event, kept in the server's event log: `action`,
    `outcome` (denied, ok, error), `caller` (client id, peer address and CURVE key),
    `args`, and `result` or `error`. The cache salt shows only by its label."""
    log_dir = tmp_path / "events"
    srv = _admin_server(keys, "--event-log", str(log_dir), "--l1-size-gb", "0.05")
    try:
        with (
            _curve_client(srv, keys, "engine", client_id="engine-7") as engine,
            pytest.raises(PermissionDeniedError),
        ):
            engine.admin(AdminClear(model_name="m", cache_salt="tenant-secret"))
        with _curve_client(srv, keys, "operator", client_id="operator-1") as operator:
            operator.admin(AdminQuota(kind="salt", name="tenant-secret", limit_gb=0.001))
            operator.admin(AdminDrain())
            with pytest.raises(InvalidRequestError, match="unknown tier"):
                operator.admin(AdminClear(model_name="m", tiers=["l9"]))
    finally:
        assert srv.stop() == 0, srv.log()
    events = [ev for ev in LogReader.open(log_dir) if ev.type == EventType.ADMIN]
    engine_key = keys["engine_public"].read_text().split('"')[1]
    operator_key = keys["operator_public"].read_text().split('"')[1]
    assert [(ev.attrs["action"], ev.attrs["outcome"]) for ev in events] == [
        ("clear", "denied"), ("quota", "ok"), ("drain", "ok"), ("clear", "error"),
    ]  # fmt: skip
    denied, quota, drain, failed = (dict(ev.attrs) for ev in events)
    for event, client_id, key in [(denied, "engine-7", engine_key)] + [
        (allowed, "operator-1", operator_key) for allowed in (quota, drain, failed)
    ]:
        caller = event["caller"]
        assert caller == f"{client_id} at 127.0.0.1 with CURVE key {key}", caller
    assert denied["args"] == {"model_name": "m", "cache_salt": salt_label("tenant-secret")}
    assert "--admin-keys" in denied["error"] and "result" not in denied
    assert quota["args"] == {
        "kind": "salt", "name": salt_label("tenant-secret"), "limit_gb": 0.001,
    }  # fmt: skip
    assert quota["result"]["limit_bytes"] == int(0.001 * (1 << 30))
    assert drain["args"] == {} and drain["result"]["draining"] is True
    assert failed["args"] == {"model_name": "m", "tiers": ["l9"]}
    assert "unknown tier" in failed["error"] and "result" not in failed
    assert all(ev.session_id is None and ev.op_id is None for ev in events)
    assert "tenant-secret" not in repr([ev.attrs for ev in events])


def test_without_curve_only_loopback_peers_are_admins() -> None:
    """A server listening on every interface (--insecure-listen): a client reaching it
    through the machine's own address is refused every admin request; the same client
    code over 127.0.0.1 is an admin."""
    external = _external_address()
    if external is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect through")
    srv = ServerProcess("--host", "0.0.0.0", "--insecure-listen", "--disable-metrics")
    try:
        port = srv.endpoint.rsplit(":", 1)[1]
        with KVFlowClient(f"tcp://{external}:{port}", timeout_s=20) as remote:
            for request in EVERY_ADMIN_REQUEST:
                with pytest.raises(PermissionDeniedError, match="loopback"):
                    remote.admin(request)
            assert remote.status()["server"]["drain"]["draining"] is False
        with KVFlowClient(f"tcp://127.0.0.1:{port}", timeout_s=20) as local:
            assert local.admin(AdminDrain())["draining"] is True
            assert local.admin(AdminDrain(undrain=True))["draining"] is False
        # the server logs from its own threads: a line may follow the reply that caused it
        wait_for(
            lambda: f"at {external}" in srv.log() and "at 127.0.0.1" in srv.log(),
            timeout_s=15, what="both callers' addresses in the server log",
        )  # fmt: skip
    finally:
        assert srv.stop() == 0, srv.log()


def _external_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent, the route picks our address
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = ServerProcess("--disable-metrics", "--l1-size-gb", "0.05")
    yield srv
    assert srv.stop() == 0, srv.log()


def _admin_cli(srv: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "admin", "--endpoint", srv.endpoint, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _admin_main(
    srv: ServerProcess, capsys: pytest.CaptureFixture[str], *args: str
) -> subprocess.CompletedProcess[str]:
    """`kvflow admin` through the console script's entry point (`kvflow.cli.main`) in this
    process: a fresh Python importing torch is 2.5 s of CPU a call, and the drain and
    disk-tier tests run the command itself (`_admin_cli`)."""
    capsys.readouterr()
    status = cli.main(["admin", "--endpoint", srv.endpoint, *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, status, out, err)


def test_drain_refuses_stores_and_registrations_and_undrain_takes_them_again(
    server: ServerProcess,
) -> None:
    """Draining: a store and a registration fail with `draining` (naming why), lookups
    and retrieves go on; `kvflow admin drain --wait` reports drained; undrain restores."""
    kv = shared_kv(1)
    prompt = tokens(2 * CHUNK, seed=1)
    with KVFlowClient(server.endpoint, timeout_s=20) as client:
        client.register_kv_caches("drain-a", kv, model_name="m")
        assert client.store("drain-a", prompt, list(range(32)), request_id="r1") == 2 * CHUNK
        drained = _admin_cli(server, "drain", "--wait")
        assert drained.returncode == 0, drained.stderr
        assert json.loads(drained.stdout)["drained"] is True
        with pytest.raises(DrainingError, match="draining"):
            client.store("drain-a", tokens(CHUNK, seed=2), list(range(16)), request_id="r2")
        with pytest.raises(DrainingError, match="registration"):
            client.register_kv_caches("drain-b", shared_kv(2), model_name="m")
        assert client.lookup(prompt, model_name="m") == 2 * CHUNK
        dst = list(range(32, 64))
        assert client.retrieve("drain-a", prompt, dst, request_id="r3") == 2 * CHUNK
        assert client.status()["server"]["drain"] == {
            "draining": True, "in_flight": 0, "pending_l2_writes": 0, "drained": True,
        }  # fmt: skip
        undrained = _admin_cli(server, "undrain")
        assert undrained.returncode == 0 and json.loads(undrained.stdout)["draining"] is False
        assert client.store("drain-a", tokens(CHUNK, seed=2), list(range(16)), request_id="r4")
        client.unregister("drain-a")


def test_work_queued_behind_a_store_counts_in_flight_until_it_ran() -> None:
    """A drain waits for registrations and plain stores too: each queued on a worker
    behind a store that waits for its layers counts in `in_flight`, with that store, until
    it has run."""
    with (
        ServerProcess("--disable-observability", "--max-instances", "9") as srv,  # 8 workers
        KVFlowClient(srv.endpoint, timeout_s=20) as client,
        ThreadPoolExecutor(1) as pool,
        ThreadPoolExecutor(1) as stores,
    ):
        caches = [shared_kv(20 + i) for i in range(9)]
        client.register_kv_caches(  # worker 0
            "queued-0", caches[0], model_name="m", block_size=BS, layerwise=True
        )
        for i in range(1, 8):  # workers 1 to 7, so the next instance shares worker 0
            client.register_kv_caches(f"queued-{i}", caches[i], model_name="m")

        def in_flight() -> int:
            return int(client.status()["server"]["drain"]["in_flight"])

        save = client.store_layerwise("queued-0", tokens(CHUNK, 9), list(range(16)), request_id="h")
        try:
            wait_for(lambda: in_flight() == 1, 10, what="the store waiting for its layers")
            late = pool.submit(client.register_kv_caches, "queued-8", caches[8], model_name="m")
            wait_for(lambda: in_flight() == 2, 10, what="the registration queued behind it")
            assert not late.done()
            plain = stores.submit(
                client.store, "queued-0", tokens(CHUNK, 10), list(range(16, 32)), request_id="p"
            )
            wait_for(lambda: in_flight() == 3, 10, what="a plain store queued behind them")
        finally:  # the store ends either way, so the server stops
            for layer in range(NL):
                save.layer_done(layer)
        assert save.wait(30) == CHUNK
        late.result(30)
        assert plain.result(30) == CHUNK
        assert in_flight() == 0


def test_admin_cli_clear_quota_and_resize(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvflow admin clear --model` drops that model's objects only; `quota` and
    `resize` print what they did; bad arguments exit 2 naming the flag."""
    kv = shared_kv(3)
    keep, drop = tokens(CHUNK, seed=3), tokens(CHUNK, seed=4)
    with KVFlowClient(server.endpoint, timeout_s=20) as client:
        client.register_kv_caches("clear-keep", kv, model_name="keep")
        client.register_kv_caches("clear-drop", shared_kv(4), model_name="drop")
        assert client.store("clear-keep", keep, list(range(16)), request_id="k") == CHUNK
        assert client.store("clear-drop", drop, list(range(16)), request_id="d") == CHUNK
        cleared = _admin_main(server, capsys, "clear", "--model", "drop")
        assert cleared.returncode == 0, cleared.stderr
        assert json.loads(cleared.stdout) == {"dropped": {"l1": 1}}
        assert client.lookup(drop, model_name="drop") == 0
        assert client.lookup(keep, model_name="keep") == CHUNK
        quota = _admin_main(server, capsys, "quota", "--model", "keep", "--limit-gb", "0.5")
        assert json.loads(quota.stdout)["limit_bytes"] == 1 << 29
        resized = _admin_main(server, capsys, "resize", "--l1-size-gb", "0.1")
        assert json.loads(resized.stdout)["capacity_bytes"] == int(0.1 * (1 << 30))
        for args, flag in (
            (("clear",), "--model, --salt or --all"),
            (("resize", "--l1-size-gb", "-1"), "--l1-size-gb"),
            (("quota", "--salt", "x", "--limit-gb", "nan"), "--limit-gb"),
        ):
            bad = _admin_main(server, capsys, *args)
            assert bad.returncode == 2 and flag in bad.stderr, bad.stderr
        with pytest.raises(InvalidRequestError, match="unknown tier"):
            client.admin(AdminClear(model_name="keep", tiers=["l9"]))
        with pytest.raises(InvalidRequestError, match="everything"):
            client.admin(AdminClear())
        assert client.lookup(keep, model_name="keep") == CHUNK
        client.unregister("clear-keep")
        client.unregister("clear-drop")


def test_clearing_the_disk_tier_deletes_its_object_files(tmp_path: Path) -> None:
    """A server with an L2 disk tier: once two models' chunks are written through to disk,
    `kvflow admin clear --model drop --tier disk` deletes that model's object files only,
    leaving L1 as it was (its lookup still hits); once L1 is cleared too, its lookup
    misses (no tier holds it) while the other model's lookup hits from disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    srv = ServerProcess(
        "--disable-metrics", "--l1-size-gb", "0.05",
        "--l2-disk", str(disk), "--l2-disk-size-gb", "0.05",
    )  # fmt: skip

    def disk_objects() -> int:
        return int(client.status()["l2"]["tiers"]["disk"]["objects"])

    def object_files() -> list[Path]:
        return sorted(disk.rglob("*.kv"))

    drop, keep = tokens(2 * CHUNK, seed=5), tokens(CHUNK, seed=6)
    try:
        with KVFlowClient(srv.endpoint, timeout_s=20) as client:
            client.register_kv_caches("disk-drop", shared_kv(5), model_name="drop")
            client.register_kv_caches("disk-keep", shared_kv(6), model_name="keep")
            assert client.store("disk-drop", drop, list(range(32)), request_id="d") == 2 * CHUNK
            assert client.store("disk-keep", keep, list(range(16)), request_id="k") == CHUNK
            wait_for(lambda: disk_objects() == 3, what="the write-through to disk")
            assert len(object_files()) == 3
            cleared = _admin_cli(srv, "clear", "--model", "drop", "--tier", "disk")
            assert cleared.returncode == 0, cleared.stderr
            assert json.loads(cleared.stdout) == {"dropped": {"disk": 2}}
            wait_for(lambda: len(object_files()) == 1, what="the dropped files deleted")
            assert disk_objects() == 1
            assert client.lookup(drop, model_name="drop") == 2 * CHUNK  # L1 still holds it
            assert client.admin(AdminClear(everything=True, tiers=["l1"])) == {"dropped": {"l1": 3}}
            assert client.lookup(drop, model_name="drop") == 0
            assert client.lookup(keep, model_name="keep") == CHUNK  # from disk
            client.unregister("disk-drop")
            client.unregister("disk-keep")
    finally:
        assert srv.stop() == 0, srv.log()


def test_a_sharded_server_s_admin_calls_are_events_of_every_shard(
    keys: dict[str, Path], tmp_path: Path
) -> None:
    """`--shards 2`: the front decides who is an admin and every shard records the call in
    its own event log (`shard-i` under --event-log), the refused one too, with the
    caller the front saw; a quota reaches each shard as its half."""
    log_dir = tmp_path / "events"
    srv = _admin_server(keys, "--event-log", str(log_dir), "--shards", "2", "--l1-size-gb", "0.1")
    try:
        with (
            _curve_client(srv, keys, "engine", client_id="engine-7") as engine,
            pytest.raises(PermissionDeniedError, match=r"admin clear refused: .*--admin-keys"),
        ):
            engine.admin(AdminClear(model_name="m"))
        with _curve_client(srv, keys, "operator", client_id="operator-1") as operator:
            done = operator.admin(AdminQuota(kind="model", name="m", limit_gb=0.002))
            assert [r["limit_bytes"] for r in done["shards"]] == [int(0.001 * (1 << 30))] * 2
    finally:
        assert srv.stop() == 0, srv.log()
    engine_key = keys["engine_public"].read_text().split('"')[1]
    operator_key = keys["operator_public"].read_text().split('"')[1]
    for shard in ("shard-0", "shard-1"):
        events = [e for e in LogReader.open(log_dir / shard) if e.type == EventType.ADMIN]
        assert [(e.attrs["action"], e.attrs["outcome"]) for e in events] == [
            ("clear", "denied"), ("quota", "ok"),
        ], shard  # fmt: skip
        denied, quota = (dict(e.attrs) for e in events)
        assert denied["caller"] == f"engine-7 at 127.0.0.1 with CURVE key {engine_key}"
        assert "--admin-keys" in denied["error"] and denied["args"] == {"model_name": "m"}
        assert quota["caller"] == f"operator-1 at 127.0.0.1 with CURVE key {operator_key}"
        assert quota["args"]["limit_gb"] == 0.001
