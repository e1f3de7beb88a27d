"""A write burst against a genuinely slow L2 tier, through a real `kvflow server`.

The tier is a real redis-server made slow, not down: `CLIENT PAUSE <ms> WRITE` holds
every write command (the tier's pipelined SETs) until the pause ends, while reads and
PINGs still answer; --l2-redis-timeout-s is longer than the pause, so the tier stays
connected and its SETs simply answer late. L1 is 16 MiB (backlog bound 8 MiB) and the
burst is 6 stores of 4 MiB: 24 chunks, three times the bound.

- With --l2-backlog-wait-s longer than the pause, the burst's stores wait for the tier
  (counted) and nothing is dropped: Redis ends up holding every chunk, and a second
  server (an empty L1) finds every request whole there.
- With a wait shorter than the pause, the stores past the bound drop their L2 writes:
  counted in status, one warning when the burst starts (its first dropped
  L2_STORE_END) and one when a store goes through whole again, not one per store.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from kvflow.core import KVFlowClient
from kvflow.core.config import BACKLOG_SHARE
from tests.e2e.test_server_beyond_l1 import CHUNK, CHUNK_BYTES, L1_BYTES, _caches, _server
from tests.e2e.test_server_l2 import Log, _wait
from tests.support.redis_servers import RedisServer

STORE_CHUNKS = 4
STORES = 6
BOUND_CHUNKS = int(L1_BYTES * BACKLOG_SHARE) // CHUNK_BYTES  # the write-through's bound
PREFIX = "kvflow-slow:"


def _tokens(i: int) -> np.ndarray:
    """Request i's tokens: STORE_CHUNKS chunks no other request shares."""
    start = 7 + i * STORE_CHUNKS * CHUNK
    return np.arange(start, start + STORE_CHUNKS * CHUNK, dtype=np.int32)


def _args(rs: RedisServer, wait_s: float) -> list[str]:
    return [
        "--l2-redis", rs.url(), "--l2-redis-key-prefix", PREFIX,
        "--l2-redis-timeout-s", "20", "--l2-backlog-wait-s", str(wait_s),
    ]  # fmt: skip


def _burst(client: KVFlowClient, first: int = 0, n: int = STORES) -> float:
    """Stores requests first..first+n-1 back to back; each returns all its tokens (L1
    holds them); returns the burst's seconds."""
    started = time.monotonic()
    for i in range(first, first + n):
        held = client.store("src", _tokens(i), list(range(STORE_CHUNKS)), request_id=f"s{i}")
        assert held == STORE_CHUNKS * CHUNK
    return time.monotonic() - started


def _settled(client: KVFlowClient) -> bool:
    return int(client.status()["l2"]["in_flight"]["write_through"]["calls"]) == 0


def _redis_keys(rs: RedisServer) -> int:
    admin = rs.admin()
    try:
        return sum(1 for _ in admin.scan_iter(match=f"{PREFIX}*", count=1000))
    finally:
        admin.close()


def _pause_writes(rs: RedisServer, ms: int) -> None:
    admin = rs.admin()
    try:
        admin.execute_command("CLIENT", "PAUSE", str(ms), "WRITE")
    finally:
        admin.close()


def test_a_burst_waits_for_a_paused_redis_within_the_bound_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """Wait 30 s, pause 2 s: the burst stalls for the pause (stores waited), nothing is
    dropped, Redis holds all 24 chunks, and a second server finds every request whole."""
    pause_ms = 2000
    with RedisServer(tmp_path / "redis") as rs:
        with _server(tmp_path, "writer", _args(rs, 30.0)) as (client, _):
            client.register_kv_caches("src", _caches(STORE_CHUNKS, seed=1), model_name="m")
            _burst(client, first=100, n=1)  # the copy paths warm up, the backlog is empty
            _wait(lambda: _settled(client), timeout=30)
            _pause_writes(rs, pause_ms)
            took = _burst(client)
            # past the 8-chunk bound the stores waited for the SETs the pause held
            assert took >= pause_ms / 1000 * 0.5
            _wait(lambda: _settled(client), timeout=60)
            l2 = client.status()["l2"]
            wt, redis = l2["write_through"], l2["tiers"]["redis"]
            # stores waited (how long of the pause depends on how fast the burst filled
            # the bound; the burst's own time above shows it stalled)
            assert wt["waits"] > 0 and wt["waited_s"] > 0
            assert wt["dropped_chunks"] == 0 and wt["drop_bursts"] == 0
            assert redis["store_failures"] == 0 and redis["connected"] == 1
            assert redis["stored"] == (STORES + 1) * STORE_CHUNKS
        assert _redis_keys(rs) == (STORES + 1) * STORE_CHUNKS
        with _server(tmp_path, "reader", _args(rs, 30.0)) as (client, _):
            for i in range(STORES):
                got = client.lookup(_tokens(i), model_name="m", prefetch=False)
                assert got == STORE_CHUNKS * CHUNK, i


def test_a_burst_past_the_wait_drops_counted_and_logged_once(
    tmp_path: Path,
) -> None:
    """Wait 0.3 s, pause 4 s: the first two stores fill the bound, each later one waits
    0.3 s and drops its 4 chunks; status counts them, the log has one warning for the
    burst's first drop and one when it ends, and what was not dropped is in Redis."""
    pause_ms = 4000
    with RedisServer(tmp_path / "redis") as rs:
        with _server(tmp_path, "writer", _args(rs, 0.3)) as (client, log):
            client.register_kv_caches("src", _caches(STORE_CHUNKS, seed=1), model_name="m")
            _burst(client, first=100, n=1)
            _wait(lambda: _settled(client), timeout=30)
            _pause_writes(rs, pause_ms)
            _burst(client)
            wt = client.status()["l2"]["write_through"]
            dropped = wt["dropped_chunks"]
            # the first two stores filled the bound; the four after it dropped whole
            assert dropped == STORES * STORE_CHUNKS - BOUND_CHUNKS
            assert wt["drop_bursts"] == 1 and wt["dropping"]
            _wait(lambda: _settled(client), timeout=60)  # the pause ends, the SETs answer
            _burst(client, first=200, n=1)  # goes through whole: the burst ends
            _wait(lambda: _settled(client), timeout=30)
            l2 = client.status()["l2"]
            wt, redis = l2["write_through"], l2["tiers"]["redis"]
            assert wt["dropped_chunks"] == dropped and wt["drop_bursts"] == 1
            assert not wt["dropping"]
            assert redis["store_failures"] == dropped and redis["connected"] == 1
            assert redis["stored"] == (STORES + 2) * STORE_CHUNKS - dropped
            _wait(lambda: bool(_ended(log)))
            (ended,) = _ended(log)
            assert f"{dropped} chunks dropped in " in ended
            warned = [e for e in log.events("l2_store_end") if e.get("level") == "warning"]
            assert len(warned) == 1 and warned[0]["error"] == "l2_backlog"
        assert _redis_keys(rs) == (STORES + 2) * STORE_CHUNKS - dropped


def _ended(log: Log) -> list[str]:
    """The log's drop-burst-ended lines."""
    return [ln for ln in log.path.read_text().splitlines() if "l2_write_drop_burst_ended" in ln]
