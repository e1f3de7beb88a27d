"""resolve_target: where each Redis setting comes from (flag > URL > environment >
default), bad URLs refused naming the flag or variable, and no credential in any
repr, str or error."""

from __future__ import annotations

import re

import pytest

from kvflow.core.tiers.redis_target import RedisTarget, resolve_target

SECRET = "Pw-7f3a!q9@x:z/%"  # distinctive, with characters a URL must encode
SECRET_URL = "Pw-7f3a%21q9%40x%3Az%2F%25"
USER = "alice-u5er"

ENV_ALL = {
    "KVFLOW_REDIS_USERNAME": "env-user",
    "KVFLOW_REDIS_PASSWORD": "env-pass",
    "KVFLOW_REDIS_HOST": "env-host",
    "KVFLOW_REDIS_PORT": "7001",
}


@pytest.mark.parametrize(
    ("url", "flags", "env", "field", "value", "source"),
    [
        # username: flag > URL > env > default
        ("redis://u:p@h:1/0", {"username": "flag-user"}, ENV_ALL, "username", "flag-user", "--l2-redis-username"),
        ("redis://url-user:p@h:1/0", {}, ENV_ALL, "username", "url-user", "--l2-redis URL"),
        ("redis://h:1/0", {}, ENV_ALL, "username", "env-user", "KVFLOW_REDIS_USERNAME"),
        ("redis://h:1/0", {}, {}, "username", None, "default"),
        # password: flag > URL > env > default
        ("redis://u:p@h:1/0", {"password": "flag-pass"}, ENV_ALL, "password", "flag-pass", "--l2-redis-password"),
        ("redis://:url-pass@h:1/0", {}, ENV_ALL, "password", "url-pass", "--l2-redis URL"),
        ("redis://h:1/0", {}, ENV_ALL, "password", "env-pass", "KVFLOW_REDIS_PASSWORD"),
        ("redis://h:1/0", {}, {}, "password", None, "default"),
        # host: URL > env > default
        ("redis://url-host:1/0", {}, ENV_ALL, "host", "url-host", "--l2-redis URL"),
        ("redis://", {}, ENV_ALL, "host", "env-host", "KVFLOW_REDIS_HOST"),
        ("redis:///0", {}, ENV_ALL, "host", "env-host", "KVFLOW_REDIS_HOST"),
        ("redis://", {}, {}, "host", "localhost", "default"),
        # port: URL > env > default (a URL host without a port takes the env's)
        ("redis://h:6390/0", {}, ENV_ALL, "port", 6390, "--l2-redis URL"),
        ("redis://h/0", {}, ENV_ALL, "port", 7001, "KVFLOW_REDIS_PORT"),
        ("redis:///0", {}, ENV_ALL, "port", 7001, "KVFLOW_REDIS_PORT"),
        ("redis://h", {}, {}, "port", 6379, "default"),
        # db: URL path > default
        ("redis://h:1/5", {}, {}, "db", 5, "--l2-redis URL"),
        ("redis://h:1", {}, {}, "db", 0, "default"),
        # empty values count as not given
        ("redis://:@h:1/0", {"password": ""}, {"KVFLOW_REDIS_PASSWORD": "env-pass"}, "password", "env-pass", "KVFLOW_REDIS_PASSWORD"),
    ],
)  # fmt: skip
def test_each_value_comes_from_the_first_place_that_has_it(
    url: str, flags: dict[str, str], env: dict[str, str], field: str, value: object, source: str
) -> None:
    """Flag beats URL beats environment beats default, per value, and sources says which."""
    target = resolve_target(url, environ=env, **flags)
    assert getattr(target, field) == value
    assert target.sources[field] == source


def test_an_ipv6_zone_is_percent_decoded_like_any_host() -> None:
    """A link-local address names its zone as %25 (RFC 6874): the host is fe80::1%eth0."""
    target = resolve_target("redis://[fe80::1%25eth0]:6379/0", environ={})
    assert (target.host, target.port) == ("fe80::1%eth0", 6379)


