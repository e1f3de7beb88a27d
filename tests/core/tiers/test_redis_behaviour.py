"""The Redis tier's exact answers on a real redis-server: the escaped key of an owner,
what `check_value` says of each kind of damaged value, the counters and last error of
error replies and of a connection broken mid-call (and the one retry of a stale pooled
connection), and the exact stats and describe."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import torch

from kvflow.core.tiers import redis as redis_tier
from kvflow.core.tiers.base import ObjectKey
from kvflow.core.tiers.redis import HEADER, RedisTier
from tests.core.tiers import test_redis
from tests.core.tiers.test_redis import PREFIX, answer, key, make_tier, payload
from tests.core.tiers.test_redis_faults import wait_for
from tests.support.redis_servers import RedisServer, redis_server

server = test_redis.server  # the fixtures: the shared server emptied, a tier on it
tier = test_redis.tier


@pytest.fixture
def cold_owner_cache() -> None:
    """The owner text of a key is cached per owner; emptied, a key's escaping runs."""
    redis_tier._owner_text.cache_clear()


# -- keys -----------------------------------------------------------------------------------


@pytest.mark.usefixtures("cold_owner_cache")
def test_a_key_escapes_every_owner_character_outside_the_safe_set_as_utf8_bytes(
    tier: RedisTier,
) -> None:
    model = "Org_1/m-2.x ü\udcff"  # a lone surrogate passes as its 3 UTF-8-like bytes
    chunk = bytes(range(32))
    obj = ObjectKey(chunk, model, 4, 3, "s:{a}#")
    name = tier.redis_key(obj)
    assert name == (
        b"kvtest:Org_1%2Fm-2.x%20%C3%BC%ED%B3%BF#4#3#=s%3A%7Ba%7D%23:" + chunk.hex().encode()
    )
    assert tier.parse_key(name) == obj
    assert tier.redis_key(ObjectKey(chunk, "plain", 1, 0, None)) == (
        b"kvtest:plain#1#0#-:" + chunk.hex().encode()
    )


# -- values ---------------------------------------------------------------------------------


def _value(name: bytes, data: bytes) -> bytes:
    return RedisTier.encode_value(name, memoryview(data))


NAME = b"kvtest:owner:00"
GOOD = _value(NAME, b"0123456789")
ELSEWHERE = _value(b"kvtest:owner:01", b"0123456789")  # a whole value of another key


def _patched(offset: int, raw: bytes) -> bytes:
    return GOOD[:offset] + raw + GOOD[offset + len(raw) :]


@pytest.mark.parametrize(
    ("value", "nbytes", "expected"),
    [
        (GOOD, 10, (HEADER.size + len(NAME), None)),
        (GOOD, 9, (-1, None)),
        (_value(b"", b""), 0, (HEADER.size, None)),  # exactly a header: an empty payload
        (GOOD[: HEADER.size - 1], 10, (-1, "shorter than its header")),
        (b"X" + GOOD[1:], 10, (-1, "not a kvflow value (bad magic)")),
        (_patched(8, b"\x07\x00"), 10, (-1, "value format version 7 is not 1")),
        (ELSEWHERE, 10, (-1, "the value was written under another key")),
        (GOOD[:-3], 10, (-1, "payload of 7 bytes, header says 10")),
        (GOOD[:-1] + b"X", 10, (-1, "payload checksum mismatch")),
    ],
    ids=["whole", "other-size", "empty", "short", "magic", "version", "key", "length", "checksum"],
)
def test_check_value_answers_the_payload_offset_or_exactly_why_not(
    value: bytes, nbytes: int, expected: tuple[int, str | None]
) -> None:
    name = b"" if nbytes == 0 else NAME
    assert RedisTier.check_value(name, value, nbytes) == expected


def test_a_corrupt_value_under_a_long_key_is_named_by_its_first_120_characters(
    tier: RedisTier, server: RedisServer
) -> None:
    long = key(1, model="m" * 200)
    name = tier.redis_key(long)
    server.admin().set(name, b"garbage")
    assert answer(tier.load([long], [torch.zeros(16, dtype=torch.uint8)])) == [False]
    assert tier.describe()["last_error"] == f"load: {name.decode()[:120]}: shorter than its header"
    assert tier.stats()["corrupt_objects"] == 1


# -- error replies ----------------------------------------------------------------------------


