"""L2 on Redis through real `kvflow server` subprocesses and a real redis-server.

Chunks evicted from a small L1 hit in Redis and come back bit-exact; two servers share
one Redis (what one stores, the other serves); a password given only through
KVFLOW_REDIS_PASSWORD works and never shows, a wrong one stops the server with status 2;
Redis stopped mid-run leaves the server serving from L1 and counting failures, and once
Redis is back on its port new stores reach it again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient
from tests.e2e.server_proc import running_server
from tests.e2e.test_server_l2 import (
    CHUNK,
    CHUNK_BYTES,
    DST_IDS,
    L1_CHUNKS,
    OTHER,
    SRC_IDS,
    THIRD,
    Log,
    N,
    T,
    Worker,
    _blocks,
    _caches,
)
from tests.support.collectors import free_port
from tests.support.launcher import kvflow_run
from tests.support.redis_servers import RedisServer

PREFIX = "kvflow-e2e:"
SECRET = "e2e-Redis-pa55-c41b9"  # distinctive: a leak anywhere is found by grep


def _wait(check: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def our_keys(rs: RedisServer) -> int:
    """How many keys under PREFIX the redis-server holds."""
    with rs.admin() as r:
        return sum(1 for _ in r.scan_iter(match=PREFIX + "*", count=1000))


# -- kvflow servers -----------------------------------------------------------------------


@contextlib.contextmanager
def kvflow_server(
    tmp_path: Path, name: str, url: str, extra: Sequence[str] = ()
) -> Iterator[tuple[KVFlowClient, Log, str]]:
    """A server with an L1 of L1_CHUNKS objects and L2 on Redis at `url`; yields a
    client, the JSON event log, and the endpoint."""
    log_path = tmp_path / f"{name}.log"
    args = [
        "--l1-size-gb", str(L1_CHUNKS * CHUNK_BYTES / (1 << 30)),
        "--l2-redis", url, "--l2-redis-key-prefix", PREFIX,
        "--l2-redis-timeout-s", "0.5", "--l2-timeout-s", "1",
        "--log-level", "debug", "--log-format", "json", *extra,
    ]  # fmt: skip
    with (
        running_server(CHUNK, log_path, args) as endpoint,
        KVFlowClient(endpoint, timeout_s=30.0) as client,
    ):
        yield client, Log(log_path), endpoint


def redis_status(client: KVFlowClient) -> dict[str, Any]:
    tiers: dict[str, Any] = client.status()["l2"]["tiers"]
    return dict(tiers["redis"])


def evict_t(client: KVFlowClient, w: Worker) -> None:
    """Store T, then OTHER and THIRD, so T's last 6 chunks live only in Redis."""
    for tokens, rid in ((T, "t"), (OTHER, "o"), (THIRD, "3")):
        assert client.store("src", tokens, SRC_IDS, request_id=rid) == len(tokens)
        _wait(w.settled)
    assert client.status()["l1"]["evicted_chunks"] == 6


# -- (a) Redis hits -------------------------------------------------------------------------


def test_chunks_evicted_from_l1_hit_in_redis_and_come_back_bit_exact(tmp_path: Path) -> None:
    """Write-through puts every chunk in Redis; after L1 evicts 6 of T's chunks the
    lookup counts them as Redis hits and the retrieve loads them bit-exact."""
    src, dst = _caches(1), _caches(2)
    with (
        RedisServer(tmp_path / "redis") as rs,
        kvflow_server(tmp_path, "a", rs.url()) as (client, log, _),
    ):
        w = Worker(client, src, dst)
        evict_t(client, w)
        assert our_keys(rs) == 2 * N + 6  # every chunk written through, under the prefix
        assert client.lookup(T, model_name="m", request_id="q", prefetch=False) == N * CHUNK
        _wait(lambda: bool(log.events("lookup_end")))
        assert log.events("lookup_end")[-1]["hit_tokens_by_tier"] == {
            "l1": 2 * CHUNK,
            "redis": 6 * CHUNK,
        }
        assert client.retrieve("dst", T, DST_IDS, request_id="q") == N * CHUNK
        assert torch.equal(_blocks(dst, DST_IDS), _blocks(src, SRC_IDS))
        _wait(lambda: bool(log.events("retrieve_end")))
        assert log.events("retrieve_end")[-1]["l2_chunks"] == 6
        status = redis_status(client)
        assert (status["stored"], status["loaded"], status["load_failures"]) == (2 * N + 6, 6, 0)


# -- (b) one Redis, two servers -----------------------------------------------------------


