"""The Redis tier's construction on real redis-server processes: each refused argument's
exact message, the documented defaults (key prefix, timeout, pool size), the counts of a
tier that never reached Redis, its I/O threads' names, a timeout that is not retried and a
disconnected tier that sends nothing, TLS to a Redis Cluster and the per-node pool a
cluster tier sizes by pool_size, and the refusal of calls after close."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.redis import RedisTier
from kvflow.core.tiers.redis_target import RedisTarget, resolve_target
from tests.core.tiers import test_redis
from tests.core.tiers.test_redis import answer, key, payload
from tests.core.tiers.test_redis_faults import wait_for
from tests.support.collectors import free_port
from tests.support.redis_servers import (
    RedisServer,
    one_node_cluster,
    redis_server,
    require_tls,
)

server = test_redis.server  # the fixture: the shared server, emptied


def exactly(message: str) -> str:
    """A `pytest.raises(match=...)` pattern for this whole message."""
    return f"^{re.escape(message)}$"


def nowhere(db: int = 0) -> RedisTarget:
    """A target on a loopback port nothing listens on."""
    return RedisTarget(host="127.0.0.1", port=free_port(), db=db)


PREFIX_EMPTY = "--l2-redis-key-prefix must be a non-empty string"
PREFIX_TAG = (
    "--l2-redis-key-prefix must not contain '{' or '}' with --l2-redis-cluster: a "
    "hash tag would put every object in one slot"
)
TIMEOUT = "--l2-redis-timeout-s must be a number > 0"
POOL = "--l2-redis-pool-size must be an integer >= 1"
CLUSTER_DB = "--l2-redis: Redis Cluster has only database 0 (use /0 or no path)"


@pytest.mark.parametrize(
    ("db", "kwargs", "message"),
    [
        (0, {"key_prefix": ""}, PREFIX_EMPTY),
        (0, {"key_prefix": None}, PREFIX_EMPTY),
        (0, {"cluster": True, "key_prefix": "kv{"}, PREFIX_TAG),
        (0, {"cluster": True, "key_prefix": "kv}"}, PREFIX_TAG),
        (0, {"cluster": True, "key_prefix": "{kv}"}, PREFIX_TAG),
        (0, {"timeout_s": True}, TIMEOUT),  # a bool is not a number of seconds
        (0, {"timeout_s": "1"}, TIMEOUT),
        (0, {"timeout_s": 0}, TIMEOUT),
        (0, {"timeout_s": -1.0}, TIMEOUT),
        (0, {"timeout_s": float("inf")}, TIMEOUT),
        (0, {"timeout_s": float("nan")}, TIMEOUT),
        (0, {"pool_size": 0}, POOL),
        (0, {"pool_size": True}, POOL),  # a bool is not a count of threads
        (0, {"pool_size": 2.5}, POOL),
        (1, {"cluster": True}, CLUSTER_DB),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) or len(v) < 20 else v[:20],
)
def test_each_bad_argument_is_refused_with_its_flags_exact_message(
    db: int, kwargs: dict[str, Any], message: str
) -> None:
    """Each argument a user can get wrong (an empty prefix, a hash tag in a cluster's
    prefix, a timeout or pool size that is no positive number, a cluster database other
    than 0) is a ValueError naming its flag, word for word, before any connection."""
    with pytest.raises(ValueError, match=exactly(message)):
        RedisTier(nowhere(db), **kwargs)


def test_the_defaults_are_the_documented_prefix_timeout_and_pool(server: RedisServer) -> None:
    """Without options the tier stores under "kvflow:", waits 1 s per call and runs 8 I/O
    threads, as describe() reports."""
    tier = RedisTier(resolve_target(server.url(), environ={}))
    try:
        k = ObjectKey(bytes(range(32)), "org/m", 1, 0, None)
        assert answer(tier.store([(k, payload(1, 16))])).stored == 1
        assert server.admin().keys("*") == [
            b"kvflow:org%2Fm#1#0#-:" + bytes(range(32)).hex().encode()
        ]
        info = tier.describe()
        assert (info["key_prefix"], info["timeout_s"], info["pool_size"]) == ("kvflow:", 1.0, 8)
    finally:
        tier.close()


def test_a_tier_that_never_reached_redis_reports_zero_counts() -> None:
    """A tier whose Redis is not there reports no usage, no capacity and no objects (not
    a stale or made-up figure), that it is disconnected and why."""
    tier = RedisTier(nowhere(), timeout_s=0.5)
    try:
        assert tier.stats() == {
            "usage_bytes": 0,
            "capacity_bytes": 0,
            "objects": 0,
            "evicted_chunks": 0,
            "evicted_bytes": 0,
            "pinned": 0,
            "store_failures": 0,
            "load_failures": 0,
            "lookup_failures": 0,
            "corrupt_objects": 0,
            "missing_objects": 0,
            "reconnects": 0,
            "connected": 0,
        }
        described = tier.describe()
        assert described["connected"] is False
        # the failed first PING is named as the connect, with its error
        assert described["last_error"].startswith("connect: ConnectionError: ")
    finally:
        tier.close()


def test_the_io_threads_are_named_kvflow_redis(server: RedisServer) -> None:
    """The tier's I/O runs on its own threads named kvflow-redis_<n> (what a thread dump
    or a log line's thread name shows), not on the caller's."""
    tier = RedisTier(resolve_target(server.url(), environ={}), key_prefix="kvtest:")
    seen: list[str] = []

    def record(k: Any) -> bool:
        seen.append(threading.current_thread().name)
        return False

    try:
        answer(tier.store([(key(i), payload(i, 16)) for i in range(3)]))
        assert tier.drop_where(record) == 0
        assert len(seen) == 3
        assert all(re.fullmatch(r"kvflow-redis_\d+", name) for name in seen), seen
    finally:
        tier.close()


def test_a_timeout_is_not_retried_and_a_disconnected_tier_sends_nothing() -> None:
    """On a hung server (SIGSTOP) a store's pipeline fails after one timeout, not two
    (only a broken connection is retried); the tier is then disconnected, and drop_where
    answers 0 at once instead of waiting on the hung server. After SIGCONT it rejoins."""
    timeout_s = 1.0
    with redis_server() as hung:
        tier = RedisTier(resolve_target(hung.url(), environ={}), timeout_s=timeout_s)
        try:
            assert answer(tier.store([(key(1), payload(1, 16))])).stored == 1
            hung.hang()
            try:
                start = time.monotonic()
                outcome = answer(tier.store([(key(2), payload(2, 16))]))
                took = time.monotonic() - start
                assert outcome.failed == 1
                assert 0.9 * timeout_s <= took < 1.7 * timeout_s  # a retry would take 2 timeouts
                assert tier.stats()["connected"] == 0
                start = time.monotonic()
                assert tier.drop_where(lambda k: True) == 0
                assert time.monotonic() - start < 0.3 * timeout_s
            finally:
                hung.resume()
            wait_for(lambda: tier.stats()["connected"] == 1)
            assert answer(tier.contains([key(1)])) == [True]  # (key 2 may land late)
        finally:
            tier.close()


@pytest.fixture
def tls_cluster() -> Iterator[RedisServer]:
    """A one-node Redis Cluster listening with TLS only."""
    require_tls()
    with one_node_cluster(tls=True) as node:
        yield node


@pytest.fixture
def cluster_node() -> Iterator[RedisServer]:
    """A one-node Redis Cluster without TLS."""
    with one_node_cluster() as node:
        yield node


def test_a_cluster_is_reached_over_tls(tls_cluster: RedisServer) -> None:
    """A rediss:// URL with --l2-redis-cluster talks TLS to the cluster's nodes (CA from
    KVFLOW_REDIS_CA): it connects, and objects round-trip."""
    target = resolve_target(
        tls_cluster.url(), environ={"KVFLOW_REDIS_CA": str(tls_cluster.ca_file)}
    )
    tier = RedisTier(target, cluster=True, key_prefix="kvtest:", timeout_s=2.0)
    try:
        assert tier.describe()["connected"] is True
        assert answer(tier.store([(key(1), payload(1, 64))])).stored == 1
        dst = torch.zeros(64, dtype=torch.uint8)
        assert answer(tier.load([key(1)], [dst])) == [True]
        assert torch.equal(dst, payload(1, 64))
    finally:
        tier.close()


def test_a_cluster_tier_runs_pool_size_calls_on_one_node_at_once(
    cluster_node: RedisServer,
) -> None:
    """The per-node connection pool of a cluster tier follows --l2-redis-pool-size: with
    110 I/O threads (more than redis-py's default of 100 connections per node), 110
    lookups held up together on one node (CLIENT PAUSE) all answer once it resumes, and
    none fails for want of a connection."""
    tier = RedisTier(
        resolve_target(cluster_node.url(), environ={}),
        cluster=True,
        key_prefix="kvtest:",
        timeout_s=10.0,
        pool_size=110,
    )
    admin = cluster_node.admin()
    try:
        assert answer(tier.store([(key(1), payload(1, 16))])).stored == 1
        admin.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        futures = [tier.contains([key(1)]) for _ in range(110)]
        assert [answer(f, timeout=30) for f in futures] == [[True]] * 110
        assert tier.stats()["lookup_failures"] == 0
    finally:
        admin.close()
        tier.close()


def test_every_call_after_close_says_the_tier_is_closed(server: RedisServer) -> None:
    """After close, each call raises RuntimeError("the redis tier is closed")."""
    tier = RedisTier(resolve_target(server.url(), environ={}), key_prefix="kvtest:")
    tier.close()
    dst = torch.zeros(16, dtype=torch.uint8)
    calls = [
        lambda: tier.contains([key(1)]),
        lambda: tier.store([(key(1), payload(1, 16))]),
        lambda: tier.load([key(1)], [dst]),
        lambda: tier.pin([key(1)]),
        lambda: tier.unpin([key(1)]),
        lambda: tier.drop_where(lambda k: True),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=exactly("the redis tier is closed")):
            call()
