"""The Redis tier's stores and loads on a real redis-server, exactly: how a call's
objects are split into pipelines by bytes, the counters of failed and partly failed
stores and loads (each call adds to them), the exact refusals of bad arguments, the
longest key a value's header can name, and an error as the tier reports it (one line,
at most 300 characters, credentials masked)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from kvflow.core.tiers import redis as redis_tier
from kvflow.core.tiers.base import StoreOutcome
from kvflow.core.tiers.redis import MAX_KEY_BYTES, RedisTier
from kvflow.core.tiers.redis_target import resolve_target
from tests.core.tiers import test_redis
from tests.core.tiers.test_redis import SECRET, answer, key, payload
from tests.core.tiers.test_redis_faults import messages, wait_for
from tests.support.collectors import free_port
from tests.support.redis_servers import RedisServer, redis_server
from tests.support.relay import TcpRelay

server = test_redis.server  # the fixtures: the shared server emptied, a tier on it
tier = test_redis.tier

OUTAGE = "L2 Redis {} unreachable ({}); calls fail fast until it answers again"


def zeros(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


def counts(tier: RedisTier) -> dict[str, int]:
    """The tier's object count and the counters a load or store moves."""
    stats = tier.stats()
    names = ("objects", "load_failures", "missing_objects", "corrupt_objects", "store_failures")
    return {name: stats[name] for name in names}


class SendLog:
    """Records, for every command buffer the tier writes to Redis that names some of
    `names` (or is empty), the indexes of the names in it: one entry per pipeline."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, names: list[bytes]) -> None:
        self.sent: list[tuple[int, ...]] = []
        original = redis.Connection.send_packed_command

        def recording(conn: redis.Connection, command: Any, *args: Any, **kwargs: Any) -> Any:
            chunks = [command] if isinstance(command, (bytes, str)) else command
            data = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)
            held = tuple(i for i, name in enumerate(names) if name in data)
            if held or not data:  # (not the connection's own AUTH, SETNAME, INFO)
                self.sent.append(held)
            return original(conn, command, *args, **kwargs)

        monkeypatch.setattr(redis.Connection, "send_packed_command", recording)


def break_sends(tier: RedisTier, monkeypatch: pytest.MonkeyPatch, message: str) -> None:
    """Every command written to Redis fails with ConnectionError(message) until undone,
    once the tier's start-up INFO has landed (so that the next call is the first to fail,
    and no INFO is due for a second)."""
    wait_for(lambda: tier.stats()["usage_bytes"] > 0)

    def broken(conn: redis.Connection, *args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError(message)

    monkeypatch.setattr(redis.Connection, "send_packed_command", broken)


# -- batches ----------------------------------------------------------------------------------

#: object sizes against a 100-byte batch limit: a first object over the limit alone, a
#: batch that the next object would overflow, one filled exactly, then two of two
SIZES = [150, 60, 50, 50, 40, 40, 40]
BATCHES = [(0,), (1,), (2, 3), (4, 5), (6,)]


def test_stores_and_loads_are_pipelined_in_batches_of_at_most_the_limit_in_bytes(
    tier: RedisTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store (BATCH_BYTES) and a load (LOAD_BATCH_BYTES) send consecutive objects in
    one pipeline until the next would take it over the limit (a batch may reach it
    exactly; an object over it goes alone): each object once, no empty pipeline."""
    monkeypatch.setattr(redis_tier, "BATCH_BYTES", 100)
    monkeypatch.setattr(redis_tier, "LOAD_BATCH_BYTES", 100)
    keys = [key(i) for i in range(len(SIZES))]
    names = [tier.redis_key(k) for k in keys]
    items = [(k, payload(i, n)) for i, (k, n) in enumerate(zip(keys, SIZES, strict=True))]

    stores = SendLog(monkeypatch, names)
    assert answer(tier.store(items)) == StoreOutcome(stored=len(SIZES))
    assert sorted(stores.sent) == BATCHES

    loads = SendLog(monkeypatch, names)
    dsts = [zeros(n) for n in SIZES]
    assert answer(tier.load(keys, dsts)) == [True] * len(SIZES)
    assert sorted(loads.sent) == BATCHES
    for (_, src), dst in zip(items, dsts, strict=True):
        assert torch.equal(src, dst)


# -- store ------------------------------------------------------------------------------------


