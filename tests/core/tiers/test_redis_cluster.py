"""The Redis tier on a real three-master Redis Cluster (redis-server processes started
by tests/support/redis_cluster.py): keys spread over every master, batch questions
pipelined per node, slots moved under a live tier, a master killed (and its replica
promoted), and credentials that never show in what the tier reports or logs."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from kvflow.core.tiers.base import STAT_KEYS, ObjectKey
from kvflow.core.tiers.redis import RedisTier
from kvflow.core.tiers.redis_target import resolve_target
from tests.support.redis_cluster import ClusterNode, RedisCluster, running_cluster

T = TypeVar("T")
N = 300  # objects per test
NBYTES = 2048
PREFIX = "kvflow-test:"
TIMEOUT_S = 1.0
SECRET = "Cl5ter-s3cret-9f2e71"  # distinctive, so a leak of it anywhere is found


def key(i: int, model: str = "org/model") -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), model, 1, 0, None)


def payload(i: int, nbytes: int = NBYTES) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def answer(future: Future[T], timeout: float = 30.0) -> T:
    return future.result(timeout=timeout)


def store_all(tier: RedisTier, ids: Sequence[int]) -> None:
    outcome = answer(tier.store([(key(i), payload(i)) for i in ids]))
    assert outcome.stored == len(ids) and outcome.failed == 0, outcome


def load_all(tier: RedisTier, ids: Sequence[int]) -> tuple[list[bool], list[torch.Tensor]]:
    dsts = [torch.zeros(NBYTES, dtype=torch.uint8) for _ in ids]
    return answer(tier.load([key(i) for i in ids], dsts)), dsts


def held_by(tier: RedisTier, ids: Sequence[int]) -> list[bool]:
    got: list[bool] = answer(tier.contains([key(i) for i in ids]))
    return got


def failures(tier: RedisTier) -> int:
    """Every failure the tier's stats count (store, lookup, load...)."""
    return sum(v for k, v in tier.stats().items() if k.endswith("_failures"))