def test_two_servers_share_one_redis(tmp_path: Path) -> None:
    """Chunks stored through server A are found (all in Redis) and retrieved bit-exact
    through server B, whose L1 never saw them."""
    src, dst = _caches(1), _caches(2)
    with (
        RedisServer(tmp_path / "redis") as rs,
        kvflow_server(tmp_path, "A", rs.url()) as (a, _, _),
        kvflow_server(tmp_path, "B", rs.url()) as (b, log_b, _),
    ):
        wa = Worker(a, src, _caches(3))
        assert a.store("src", T, SRC_IDS, request_id="t") == N * CHUNK
        _wait(wa.settled)
        wb = Worker(b, _caches(4), dst)
        assert b.lookup(T, model_name="m", request_id="q", prefetch=False) == N * CHUNK
        _wait(lambda: bool(log_b.events("lookup_end")))
        assert log_b.events("lookup_end")[-1]["hit_tokens_by_tier"] == {"l1": 0, "redis": N * CHUNK}
        assert b.retrieve("dst", T, DST_IDS, request_id="q") == N * CHUNK
        assert torch.equal(_blocks(dst, DST_IDS), _blocks(src, SRC_IDS))
        _wait(wb.settled)
        assert redis_status(b)["loaded"] == N and redis_status(b)["stored"] == 0


# -- (c) a password from the environment only -------------------------------------------


def test_password_from_the_environment_works_and_never_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVFLOW_REDIS_PASSWORD alone authenticates the server to a requirepass Redis; the
    secret shows in none of the server's log and stderr, status, or `kvflow status`; a
    wrong one exits 2 with one line naming the variable."""
    for name in [k for k in os.environ if k.startswith("KVFLOW_")]:
        monkeypatch.delenv(name)
    src, dst = _caches(1), _caches(2)
    with RedisServer(tmp_path / "redis", password=SECRET) as rs:
        monkeypatch.setenv("KVFLOW_REDIS_PASSWORD", SECRET)  # the subprocess inherits it
        with kvflow_server(tmp_path, "pw", rs.url()) as (client, log, endpoint):
            w = Worker(client, src, dst)
            evict_t(client, w)
            assert client.retrieve("dst", T, DST_IDS, request_id="q") == N * CHUNK
            assert torch.equal(_blocks(dst, DST_IDS), _blocks(src, SRC_IDS))
            assert redis_status(client)["loaded"] == 6 and our_keys(rs) == 2 * N + 6
            status_cli = kvflow_run(["status", "--endpoint", endpoint])
            assert status_cli.returncode == 0, status_cli.stderr
            assert '"redis"' in status_cli.stdout
            shown = [status_cli.stdout, status_cli.stderr, repr(client.status())]
        shown.append(log.path.read_text())  # stdout and stderr, through shutdown
        for text in shown:
            assert SECRET not in text

        wrong = "not-the-Pa55word-e2e"
        refused = kvflow_run(
            ["server", "--port", str(free_port()), "--prometheus-port", "0", "--l2-redis",
             rs.url()],
            env={**os.environ, "KVFLOW_REDIS_PASSWORD": wrong},
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and "KVFLOW_REDIS_PASSWORD" in lines[0], refused.stderr
        assert wrong not in refused.stderr + refused.stdout
        assert SECRET not in refused.stderr + refused.stdout


# -- (d) Redis stopped mid-run ------------------------------------------------------------


def test_redis_stopped_mid_run_the_server_serves_from_l1_and_reconnects(tmp_path: Path) -> None:
    """With Redis killed, stores and lookups still answer (L1 serves T bit-exact), the
    failures are counted; after Redis restarts on its port new stores reach it again."""
    src, dst = _caches(1), _caches(2)
    fresh = np.arange(9000, 9000 + N * CHUNK, dtype=np.int32)
    later = np.arange(11000, 11000 + N * CHUNK, dtype=np.int32)
    with (
        RedisServer(tmp_path / "redis") as rs,
        kvflow_server(tmp_path, "d", rs.url()) as (client, _, _),
    ):
        w = Worker(client, src, dst)
        assert client.store("src", T, SRC_IDS, request_id="t") == N * CHUNK
        _wait(w.settled)
        assert our_keys(rs) == N
        rs.stop()
        # stores answer at once; their write-through fails and is counted
        assert client.store("src", OTHER, SRC_IDS, request_id="o") == N * CHUNK
        _wait(w.settled)
        _wait(lambda: redis_status(client)["store_failures"] >= N)
        # a lookup that needs Redis answers in bounded time: a miss, counted
        start = time.monotonic()
        assert client.lookup(fresh, model_name="m", prefetch=False) == 0
        assert time.monotonic() - start < 5.0
        _wait(lambda: redis_status(client)["lookup_failures"] >= 1)
        # T is served from L1, bit-exact
        assert client.lookup(T, model_name="m", prefetch=False) == N * CHUNK
        assert client.retrieve("dst", T, DST_IDS, request_id="q") == N * CHUNK
        assert torch.equal(_blocks(dst, DST_IDS), _blocks(src, SRC_IDS))

        rs.start()  # same port, empty (no persistence)
        stored_before = redis_status(client)["stored"]
        deadline = time.monotonic() + 20
        while our_keys(rs) < N:  # the tier reconnects with backoff: a later store lands
            assert time.monotonic() < deadline, redis_status(client)
            tokens = later + int(time.monotonic() * 1000) % 100_000 * 10  # new chunks each time
            client.store("src", tokens, SRC_IDS, request_id="l")
            _wait(w.settled)
            time.sleep(0.2)
        assert redis_status(client)["stored"] >= stored_before + N