def test_a_store_whose_link_breaks_fails_and_counts_every_key_and_reports_the_outage(
    tier: RedisTier,
    server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store whose pipeline cannot be sent answers all its keys failed, counts each in
    store_failures, marks the tier down and logs the outage naming the store; once
    rejoined, a good store adds nothing to the failures."""
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    break_sends(tier, monkeypatch, "link broken by the test")
    items = [(key(i), payload(i, 64)) for i in range(3)]
    assert answer(tier.store(items)) == StoreOutcome(failed=3)
    assert counts(tier)["store_failures"] == 3
    assert tier.stats()["connected"] == 0
    assert messages(caplog, logging.WARNING) == [
        OUTAGE.format(server.url(), "store: ConnectionError: link broken by the test")
    ]
    monkeypatch.undo()
    wait_for(lambda: tier.stats()["connected"] == 1)
    assert answer(tier.store(items)) == StoreOutcome(stored=3)
    assert counts(tier) == {
        "objects": 3,
        "load_failures": 0,
        "missing_objects": 0,
        "corrupt_objects": 0,
        "store_failures": 3,
    }


def test_error_replies_to_a_store_add_to_its_failures_and_name_the_store() -> None:
    """Under noeviction past maxmemory every SET is refused (OOM): each store fails its
    keys, adds them to store_failures, names the store and Redis's answer in
    last_error, and leaves the tier connected."""
    with redis_server(maxmemory="1", policy="noeviction") as full:
        tier = test_redis.make_tier(full)
        try:
            assert answer(tier.store([(key(i), payload(i, 64)) for i in range(2)])) == (
                StoreOutcome(failed=2)
            )
            assert answer(tier.store([(key(2), payload(2, 64))])) == StoreOutcome(failed=1)
            assert counts(tier)["store_failures"] == 3
            assert counts(tier)["objects"] == 0
            assert tier.describe()["last_error"] == (
                "store: OutOfMemoryError: command not allowed when used memory > 'maxmemory'."
            )
            assert tier.stats()["connected"] == 1
        finally:
            tier.close()


def test_an_empty_store_answers_an_empty_outcome(tier: RedisTier) -> None:
    """store([]) answers StoreOutcome() at once (all zero), not None."""
    assert answer(tier.store([])) == StoreOutcome()


def test_a_key_of_the_longest_length_a_header_names_round_trips_and_one_more_is_refused(
    tier: RedisTier,
) -> None:
    """A Redis key of exactly MAX_KEY_BYTES stores and loads back; one byte longer is a
    ValueError saying the length and the limit, and nothing of that store is written."""
    base = len(tier.redis_key(key(1, model="")))
    longest = key(1, model="m" * (MAX_KEY_BYTES - base))
    assert len(tier.redis_key(longest)) == MAX_KEY_BYTES
    assert answer(tier.store([(longest, payload(1, 64))])) == StoreOutcome(stored=1)
    dst = zeros(64)
    assert answer(tier.load([longest], [dst])) == [True]
    assert torch.equal(dst, payload(1, 64))

    too_long = key(2, model="m" * (MAX_KEY_BYTES - base + 1))
    with pytest.raises(ValueError) as info:
        tier.store([(key(3), payload(3, 64)), (too_long, payload(2, 64))])
    assert str(info.value) == (
        f"the redis tier cannot store a key of {MAX_KEY_BYTES + 1} bytes (model name and "
        f"cache salt too long): at most {MAX_KEY_BYTES}"
    )
    assert answer(tier.contains([key(3)])) == [False]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ("store", "items' bytes[1] must be a 1-D uint8 CPU tensor, got torch.float32 (4,) on cpu"),
        ("load", "dsts[1] must be a 1-D uint8 CPU tensor, got torch.uint8 (2, 2) on cpu"),
    ],
)
def test_a_bad_buffer_is_refused_naming_the_argument_and_its_index(
    tier: RedisTier, call: str, expected: str
) -> None:
    """The ValueError of a bad buffer names the argument (a store's items' bytes, a
    load's dsts), the buffer's index and what it is."""
    with pytest.raises(ValueError) as info:
        if call == "store":
            tier.store([(key(0), payload(0, 4)), (key(1), torch.zeros(4))])
        else:
            tier.load([key(0), key(1)], [zeros(4), torch.zeros((2, 2), dtype=torch.uint8)])
    assert str(info.value) == expected


# -- load -------------------------------------------------------------------------------------


def test_each_load_adds_its_misses_and_corrupt_values_and_corrupt_ones_leave_the_count(
    tier: RedisTier, server: RedisServer
) -> None:
    """Every load adds its failures (missing plus corrupt), missing and corrupt values to
    the counters; each corrupt value deleted takes one off `objects`, never below 0."""
    answer(tier.store([(key(i), payload(i, 64)) for i in range(2)]))
    admin = server.admin()
    admin.set(tier.redis_key(key(0)), b"garbage")
    dsts = [zeros(64) for _ in range(3)]
    assert answer(tier.load([key(0), key(1), key(2)], dsts)) == [False, True, False]
    assert counts(tier) == {
        "objects": 1,
        "load_failures": 2,
        "missing_objects": 1,
        "corrupt_objects": 1,
        "store_failures": 0,
    }
    admin.set(tier.redis_key(key(1)), b"garbage")
    assert answer(tier.load([key(1), key(3)], dsts[:2])) == [False, False]
    assert counts(tier) == {
        "objects": 0,
        "load_failures": 4,
        "missing_objects": 2,
        "corrupt_objects": 2,
        "store_failures": 0,
    }
    assert answer(tier.load([key(4)], dsts[:1])) == [False]
    assert counts(tier)["objects"] == 0 and counts(tier)["missing_objects"] == 3


def test_a_load_while_disconnected_fails_and_counts_every_key() -> None:
    """A tier that cannot reach Redis answers each key of a load False at once and counts
    every one of them in load_failures."""
    target = resolve_target(f"redis://127.0.0.1:{free_port()}/0", environ={})
    tier = RedisTier(target, timeout_s=0.5)
    try:
        assert tier.stats()["connected"] == 0
        dsts = [zeros(16) for _ in range(3)]
        assert answer(tier.load([key(i) for i in range(3)], dsts)) == [False] * 3
        assert counts(tier)["load_failures"] == 3
    finally:
        tier.close()


# -- error text -------------------------------------------------------------------------------


def test_an_error_is_reported_as_one_line_of_at_most_300_characters_with_no_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An error whose text holds the password, line breaks and 400 more characters is
    reported with the password as '***', its whitespace runs as one space, and cut to
    300 characters."""
    caplog.set_level(logging.WARNING, logger="kvflow.tiers.redis")
    with RedisServer(tmp_path, password=SECRET) as locked:
        tier = RedisTier(resolve_target(locked.url(password=SECRET), environ={}), timeout_s=2.0)
        try:
            break_sends(tier, monkeypatch, f"peer at {SECRET} said\n\t goodbye " + "x" * 400)
            assert answer(tier.store([(key(1), payload(1, 64))])) == StoreOutcome(failed=1)
            said = ("ConnectionError: peer at *** said goodbye " + "x" * 400)[:300]
            assert messages(caplog, logging.WARNING) == [
                OUTAGE.format(tier.target.safe_url(), f"store: {said}")
            ]
        finally:
            monkeypatch.undo()
            tier.close()


def test_the_database_the_url_names_is_where_the_objects_go(server: RedisServer) -> None:
    """redis://host:port/3 stores into database 3, and database 0 stays empty."""
    tier = RedisTier(
        resolve_target(server.url(db=3), environ={}), key_prefix=test_redis.PREFIX, timeout_s=2.0
    )
    try:
        test_redis._roundtrip(tier)
        with server.admin(db=3) as db3, server.admin() as db0:
            assert db3.dbsize() == 1 and db0.dbsize() == 0
    finally:
        tier.close()
        with server.admin(db=3) as db3:
            db3.flushdb()


def test_the_host_the_url_names_is_the_one_reached(server: RedisServer) -> None:
    """A single server is reached at the URL's host: here 127.0.0.2, where only a relay to
    the test server listens (its port on 127.0.0.1, redis-py's default host, is free)."""
    relay = TcpRelay(upstream=("127.0.0.1", server.port), host="127.0.0.2")
    tier = RedisTier(
        resolve_target(f"redis://127.0.0.2:{relay.port}/0", environ={}),
        key_prefix=test_redis.PREFIX,
        timeout_s=2.0,
    )
    try:
        test_redis._roundtrip(tier)
    finally:
        tier.close()
        relay.close()