def our_keys_by_node(cluster: RedisCluster) -> dict[int, list[bytes]]:
    """The keys under PREFIX each live master holds, by port."""
    return {m.port: cluster.keys(m, PREFIX + "*") for m in cluster.masters()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three masters, no replicas, no password (shared by the tests that change nothing
    beyond their own keys: each test flushes first)."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture
def fresh(cluster: RedisCluster) -> RedisCluster:
    """The module's cluster, emptied, with its statistics reset."""
    for node in cluster.masters():
        cluster.cmd(node, "FLUSHALL")
    cluster.reset_stats()
    return cluster


@pytest.fixture
def tiers() -> Iterator[list[RedisTier]]:
    made: list[RedisTier] = []
    yield made
    for tier in made:
        tier.close()


def make_tier(tiers: list[RedisTier], url: str, **kwargs: Any) -> RedisTier:
    kwargs.setdefault("environ", {})
    environ = kwargs.pop("environ")
    target = resolve_target(url, environ=environ)
    tier = RedisTier(target, cluster=True, key_prefix=PREFIX, timeout_s=TIMEOUT_S, **kwargs)
    tiers.append(tier)
    return tier


# -- spread and round trip ---------------------------------------------------------------


def test_round_trip_is_bit_exact_and_keys_spread_over_every_master(
    fresh: RedisCluster, tiers: list[RedisTier]
) -> None:
    """300 objects come back bit-exact, and their keys (one prefix, no hash tag) land on
    all three masters in many slots."""
    tier = make_tier(tiers, fresh.seed_url)
    ids = list(range(N))
    store_all(tier, ids)
    ok, dsts = load_all(tier, ids)
    assert all(ok)
    for i, dst in zip(ids, dsts, strict=True):
        assert torch.equal(dst, payload(i)), i
    by_node = our_keys_by_node(fresh)
    assert len(by_node) == 3
    counts = {port: len(keys) for port, keys in by_node.items()}
    assert all(c > N // 10 for c in counts.values()), counts  # every master holds a share
    every = [k for keys in by_node.values() for k in keys]
    assert all(k.startswith(PREFIX.encode()) for k in every)
    slots = {fresh.keyslot(k) for k in every}
    assert len(slots) > N // 2, f"{N} objects in only {len(slots)} slots (a hash tag?)"


def test_batch_contains_answers_per_key_and_is_pipelined_per_node(
    fresh: RedisCluster, tiers: list[RedisTier]
) -> None:
    """contains() of 300 keys spread over the nodes answers each key right (held or
    not), in far fewer round trips per node than keys (the batch is grouped per node)."""
    tier = make_tier(tiers, fresh.seed_url)
    held = [i for i in range(N) if i % 3 != 1]
    store_all(tier, held)
    answer(tier.contains([key(0)]))  # connections and slot map in place before counting
    fresh.reset_stats()
    got = answer(tier.contains([key(i) for i in range(N)]))
    assert got == [i % 3 != 1 for i in range(N)]
    reads = {}
    for node in fresh.masters():
        stats = fresh.info(node, "stats")
        commands = fresh.info(node, "commandstats")
        # minus this test's own INFO calls (two so far on this node) and its RESETSTAT
        reads[node.port] = int(stats["total_reads_processed"]) - 2
        served = sum(
            v["calls"]
            for k, v in commands.items()
            if not k.startswith(("cmdstat_info", "cmdstat_config", "cmdstat_cluster"))
        )
        assert served > 0, f"{node.address} answered none of the batch"
    # one socket read per command would be ~100 per node; a pipeline per node needs a few
    assert sum(reads.values()) <= N // 10, reads


# -- slots moved under a live tier --------------------------------------------------------


def test_slots_moved_to_another_master_are_followed(
    fresh: RedisCluster, tiers: list[RedisTier]
) -> None:
    """Slots holding our keys migrate to another master while the tier is live (ASK
    mid-migration, MOVED after): loads and questions still answer every key right, and
    new stores go to the new owner."""
    tier = make_tier(tiers, fresh.seed_url)
    ids = list(range(N))
    store_all(tier, ids)
    assert all(held_by(tier, ids))  # slot map cached
    src, dst = fresh.masters()[0], fresh.masters()[1]
    slots = sorted({fresh.keyslot(k) for k in fresh.keys(src, PREFIX + "*")})[:5]
    moving = slots[0]

    def midway() -> None:  # slot `moving` half migrated: its keys answer via ASK
        ok, dsts = load_all(tier, ids)
        assert all(ok)
        assert all(torch.equal(d, payload(i)) for i, d in zip(ids, dsts, strict=True))

    fresh.reset_stats()
    moved = sum(fresh.move_slot(s, dst, during=midway if s == moving else None) for s in slots)
    assert moved >= len(slots)
    ok, dsts = load_all(tier, ids)
    assert all(ok)
    assert all(torch.equal(d, payload(i)) for i, d in zip(ids, dsts, strict=True))
    assert all(held_by(tier, ids))
    errors = fresh.info(src, "errorstats")
    assert errors.get("errorstat_MOVED", {}).get("count", 0) > 0, errors  # really redirected
    assert errors.get("errorstat_ASK", {}).get("count", 0) > 0, errors
    # objects stored now whose slots moved land on the new owner
    new_ids = [i for i in range(N, 3 * N) if fresh.keyslot(tier.redis_key(key(i))) in slots]
    assert new_ids
    store_all(tier, new_ids)
    ok, _ = load_all(tier, new_ids)
    assert all(ok)
    assert not [k for k in fresh.keys(src, PREFIX + "*") if fresh.keyslot(k) in slots]
    assert failures(tier) == 0


# -- a master killed ----------------------------------------------------------------------


def _split_by_node(
    cluster: RedisCluster, tier: RedisTier, node: ClusterNode, ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(ids whose key lives on `node`, the others)."""
    there = set(cluster.keys(node, PREFIX + "*"))
    on = [i for i in ids if tier.redis_key(key(i)) in there]
    return on, [i for i in ids if i not in set(on)]


def _load_until(tier: RedisTier, ids: Sequence[int], timeout: float) -> list[bool]:
    """Load until every id hits (the tier reconnects with backoff) or the time is up."""
    deadline = time.monotonic() + timeout
    while True:
        ok, dsts = load_all(tier, ids)
        if all(ok) or time.monotonic() > deadline:
            assert all(
                torch.equal(d, payload(i)) for i, d, hit in zip(ids, dsts, ok, strict=True) if hit
            )
            return ok
        time.sleep(0.2)


def test_a_killed_master_is_a_bounded_miss_and_its_replica_takes_over(
    tmp_path: Path, tiers: list[RedisTier]
) -> None:
    """SIGKILL of a master: its keys answer False within about the timeout (no exception
    out of a future, failures counted); once its replica is promoted every key written
    before (replicated) loads bit-exact again."""
    with running_cluster(tmp_path, replicas=True) as cluster:
        tier = make_tier(tiers, cluster.seed_url)
        ids = list(range(N))
        store_all(tier, ids)
        cluster.wait_replicated()
        victim = cluster.masters()[0]  # the seed node, too
        on_victim, elsewhere = _split_by_node(cluster, tier, victim, ids)
        assert on_victim and elsewhere
        before = failures(tier)

        cluster.kill(victim)
        start = time.monotonic()
        held = tier.contains([key(i) for i in ids]).result(timeout=10 * TIMEOUT_S)
        ok, _ = load_all(tier, ids)
        outcome = answer(tier.store([(key(i), payload(i)) for i in range(N, N + 30)]))
        elapsed = time.monotonic() - start
        assert elapsed < 3 * (2 * TIMEOUT_S) + 1.0, elapsed  # three calls, each bounded
        assert not any(held[i] for i in on_victim)
        assert not any(ok[i] for i in on_victim)
        assert outcome.stored + outcome.present + outcome.failed == 30
        assert failures(tier) > before
        assert tier.describe()["last_error"]

        cluster.wait_failover(victim)
        ok = _load_until(tier, ids, timeout=15)
        assert all(ok), f"{ok.count(False)} of {len(ok)} keys still missing after failover"
        assert all(held_by(tier, ids))
        assert tier.stats()["connected"] == 1


def test_a_restarted_master_without_replica_comes_back_empty(
    tmp_path: Path, tiers: list[RedisTier]
) -> None:
    """Without replicas or persistence a killed master's keys miss (False, no exception)
    while it is down and still miss after it restarts empty; the other masters' keys
    hit again and new stores of its keys land on it."""
    with running_cluster(tmp_path) as cluster:
        tier = make_tier(tiers, cluster.seed_url)
        ids = list(range(N))
        store_all(tier, ids)
        victim = cluster.masters()[1]
        on_victim, elsewhere = _split_by_node(cluster, tier, victim, ids)
        cluster.kill(victim)
        ok, _ = load_all(tier, ids)
        assert not any(ok[i] for i in on_victim)
        cluster.restart(victim)
        assert cluster.dbsize(victim) == 0
        assert all(_load_until(tier, elsewhere, timeout=15))
        ok, _ = load_all(tier, on_victim)
        assert not any(ok)  # gone with the process: no persistence, no replica
        deadline = time.monotonic() + 15
        while True:
            outcome = answer(tier.store([(key(i), payload(i)) for i in on_victim]))
            if outcome.failed == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert outcome.failed == 0, outcome
        assert all(_load_until(tier, on_victim, timeout=5))
        assert cluster.dbsize(victim) == len(on_victim)


def test_the_other_masters_keep_serving_while_one_is_down(
    tmp_path: Path, tiers: list[RedisTier]
) -> None:
    """A master down for good (no replica) costs only its own keys: after at most a few
    seconds, the keys on the two live masters answer True and load bit-exact again."""
    with running_cluster(tmp_path) as cluster:
        tier = make_tier(tiers, cluster.seed_url)
        ids = list(range(N))
        store_all(tier, ids)
        victim = cluster.masters()[1]
        on_victim, elsewhere = _split_by_node(cluster, tier, victim, ids)
        cluster.kill(victim)
        deadline = time.monotonic() + 6
        while True:
            held = answer(tier.contains([key(i) for i in ids]))
            ok, dsts = load_all(tier, ids)
            if all(held[i] and ok[i] for i in elsewhere) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(held[i] for i in elsewhere)
        assert all(ok[i] for i in elsewhere)
        assert all(torch.equal(dsts[i], payload(i)) for i in elsewhere)
        assert not any(held[i] or ok[i] for i in on_victim)


# -- credentials --------------------------------------------------------------------------


@pytest.mark.parametrize("via", ["url", "environment"])
def test_credentials_never_appear_in_stats_describe_repr_or_logs(
    tmp_path: Path,
    tiers: list[RedisTier],
    via: str,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A cluster with requirepass/masterauth, authenticated through the URL or
    KVFLOW_REDIS_PASSWORD: round trips work, and the password shows in none of stats(),
    describe(), the reprs, or any log line -- even after a node dies and errors flow."""
    caplog.set_level(logging.DEBUG)
    with running_cluster(tmp_path, password=SECRET) as cluster:
        if via == "url":
            tier = make_tier(tiers, cluster.url_with_password())
        else:
            tier = make_tier(tiers, cluster.seed_url, environ={"KVFLOW_REDIS_PASSWORD": SECRET})
        ids = list(range(60))
        store_all(tier, ids)
        ok, dsts = load_all(tier, ids)
        assert all(ok)
        assert all(torch.equal(d, payload(i)) for i, d in zip(ids, dsts, strict=True))
        cluster.kill(cluster.masters()[2])  # errors, reconnects and their log lines
        load_all(tier, ids)
        answer(tier.store([(key(i), payload(i)) for i in range(100, 160)]))
        shown = [
            json.dumps(tier.stats()),
            json.dumps(tier.describe(), default=str),
            repr(tier),
            str(tier),
            repr(tier.target) if hasattr(tier, "target") else "",
            caplog.text,
        ]
        assert tier.stats().keys() >= set(STAT_KEYS)
        assert failures(tier) > 0
        tier.close()

        wrong = "not-the-Cl5ter-pa55"
        with pytest.raises(ValueError) as refused:
            if via == "url":
                make_tier(tiers, f"redis://:{wrong}@127.0.0.1:{cluster.nodes[0].port}")
            else:
                make_tier(tiers, cluster.seed_url, environ={"KVFLOW_REDIS_PASSWORD": wrong})
        message = str(refused.value)
        assert ("--l2-redis URL" if via == "url" else "KVFLOW_REDIS_PASSWORD") in message
        assert wrong not in message
        out, err = capfd.readouterr()
        shown += [out, err, caplog.text, message, repr(refused.value)]
        for text in shown:
            assert SECRET not in text, text


def test_a_cluster_unreachable_at_start_up_is_joined_when_its_seed_answers(
    tmp_path: Path, tiers: list[RedisTier]
) -> None:
    """A cluster tier whose seed node is down at start-up (no slot map, no client yet)
    starts disconnected, and connects by itself once the seed answers again."""
    with running_cluster(tmp_path) as cluster:
        seed = cluster.nodes[0]
        cluster.kill(seed)
        tier = make_tier(tiers, cluster.seed_url)
        assert tier.stats()["connected"] == 0
        assert tier.describe()["nodes"] == []
        cluster.restart(seed)
        deadline = time.monotonic() + 20
        while tier.stats()["connected"] != 1:
            assert time.monotonic() < deadline, "the tier never joined the cluster"
            time.sleep(0.05)
        assert tier.stats()["reconnects"] == 1
        assert len(tier.describe()["nodes"]) == 3
