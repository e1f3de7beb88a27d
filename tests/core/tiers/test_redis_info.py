"""The Redis tier's usage and capacity (INFO memory) and its close, on real redis-server
processes: capacity is maxmemory (one byte too), summed over a cluster's masters and 0
(unbounded) when any master is; a one-master cluster is read as such; a refused INFO is
named in last_error; INFO is read at most once a second and never twice at once; and
close() waits out a reconnect attempt in progress and leaves no cluster connection open.

Where a test needs the start-up refresh finished, it closes the tier first: close()
finishes the calls pending on the tier's I/O threads, and stats() still answers after."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvflow.core.tiers.redis import INFO_EVERY_S, RedisTier
from kvflow.core.tiers.redis_target import resolve_target
from tests.core.tiers import test_redis
from tests.core.tiers.test_redis import PREFIX
from tests.core.tiers.test_redis_faults import reconnectors, wait_for
from tests.support.redis_cluster import running_cluster
from tests.support.redis_servers import RedisServer, one_node_cluster, redis_server

MB = 1 << 20

server = test_redis.server  # the fixture: the shared server, emptied


def info_calls(server: RedisServer) -> int:
    """How many INFO commands the server ran since its last CONFIG RESETSTAT (the INFO
    that asks is counted only after it answers)."""
    with server.admin() as admin:
        stats = admin.info("commandstats")
    return int(stats.get("cmdstat_info", {}).get("calls", 0))


def kvflow_clients(client_list: list[dict[str, str]]) -> list[dict[str, str]]:
    """The connections the tier opened (it names them `kvflow`)."""
    return [c for c in client_list if c.get("name") == "kvflow"]


# -- single server -----------------------------------------------------------------------


def test_capacity_is_maxmemory_even_when_it_is_one_byte() -> None:
    """maxmemory 1 (one byte, not "unbounded") is reported as capacity 1, and usage is the
    server's used_memory (about a megabyte for an empty server)."""
    with redis_server(maxmemory="1") as made:
        tier = RedisTier(resolve_target(made.url(), environ={}), key_prefix=PREFIX)
        tier.close()  # the start-up INFO refresh is done
        stats = tier.stats()
    assert stats["capacity_bytes"] == 1
    assert 100_000 < stats["usage_bytes"] < 100 * MB
    assert tier.describe()["last_error"] is None


def test_a_refused_info_is_named_in_last_error_and_leaves_the_tier_connected() -> None:
    """An ACL user without INFO: the refresh fails with last_error naming the call and the
    refusal word for word; usage and capacity stay 0; the tier is not marked down (no
    reconnecting thread) and its objects still round-trip."""
    extra = ["user noinfo on >info-pw ~* &* +@all -info"]
    with redis_server(extra=extra) as made:
        tier = RedisTier(
            resolve_target(made.url("noinfo", "info-pw"), environ={}), key_prefix=PREFIX
        )
        try:
            test_redis._roundtrip(tier)
            assert not reconnectors()
            assert tier.stats()["connected"] == 1
        finally:
            tier.close()  # the start-up INFO refresh is done
    assert tier.describe()["last_error"] == (
        "info: NoPermissionError: this user has no permissions to run the 'info' command"
    )
    stats = tier.stats()
    assert stats["usage_bytes"] == 0 and stats["capacity_bytes"] == 0


def test_info_is_read_at_most_once_a_second_and_never_twice_at_once() -> None:
    """stats() within a second of the last INFO reads no new one; once due, the first
    stats() starts one refresh, and while that INFO is in flight (the server hung)
    further stats() calls start none: the server sees exactly one INFO."""
    with redis_server() as made:
        created = time.monotonic()
        tier = RedisTier(resolve_target(made.url(), environ={}), timeout_s=5.0)
        try:
            wait_for(lambda: tier.stats()["usage_bytes"] > 0)  # the start-up refresh
            with made.admin() as admin:
                admin.config_resetstat()
            refreshed = time.monotonic()
            for _ in range(10):
                tier.stats()
                time.sleep(0.01)
            # a refresh starts at most a second after the previous one ended (the first
            # ended after `created`), so this many could have been due by now
            allowed = int((time.monotonic() - created) / INFO_EVERY_S)
            assert info_calls(made) <= allowed

            with made.admin() as admin:
                admin.config_resetstat()
            made.hang()
            try:
                # past the second: the first stats() here that finds INFO due sends one,
                # which hangs; every later call finds it still in flight
                while time.monotonic() < refreshed + INFO_EVERY_S + 0.5:
                    tier.stats()
                    time.sleep(0.05)
            finally:
                made.resume()
        finally:
            tier.close()  # waits for the refresh (the server answers it after the resume)
        assert info_calls(made) == 1
        assert tier.describe()["last_error"] is None