def test_error_replies_of_a_load_fail_their_keys_apart_from_the_missing_ones(
    tier: RedisTier, server: RedisServer
) -> None:
    answer(tier.store([(key(0), payload(0, 64))]))
    admin = server.admin()
    for i in (1, 2):  # another client's lists under the tier's keys: GET answers WRONGTYPE
        admin.rpush(tier.redis_key(key(i)), b"x")
    dsts = [torch.zeros(64, dtype=torch.uint8) for _ in range(5)]
    got = answer(tier.load([key(i) for i in range(5)], dsts))
    assert got == [True, False, False, False, False]
    assert torch.equal(dsts[0], payload(0, 64))
    stats = tier.stats()
    assert (stats["load_failures"], stats["missing_objects"], stats["corrupt_objects"]) == (4, 2, 0)
    assert tier.describe()["last_error"] == (
        "load: ResponseError: WRONGTYPE Operation against a key holding the wrong kind of value"
    )
    assert stats["connected"] == 1


def test_error_replies_to_exists_and_get_are_counted_and_named_by_their_call() -> None:
    with redis_server(extra=['rename-command EXISTS ""', 'rename-command GET ""']) as server:
        tier = make_tier(server)
        try:
            name = tier.redis_key(key(0)).decode()
            unknown = "ResponseError: unknown command '{}', with args beginning with: '{}'"
            assert answer(tier.contains([key(0)])) == [False]
            assert tier.stats()["lookup_failures"] == 1
            assert tier.describe()["last_error"] == "contains: " + unknown.format("EXISTS", name)
            assert answer(tier.load([key(0)], [torch.zeros(8, dtype=torch.uint8)])) == [False]
            assert tier.stats()["load_failures"] == 1
            assert tier.describe()["last_error"] == "load: " + unknown.format("GET", name)
            assert tier.stats()["connected"] == 1
        finally:
            tier.close()


def test_empty_calls_answer_empty_lists(tier: RedisTier) -> None:
    assert answer(tier.contains([])) == []
    assert answer(tier.load([], [])) == []


# -- broken connections -----------------------------------------------------------------------


class Breaker:
    """Makes the `nth` call (from 1) of a redis.Connection method raise ConnectionError."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, method: str, nth: int) -> None:
        self.calls = 0
        original = getattr(redis.Connection, method)

        def broken(conn: redis.Connection, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == nth:
                raise redis.ConnectionError("link broken by the test")
            return original(conn, *args, **kwargs)

        monkeypatch.setattr(redis.Connection, method, broken)


def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one(
    tier: RedisTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer(tier.store([(key(i), payload(i, 64)) for i in range(3)]))
    Breaker(monkeypatch, "send_packed_command", 1)
    dsts = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    assert answer(tier.load([key(i) for i in range(3)], dsts)) == [True] * 3
    assert tier.stats()["load_failures"] == 0 and tier.stats()["connected"] == 1


def test_a_link_broken_after_some_replies_fails_the_whole_load_and_the_tier_rejoins(
    tier: RedisTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer(tier.store([(key(i), payload(i, 64)) for i in range(3)]))
    Breaker(monkeypatch, "read_response", 2)  # the first reply is read, then the link breaks
    dsts = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    assert answer(tier.load([key(i) for i in range(3)], dsts)) == [False] * 3
    assert tier.stats()["load_failures"] == 3
    assert tier.describe()["last_error"] == "load: ConnectionError: link broken by the test"
    wait_for(lambda: tier.stats()["reconnects"] == 1)  # it went down, and came back
    assert answer(tier.load([key(i) for i in range(3)], dsts)) == [True] * 3


# -- stats and describe -----------------------------------------------------------------------


def test_stats_and_describe_are_exactly_the_documented_fields(
    tier: RedisTier, server: RedisServer
) -> None:
    answer(tier.store([(key(0), payload(0, 64))]))
    stats = tier.stats()
    stats.pop("usage_bytes")
    assert stats == {
        "capacity_bytes": 0,
        "objects": 1,
        "evicted_chunks": 0,
        "evicted_bytes": 0,
        "pinned": 0,
        "store_failures": 0,
        "load_failures": 0,
        "lookup_failures": 0,
        "corrupt_objects": 0,
        "missing_objects": 0,
        "reconnects": 0,
        "connected": 1,
    }
    assert tier.describe() == {
        "name": "redis",
        "url": server.url(),
        "cluster": False,
        "key_prefix": PREFIX,
        "nodes": [],
        "connected": True,
        "last_error": None,
        "timeout_s": 2.0,
        "pool_size": 8,
        "sources": {"host": "--l2-redis URL", "port": "--l2-redis URL"},
        "closed": False,
    }
    tier.close()
    assert tier.describe()["closed"] is True
