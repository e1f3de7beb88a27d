"""The Redis tier on real redis-server processes: bit-exact round trips, one round trip
per lookup batch, values damaged behind its back, keys safe for Redis Cluster, stats
and describe, authentication (requirepass, ACL users) and TLS, with no credential in
any error, repr, status or log line."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvflow.core.tiers.base import STAT_KEYS, ObjectKey, StoreOutcome
from kvflow.core.tiers.redis import RedisTier, owner_text
from kvflow.core.tiers.redis_target import RedisTarget, resolve_target
from tests.support.redis_servers import (
    AclUser,
    RedisServer,
    redis_server,
    require_tls,
    shared_server,
)
from tests.support.tiers import HeldFilter

T = TypeVar("T")
SECRET = "Zq-s3cret-7Hx!42"  # distinctive, so any leak of it is found
USER = "kv-acl-user"
PREFIX = "kvtest:"


def key(i: int, model: str = "org/model", salt: str | None = None) -> ObjectKey:
    return ObjectKey(i.to_bytes(32, "little"), model, 2, 1, salt)


def payload(i: int, nbytes: int = 1024) -> torch.Tensor:
    gen = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def answer(future: Future[T], timeout: float = 10.0) -> T:
    return future.result(timeout=timeout)


@pytest.fixture
def server() -> RedisServer:
    """The shared plain server, emptied."""
    made = shared_server()
    made.flush()
    return made


def make_tier(server: RedisServer) -> RedisTier:
    """A tier on `server` under the tests' key prefix."""
    return RedisTier(resolve_target(server.url(), environ={}), key_prefix=PREFIX, timeout_s=2.0)


@pytest.fixture
def tier(server: RedisServer) -> Iterator[RedisTier]:
    made = make_tier(server)
    yield made
    made.close()


@pytest.mark.parametrize("nbytes", [1024, 1 << 20])
def test_round_trip_is_bit_exact(tier: RedisTier, nbytes: int) -> None:
    """Stored bytes (1 KiB and 1 MiB) load back identical, into a strided view too."""
    items = [(key(i), payload(i, nbytes)) for i in range(3)]
    assert answer(tier.store(items)) == StoreOutcome(stored=3)
    dsts = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(3)]
    assert answer(tier.load([key(i) for i in range(3)], dsts)) == [True] * 3
    for (_, src), dst in zip(items, dsts, strict=True):
        assert torch.equal(src, dst)
    strided = torch.zeros(2 * nbytes, dtype=torch.uint8)[::2]
    assert answer(tier.load([key(1)], [strided])) == [True]
    assert torch.equal(strided, items[1][1])