def test_close_waits_for_a_reconnect_attempt_in_progress() -> None:
    """A tier whose server hangs goes down and its reconnecting thread's PING hangs too;
    close() during that attempt returns only once the attempt has timed out (within
    its timeout), so no reconnecting thread outlives the close."""
    timeout_s = 3.0
    with redis_server() as made:
        tier = RedisTier(resolve_target(made.url(), environ={}), timeout_s=timeout_s)
        made.hang()
        try:
            assert tier.contains([test_redis.key(1)]).result(timeout=10) == [False]
            assert tier.stats()["connected"] == 0
            # the link shows as down just before its reconnecting thread starts
            wait_for(lambda: len(reconnectors()) == 1, timeout=5)
            time.sleep(0.3)  # its first PING (after 0.05 s) is waiting on the hung server
            start = time.monotonic()
            tier.close()
            took = time.monotonic() - start
            assert not reconnectors()
        finally:
            made.resume()
    # one attempt's timeout, not a second one's (a busy 2-core CI box took 4.7 s once)
    assert took < 2 * timeout_s


# -- Redis Cluster -----------------------------------------------------------------------


@pytest.fixture
def one_master_cluster() -> Iterator[RedisServer]:
    """A Redis Cluster of one master holding all 16384 slots, maxmemory 48 MiB."""
    with one_node_cluster(maxmemory="48mb") as node:
        yield node


def test_a_one_master_cluster_reports_its_master_and_close_closes_its_connections(
    one_master_cluster: RedisServer,
) -> None:
    """A cluster with one master answers INFO as that one node (not per node): capacity
    is its maxmemory and usage its used_memory, with no error; close() closes every
    connection the tier opened to it."""
    made = one_master_cluster
    tier = RedisTier(resolve_target(made.url(), environ={}), cluster=True, key_prefix=PREFIX)
    with made.admin() as admin:
        test_redis._roundtrip(tier)
        assert kvflow_clients(admin.client_list())
        tier.close()  # the start-up INFO refresh is done
        # Redis may answer CLIENT LIST before it reads the closed sockets' EOF (same
        # event-loop turn): the connections go within moments, or never if left open.
        wait_for(lambda: kvflow_clients(admin.client_list()) == [], timeout=2)
        used = int(admin.info("memory")["used_memory"])
    stats = tier.stats()
    assert stats["capacity_bytes"] == 48 * MB
    assert used / 2 < stats["usage_bytes"] < used * 2
    assert tier.describe()["last_error"] is None


def test_cluster_capacity_sums_the_masters_and_is_0_if_any_is_unbounded(tmp_path: Path) -> None:
    """With maxmemory 64, 32 and 16 MiB on the three masters, capacity is 112 MiB and usage
    the sum of their used_memory; with one master's maxmemory 0 (unbounded), capacity
    is 0 although the others have a limit."""
    with running_cluster(tmp_path) as cluster:
        masters = cluster.masters()
        for node, mb in zip(masters, (64, 32, 16), strict=True):
            cluster.cmd(node, "CONFIG", "SET", "maxmemory", f"{mb}mb")
        tier = RedisTier(
            resolve_target(cluster.seed_url, environ={}), cluster=True, key_prefix=PREFIX
        )
        try:
            wait_for(lambda: tier.stats()["capacity_bytes"] == 112 * MB)
            used = sum(int(cluster.info(m, "memory")["used_memory"]) for m in masters)
            assert used / 1.5 < tier.stats()["usage_bytes"] < used * 1.5
            cluster.cmd(masters[1], "CONFIG", "SET", "maxmemory", "0")
            wait_for(lambda: tier.stats()["capacity_bytes"] == 0)
            assert tier.stats()["usage_bytes"] > used / 1.5
            assert tier.describe()["last_error"] is None
        finally:
            tier.close()


def test_close_closes_the_connections_to_a_single_server(server: RedisServer) -> None:
    """close() closes every connection the tier opened (at once, not when the garbage
    collector frees the pool: the tier is still referenced here). The server is shared:
    only connections opened after the test began are this tier's."""
    with server.admin() as admin:
        before = {c["id"] for c in admin.client_list()}
        tier = test_redis.make_tier(server)

        def opened() -> list[dict[str, str]]:
            return [c for c in kvflow_clients(admin.client_list()) if c["id"] not in before]

        test_redis._roundtrip(tier)
        assert opened()
        tier.close()
        wait_for(lambda: opened() == [], timeout=2)  # Redis reads the EOFs on its next turn