def test_url_credentials_are_url_decoded_and_tls_follows_the_scheme() -> None:
    """rediss:// means TLS; user and password in the URL are percent-decoded."""
    target = resolve_target(f"rediss://{USER}:{SECRET_URL}@[::1]:6380/2", environ={})
    assert (target.username, target.password) == (USER, SECRET)
    assert (target.host, target.port, target.db, target.tls) == ("::1", 6380, 2, True)
    assert target.safe_url() == "rediss://***@[::1]:6380/2"
    assert resolve_target("redis://h:1/0", environ={}).tls is False


def test_the_ca_bundle_comes_from_kvflow_redis_ca_for_tls_only() -> None:
    """KVFLOW_REDIS_CA names the CA file for rediss:// and is ignored for redis://."""
    env = {"KVFLOW_REDIS_CA": "/etc/ca.pem"}
    assert resolve_target("rediss://h:1/0", environ=env).ca_certs == "/etc/ca.pem"
    assert resolve_target("redis://h:1/0", environ=env).ca_certs is None


def test_the_environment_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `environ`, os.environ is read when resolve_target runs."""
    monkeypatch.setenv("KVFLOW_REDIS_HOST", "later-host")
    monkeypatch.setenv("KVFLOW_REDIS_PASSWORD", SECRET)
    target = resolve_target("redis://")
    assert target.host == "later-host" and target.password == SECRET
    assert target.sources["password"] == "KVFLOW_REDIS_PASSWORD"


@pytest.mark.parametrize(
    ("url", "env", "named"),
    [
        (f"redis://u:{SECRET_URL}@h:port/0", {}, "--l2-redis"),
        (f"redis://u:{SECRET_URL}@h:99999/0", {}, "--l2-redis"),
        (f"redis://u:{SECRET_URL}@h:1/zero", {}, "--l2-redis"),
        (f"http://u:{SECRET_URL}@h:1/0", {}, "--l2-redis"),
        (f"u:{SECRET_URL}@h:1/0", {}, "--l2-redis"),
        (f"redis://u:{SECRET_URL}@h:1/0?ssl=1", {}, "--l2-redis"),
        (f"redis://u:{SECRET_URL}@[::1/0", {}, "--l2-redis"),
        ("redis://", {"KVFLOW_REDIS_PORT": "x" + SECRET}, "KVFLOW_REDIS_PORT"),
    ],
)
def test_bad_parts_are_refused_naming_the_flag_never_the_value(
    url: str, env: dict[str, str], named: str
) -> None:
    """A bad port, db, scheme or form is a ValueError naming the flag or variable,
    without any credential in its text."""
    with pytest.raises(ValueError, match=named) as info:
        resolve_target(url, password=SECRET, environ={"KVFLOW_REDIS_PASSWORD": SECRET, **env})
    text = f"{info.value}|{info.value!r}|{info.value.__cause__!r}"
    for secret in (SECRET, SECRET_URL, "Pw-7f3a"):
        assert secret not in text


def test_no_credential_appears_in_repr_str_or_safe_url() -> None:
    """repr, str and safe_url of a target mask the username and password."""
    for target in (
        resolve_target(f"redis://{USER}:{SECRET_URL}@h:1/0", environ={}),
        resolve_target("redis://h:1/0", username=USER, password=SECRET, environ={}),
        resolve_target("redis://h:1/0", environ={"KVFLOW_REDIS_USERNAME": USER, "KVFLOW_REDIS_PASSWORD": SECRET}),
    ):  # fmt: skip
        assert target.password == SECRET and target.username == USER
        for text in (repr(target), str(target), target.safe_url(), repr(target.sources)):
            assert SECRET not in text and SECRET_URL not in text and USER not in text
        assert target.safe_url() == "redis://***@h:1/0"
    assert resolve_target("redis://h:1/0", environ={}).safe_url() == "redis://h:1/0"


def test_targets_are_frozen() -> None:
    """A RedisTarget cannot be changed after it is made."""
    target = RedisTarget("h", 1)
    with pytest.raises(AttributeError):
        target.host = "other"  # type: ignore[misc]


PORT_RANGE = "the port must be a number in 1..65535"
NOT_DB = "--l2-redis: the path must be a database number, like /0"
BAD_IPV6 = "--l2-redis is not a well-formed URL (bad [IPv6] host)"


@pytest.mark.parametrize(
    ("url", "env", "message"),
    [
        (None, {}, "--l2-redis must be a redis:// or rediss:// URL"),
        ("http://h:1/0", {}, "--l2-redis must be a redis:// or rediss:// URL (unknown scheme)"),
        ("redis://[::1/0", {}, BAD_IPV6),
        ("redis://h]:1/0", {}, BAD_IPV6),
        ("redis://[::1/0://x", {}, BAD_IPV6),  # the authority ends at the first "/"
        ("redis://h\uff03x:1/[/0", {}, "--l2-redis is not a well-formed URL"),
        # U+FF03 FULLWIDTH NUMBER SIGN reads as '#' once normalised: urlsplit refuses it
        ("redis://h\uff03x:1/0", {}, "--l2-redis is not a well-formed URL"),
        ("redis://[::1]x/0", {}, BAD_IPV6),
        ("redis://[::1]]:1/0", {}, BAD_IPV6),
        (
            "redis://h:1/0?ssl=1",
            {},
            "--l2-redis: query parameters and fragments are not supported "
            "(URL-encode '?', '#' and '/' in a password)",
        ),
        ("redis://h:port/0", {}, f"--l2-redis: {PORT_RANGE}"),
        ("redis://h:65536/0", {}, f"--l2-redis: {PORT_RANGE}"),
        ("redis://h:0/0", {}, f"--l2-redis: {PORT_RANGE}"),
        ("redis://h:1/zero", {}, NOT_DB),
        ("redis://h:1/X", {}, NOT_DB),
        ("redis://h:1/0://x", {}, NOT_DB),  # a later "://" is not the scheme's
        ("redis://", {"KVFLOW_REDIS_PORT": "65536"}, f"KVFLOW_REDIS_PORT: {PORT_RANGE}"),
    ],
)
def test_each_refusal_says_exactly_what_is_wrong(
    url: str | None, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_target(url, environ=env)  # type: ignore[arg-type]


def test_ports_at_both_ends_of_the_range_are_accepted() -> None:
    assert resolve_target("redis://h:65535/0", environ={}).port == 65535
    assert resolve_target("redis://h:1/0", environ={}).port == 1
    assert resolve_target("redis://", environ={"KVFLOW_REDIS_PORT": "65535"}).port == 65535


def test_a_password_may_hold_an_unencoded_colon() -> None:
    """The first ':' of the URL's userinfo ends the username; the rest is the password."""
    target = resolve_target("redis://u:pa:ss@h:1/0", environ={})
    assert (target.username, target.password) == ("u", "pa:ss")


def test_safe_url_masks_a_password_or_a_username_alone() -> None:
    assert resolve_target("redis://:pw@h:1/0", environ={}).safe_url() == "redis://***@h:1/0"
    assert resolve_target("redis://u@h:1/0", environ={}).safe_url() == "redis://***@h:1/0"


def test_sources_say_where_the_ca_bundle_came_from() -> None:
    env = {"KVFLOW_REDIS_CA": "/etc/ca.pem"}
    assert resolve_target("rediss://h:1/0", environ=env).sources["ca_certs"] == "KVFLOW_REDIS_CA"
    assert resolve_target("rediss://h:1/0", environ={}).sources["ca_certs"] == "default"
    assert "ca_certs" not in resolve_target("redis://h:1/0", environ=env).sources