def test_contains_of_500_keys_is_one_round_trip(
    tier: RedisTier, server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 500-key contains sends every EXISTS before reading any reply (one round trip),
    and Redis runs exactly 500 EXISTS; a per-key loop would measure 500 trips."""
    keys = [key(i) for i in range(500)]
    answer(tier.store([(k, payload(i, 16)) for i, k in enumerate(keys) if i % 2 == 0]))
    events: list[str] = []
    send, read = redis.Connection.send_packed_command, redis.Connection.read_response

    def counting_send(self: redis.Connection, *args: Any, **kwargs: Any) -> Any:
        events.append("send")
        return send(self, *args, **kwargs)

    def counting_read(self: redis.Connection, *args: Any, **kwargs: Any) -> Any:
        events.append("read")
        return read(self, *args, **kwargs)

    def round_trips() -> int:
        return sum(1 for a, b in itertools.pairwise(events) if (a, b) == ("send", "read"))

    admin = server.admin()
    admin.config_resetstat()
    monkeypatch.setattr(redis.Connection, "send_packed_command", counting_send)
    monkeypatch.setattr(redis.Connection, "read_response", counting_read)
    got = answer(tier.contains(keys))
    trips = round_trips()
    events.clear()
    for name in [tier.redis_key(k) for k in keys]:  # the measure's own check
        admin.exists(name)
    naive = round_trips()
    monkeypatch.undo()
    assert got == [i % 2 == 0 for i in range(500)]
    assert trips == 1
    assert naive == 500
    calls = admin.info("commandstats")["cmdstat_exists"]["calls"]
    assert calls == 1000  # 500 from the tier's one trip, 500 from the naive loop


@pytest.mark.parametrize(
    "damage",
    ["garbage", "truncated", "copied from another key", "wrong length", "bad checksum"],
)
def test_a_damaged_value_is_a_counted_miss_and_deleted(
    tier: RedisTier, server: RedisServer, damage: str
) -> None:
    """A value overwritten behind the tier's back fails its checks: load answers False,
    the destination is untouched, corrupt_objects counts it and the key is deleted."""
    answer(tier.store([(key(1), payload(1)), (key(2), payload(2))]))
    admin = server.admin()
    name, other = tier.redis_key(key(1)), tier.redis_key(key(2))
    value, other_value = admin.get(name), admin.get(other)
    assert isinstance(value, bytes) and isinstance(other_value, bytes)
    damaged = {
        "garbage": b"\x00garbage" * 200,
        "truncated": value[:-1],
        "copied from another key": other_value,
        "wrong length": value + b"x",
        "bad checksum": value[:-1] + bytes([value[-1] ^ 1]),
    }[damage]
    admin.set(name, damaged)
    dst = torch.zeros(1024, dtype=torch.uint8)
    assert answer(tier.load([key(1)], [dst])) == [False]
    assert not dst.any()
    stats = tier.stats()
    assert stats["corrupt_objects"] == 1 and stats["load_failures"] == 1
    assert admin.exists(name) == 0
    assert tier.describe()["last_error"] is not None
    assert answer(tier.load([key(2)], [dst])) == [True]  # the other key is unharmed


def test_a_key_deleted_behind_the_tier_is_a_counted_miss(
    tier: RedisTier, server: RedisServer
) -> None:
    """A key deleted by someone else answers False in contains and load; the load is
    counted in missing_objects."""
    answer(tier.store([(key(1), payload(1))]))
    server.admin().delete(tier.redis_key(key(1)))
    assert answer(tier.contains([key(1)])) == [False]
    assert answer(tier.load([key(1)], [torch.zeros(1024, dtype=torch.uint8)])) == [False]
    assert tier.stats()["missing_objects"] == 1


def test_keys_carry_no_hash_tag_and_parse_back(tier: RedisTier) -> None:
    """A key is prefix + escaped owner + ':' + hash hex, with no '{', '}' or ':' from
    user text; it parses back to the same ObjectKey."""
    nasty = key(7, model="m{tag}:x#y/%z\u00e9", salt="s}a{l:t")
    name = tier.redis_key(nasty)
    rest = name.decode().removeprefix(PREFIX)
    assert "{" not in rest and "}" not in rest and rest.count(":") == 1
    assert rest == f"{owner_text(nasty)}:{nasty.chunk_hash.hex()}"
    assert tier.parse_key(name) == nasty
    assert tier.parse_key(b"other:" + name) is None
    assert tier.parse_key(PREFIX.encode() + b"not-ours") is None


def test_drop_where_deletes_only_matching_keys_under_the_prefix(
    tier: RedisTier, server: RedisServer
) -> None:
    """drop_where SCANs the prefix, deletes the keys whose owner matches, and leaves
    other owners and keys outside the prefix alone."""
    answer(tier.store([(key(i, "a"), payload(i)) for i in range(5)]))
    answer(tier.store([(key(i, "b"), payload(i)) for i in range(3)]))
    admin = server.admin()
    admin.set("foreign-key", b"x")
    admin.set(PREFIX + "unparseable", b"x")
    assert tier.drop_where(lambda k: k.model_name == "a") == 5
    assert tier.stats()["objects"] == 3
    assert answer(tier.contains([key(0, "a"), key(0, "b")])) == [False, True]
    assert admin.exists("foreign-key", PREFIX + "unparseable") == 2


def test_stats_and_describe_report_the_server_without_waiting(
    tier: RedisTier, server: RedisServer
) -> None:
    """stats() has the STAT_KEYS and failure counters, usage and capacity from INFO
    memory; describe() names the URL, prefix and connection state."""
    server.admin().config_set("maxmemory", "64mb")
    answer(tier.store([(key(1), payload(1))]))
    stats = tier.stats()
    for name in (*STAT_KEYS, "store_failures", "load_failures", "lookup_failures"):
        assert name in stats
    assert stats["objects"] == 1 and stats["connected"] == 1 and stats["evicted_chunks"] == 0
    assert stats["usage_bytes"] > 0
    tier._info_at = float("-inf")  # let the next stats() refresh from INFO
    tier.stats()
    # the INFO refresh runs on one of the tier's I/O threads: wait for it by time (a no-op
    # on another thread finishing first says nothing about it)
    deadline = time.monotonic() + 10
    while tier.stats()["capacity_bytes"] != 64 << 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tier.stats()["capacity_bytes"] == 64 << 20
    server.admin().config_set("maxmemory", "0")
    info = tier.describe()
    assert info["url"] == server.url() and info["key_prefix"] == PREFIX
    assert info["connected"] is True and info["cluster"] is False


def test_close_is_idempotent_and_later_calls_are_refused(tier: RedisTier) -> None:
    """After close, stats answers (no objects, disconnected) and calls raise."""
    answer(tier.store([(key(1), payload(1))]))
    tier.close()
    tier.close()
    assert tier.stats()["objects"] == 0 and tier.stats()["connected"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        tier.contains([key(1)])


# -- authentication -----------------------------------------------------------------------


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text


def _roundtrip(tier: RedisTier) -> None:
    assert answer(tier.store([(key(1), payload(1))])).stored == 1
    dst = torch.zeros(1024, dtype=torch.uint8)
    assert answer(tier.load([key(1)], [dst])) == [True]
    assert torch.equal(dst, payload(1))


def test_requirepass_with_the_right_password_works(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A requirepass server accepts the password from the URL, and nothing the tier
    reports or logs contains it."""
    caplog.set_level(logging.DEBUG)
    with RedisServer(tmp_path, password=SECRET) as server:
        tier = RedisTier(resolve_target(server.url(password=SECRET), environ={}))
        try:
            _roundtrip(tier)
            _no_secret(repr(tier), str(tier.stats()), str(tier.describe()), repr(tier.target))
        finally:
            tier.close()
    _no_secret(caplog.text, *capsys.readouterr())


@pytest.mark.parametrize(
    ("via", "source"),
    [
        ("flag", "--l2-redis-password"),
        ("env", "KVFLOW_REDIS_PASSWORD"),
        ("url", "--l2-redis URL"),
        ("none", "default"),
    ],
)
def test_a_wrong_password_fails_at_construction_naming_its_source(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    via: str,
    source: str,
) -> None:
    """A wrong (or missing) requirepass password is a ValueError at construction that
    names where the password came from and Redis's answer, never the password."""
    caplog.set_level(logging.DEBUG)
    wrong = SECRET + "-wrong"
    with RedisServer(tmp_path, password=SECRET) as server:
        url = server.url(password=wrong) if via == "url" else server.url()
        target = resolve_target(
            url,
            password=wrong if via == "flag" else None,
            environ={"KVFLOW_REDIS_PASSWORD": wrong} if via == "env" else {},
        )
        with pytest.raises(ValueError) as info:
            RedisTier(target, timeout_s=2.0)
    text = str(info.value)
    assert f"password from {source}" in text
    if via == "none":
        assert "no password was given" in text
    else:
        assert "AuthenticationError: invalid username-password pair" in text
    _no_secret(text, repr(info.value), caplog.text, *capsys.readouterr())


@pytest.mark.parametrize("default_user", ["off", "other password"])
def test_an_acl_user_logs_in_with_its_password_and_not_with_a_wrong_one(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    default_user: str,
) -> None:
    """An ACL user with the right password works; a wrong password or an unknown user is
    a ValueError naming the sources (KVFLOW_REDIS_USERNAME/PASSWORD), never the values."""
    caplog.set_level(logging.DEBUG)
    off = default_user == "off"
    with RedisServer(
        tmp_path,
        users=[AclUser(USER, SECRET)],
        default_off=off,
        password=None if off else "default-" + SECRET[::-1],
    ) as server:
        good = {"KVFLOW_REDIS_USERNAME": USER, "KVFLOW_REDIS_PASSWORD": SECRET}
        tier = RedisTier(resolve_target(server.url(), environ=good))
        try:
            _roundtrip(tier)
            users = {c["name"]: c["user"] for c in server.admin().client_list()}
            assert users["kvflow"] == USER
            _no_secret(repr(tier), str(tier.stats()), str(tier.describe()))
        finally:
            tier.close()
        errors = []
        for env in (
            {**good, "KVFLOW_REDIS_PASSWORD": SECRET + "x"},
            {**good, "KVFLOW_REDIS_USERNAME": "nobody"},
        ):
            with pytest.raises(ValueError) as info:
                RedisTier(resolve_target(server.url(), environ=env), timeout_s=2.0)
            errors.append(info.value)
    for error in errors:
        text = str(error)
        assert "username from KVFLOW_REDIS_USERNAME" in text
        assert "password from KVFLOW_REDIS_PASSWORD" in text
        assert "AuthenticationError: invalid username-password pair" in text
        _no_secret(text, repr(error))
    _no_secret(caplog.text, *capsys.readouterr())


def test_tls_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rediss:// URL talks TLS to a TLS-only server whose CA is named by
    KVFLOW_REDIS_CA; without that CA the certificate is refused (never fatal)."""
    require_tls()
    with RedisServer(tmp_path, tls=True, password=SECRET) as server:
        url = server.url(password=SECRET)
        assert url.startswith("rediss://")
        tier = RedisTier(
            resolve_target(url, environ={"KVFLOW_REDIS_CA": str(server.ca_file)}), timeout_s=2.0
        )
        try:
            _roundtrip(tier)
            assert tier.describe()["url"].startswith("rediss://***@")
        finally:
            tier.close()
        untrusted = RedisTier(resolve_target(url, environ={}), timeout_s=0.5)
        try:
            assert untrusted.stats()["connected"] == 0
            assert "certificate" in str(untrusted.describe()["last_error"]).lower()
        finally:
            untrusted.close()


def test_a_plain_client_cannot_talk_to_a_tls_only_port() -> None:
    """(Sanity of the TLS test) the TLS server is not reachable without TLS."""
    require_tls()
    with redis_server(tls=True) as server:
        plain = redis.Redis(
            host="127.0.0.1", port=server.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        with pytest.raises(redis.RedisError):
            plain.ping()


# -- keys, pins and drop_where in detail ----------------------------------------------------


def test_owner_text_is_escaped_byte_by_byte_and_any_text_parses_back(tier: RedisTier) -> None:
    """Characters outside [A-Za-z0-9._-] become %XX of their UTF-8 bytes (a lone
    surrogate too, as its surrogatepass bytes), the rest stay as they are, and the key
    parses back to the same ObjectKey."""
    odd = ObjectKey(bytes([0xAB]) * 4, "Ab9._-/\u00e9 \ud800", 3, 2, "s\udfff\u20ac")
    name = tier.redis_key(odd)
    assert name == (
        PREFIX.encode() + b"Ab9._-%2F%C3%A9%20%ED%A0%80#3#2#=s%ED%BF%BF%E2%82%AC:abababab"
    )
    assert tier.parse_key(name) == odd


def test_only_the_canonical_spelling_of_a_key_parses(tier: RedisTier) -> None:
    """A name that decodes to an ObjectKey but is not how this tier spells it (upper-case
    hash hex, a lower-case escape, a padded number) is foreign: parse_key answers None."""
    k = ObjectKey(bytes(range(0xA0, 0xC0)), "org/model", 2, 1, None)
    name = tier.redis_key(k)
    assert tier.parse_key(name) == k
    upper = name[:-64] + name[-64:].upper()
    for foreign in (upper, name.replace(b"%2F", b"%2f"), name.replace(b"#2#", b"#02#")):
        assert foreign != name
        assert tier.parse_key(foreign) is None


def test_pin_counts_the_leading_held_keys(tier: RedisTier) -> None:
    """pin answers how many leading keys Redis holds: all of them, none of none, and up
    to the first missing one; unpin releases them."""
    keys = [key(i) for i in range(4)]
    answer(tier.store([(k, payload(i, 16)) for i, k in enumerate(keys[:3])]))
    assert tier.pin([]) == 0
    assert tier.pin(keys[:3]) == 3
    assert tier.stats()["pinned"] == 3
    assert tier.pin(keys) == 3
    assert tier.pin([keys[3], keys[0]]) == 0
    tier.unpin(keys[:3])
    tier.unpin(keys[:3])
    assert tier.stats()["pinned"] == 0


def test_pin_answers_0_when_the_lookup_outlasts_its_bound(server: RedisServer) -> None:
    """pin waits at most about 2 * timeout_s + 1 for its lookup; one stuck behind a busy
    I/O thread pins nothing (0), and the tier works on afterwards."""
    tier = RedisTier(
        resolve_target(server.url(), environ={}), key_prefix=PREFIX, timeout_s=0.25, pool_size=1
    )
    try:
        answer(tier.store([(key(1), payload(1, 16))]))
        held = HeldFilter()
        with ThreadPoolExecutor(1) as outside:
            dropping = outside.submit(tier.drop_where, held)
            assert held.entered.wait(10)
            try:
                assert tier.pin([key(1)]) == 0  # its contains waits behind drop_where
            finally:
                held.release.set()
            assert dropping.result(timeout=10) == 0
        assert tier.stats()["pinned"] == 0
        assert tier.pin([key(1)]) == 1
    finally:
        tier.close()


def test_drop_where_of_thousands_of_keys_counts_each_batch(
    tier: RedisTier, server: RedisServer
) -> None:
    """drop_where deletes in batches of 1000 and counts every key of every batch; the
    objects stat goes back to 0."""
    n = 2345
    for start in range(0, n, 500):
        items = [(key(i), payload(i, 8)) for i in range(start, min(n, start + 500))]
        answer(tier.store(items))
    assert tier.stats()["objects"] == n
    assert tier.drop_where(lambda k: True) == n
    assert tier.stats()["objects"] == 0
    assert server.admin().dbsize() == 0


def test_drop_where_scans_1000_keys_per_round_trip(tier: RedisTier, server: RedisServer) -> None:
    """drop_where asks SCAN for 1000 keys at a time: 300 keys take one SCAN call."""
    answer(tier.store([(key(i), payload(i, 8)) for i in range(300)]))
    admin = server.admin()
    admin.config_resetstat()
    assert tier.drop_where(lambda k: False) == 0
    assert admin.info("commandstats")["cmdstat_scan"]["calls"] == 1


def test_drop_where_leaves_pinned_keys_and_drops_the_rest(tier: RedisTier) -> None:
    """A pinned key survives drop_where; every other matching key is deleted."""
    keys = [key(i) for i in range(200)]
    answer(tier.store([(k, payload(i, 8)) for i, k in enumerate(keys)]))
    assert tier.pin([keys[7]]) == 1
    assert tier.drop_where(lambda k: True) == 199
    assert answer(tier.contains(keys)) == [i == 7 for i in range(200)]
    assert tier.stats()["objects"] == 1


def test_drop_where_under_a_prefix_with_glob_characters(server: RedisServer) -> None:
    """A prefix holding SCAN glob characters (*?[]\\) matches only itself."""
    prefix = "kv*?[x]\\:"
    tier = RedisTier(resolve_target(server.url(), environ={}), key_prefix=prefix)
    try:
        answer(tier.store([(key(i), payload(i, 8)) for i in range(3)]))
        admin = server.admin()
        admin.set("kvAB[x]\\:" + "other", b"x")
        assert tier.drop_where(lambda k: True) == 3
        assert admin.dbsize() == 1
    finally:
        tier.close()


def test_a_refused_scan_fails_drop_where_and_names_the_error(tmp_path: Path) -> None:
    """A user without SCAN permission: drop_where deletes nothing, answers 0, and the
    tier's last error names drop_where and Redis's refusal (the tier stays connected)."""
    with RedisServer(tmp_path, extra=["user noscan on >pw ~* &* +@all -scan"]) as server:
        tier = RedisTier(
            resolve_target(server.url(username="noscan", password="pw"), environ={}),
            key_prefix=PREFIX,
        )
        try:
            answer(tier.store([(key(1), payload(1, 8))]))
            assert tier.drop_where(lambda k: True) == 0
            error = tier.describe()["last_error"]
            assert error is not None and error.startswith("drop_where: NoPermissionError: ")
            assert tier.stats()["connected"] == 1
            assert answer(tier.contains([key(1)])) == [True]
        finally:
            tier.close()


def test_a_timed_out_delete_fails_drop_where_and_names_the_delete(tmp_path: Path) -> None:
    """Writes paused on the server (CLIENT PAUSE WRITE): drop_where's SCAN answers but its
    DEL times out; it answers 0 deleted and the last error names the delete's timeout."""
    with RedisServer(tmp_path) as server:
        tier = RedisTier(resolve_target(server.url(), environ={}), key_prefix=PREFIX, timeout_s=0.5)
        admin = server.admin()
        try:
            answer(tier.store([(key(1), payload(1, 8))]))
            admin.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
            try:
                assert tier.drop_where(lambda k: True) == 0
            finally:
                admin.execute_command("CLIENT", "UNPAUSE")
            error = tier.describe()["last_error"]
            assert error is not None and error.startswith("delete: TimeoutError: ")
            assert admin.exists(tier.redis_key(key(1))) == 1
        finally:
            tier.close()


# -- the credentials message in full ------------------------------------------------------


AUTH_HINT = (
    "check --l2-redis-username, --l2-redis-password, the --l2-redis URL or "
    "KVFLOW_REDIS_USERNAME/KVFLOW_REDIS_PASSWORD (docs/REDIS.md)"
)


def test_the_credentials_error_of_a_bare_target_in_full(tmp_path: Path) -> None:
    """A RedisTarget made in code (no sources recorded) refused by Redis: the ValueError
    says where, what Redis answered, that both values are defaults, and what to check;
    without a password it says none was given."""
    with RedisServer(tmp_path, password=SECRET) as server:
        messages = {}
        for password in (SECRET + "-wrong", None):
            target = RedisTarget(host="127.0.0.1", port=server.port, password=password)
            with pytest.raises(ValueError) as info:
                RedisTier(target, timeout_s=2.0)
            messages[password is None] = str(info.value)
    url = f"127.0.0.1:{server.port}/0"
    assert messages[False] == (
        f"Redis at redis://***@{url} refused the credentials: AuthenticationError: invalid "
        "username-password pair or user is disabled. (username from default, password from "
        f"default); {AUTH_HINT}"
    )
    assert messages[True].startswith(
        f"Redis at redis://{url} refused the credentials (no password was given): "
        "AuthenticationError: "
    )
    assert messages[True].endswith(f" (username from default, password from default); {AUTH_HINT}")
