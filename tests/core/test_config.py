"""Configuration validation: each bad value raises ValueError naming the flag and what is allowed."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.core import ObservabilityConfig, ServerConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tracing_enabled": True}, r"--enable-tracing requires --otlp-endpoint"),
        ({"l0_sample_rate": 1.5}, r"--l0-sample-rate must be a number in \[0, 1\]"),
        ({"l0_sample_rate": -0.01}, r"--l0-sample-rate"),
        ({"event_bus_capacity": 0}, r"--event-bus-capacity must be an integer >= 1"),
        ({"prometheus_port": 70000}, r"--prometheus-port must be an integer in 0..65535"),
        ({"log_format": "xml"}, r"--log-format must be one of json, console"),
        ({"log_level": "loud"}, r"--log-level must be one of"),
        ({"otlp_protocol": "udp"}, r"--otlp-protocol must be one of grpc, http"),
    ],
)
def test_observability_rejects_bad_values(kwargs: dict[str, Any], message: str) -> None:
    """ObservabilityConfig rejects the value at construction with a message naming the flag."""
    with pytest.raises(ValueError, match=message):
        ObservabilityConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": -1}, r"--port must be an integer in 0..65535"),
        ({"chunk_size": 0}, r"--chunk-size must be a positive integer"),
        ({"l1_size_gb": 0}, r"--l1-size-gb must be a finite number in \(0, 1048576\] GiB"),
        ({"shards": 0}, r"--shards must be an integer in 1..64, got 0"),
        ({"shards": 65}, r"--shards must be an integer in 1..64, got 65"),
        ({"shards": True}, r"--shards must be an integer in 1..64, got True"),
        ({"shard_endpoint": "tcp://127.0.0.1:1"}, r"a shard listens on an ipc:// endpoint"),
    ],
)
def test_server_rejects_bad_values(kwargs: dict[str, Any], message: str) -> None:
    """ServerConfig rejects the value at construction with a message naming the flag."""
    with pytest.raises(ValueError, match=message):
        ServerConfig(**kwargs)


def test_defaults_are_valid_and_safe() -> None:
    """Defaults are valid, listen on loopback only, and enable metrics and logging."""
    cfg = ServerConfig()
    assert cfg.host == "127.0.0.1"
    assert cfg.observability.prometheus_host == "127.0.0.1"
    assert cfg.observability.metrics_enabled and cfg.observability.logging_enabled
    assert not cfg.observability.tracing_enabled
    # tracing with a collector is accepted and kept as given; without one it is refused
    traced = ObservabilityConfig(tracing_enabled=True, otlp_endpoint="http://127.0.0.1:4317")
    assert (traced.tracing_enabled, traced.otlp_endpoint) == (True, "http://127.0.0.1:4317")
    assert traced.otlp_protocol == cfg.observability.otlp_protocol == "grpc"
    with pytest.raises(ValueError, match="--enable-tracing requires --otlp-endpoint"):
        ObservabilityConfig(tracing_enabled=True)


SECRET = "pa55-Zq9-never-shown"


def test_redis_credentials_never_show_in_repr_or_status_dict() -> None:
    """The Redis URL's user and password and the credential fields are masked in the
    config's repr and in public_dict (what status shows); other fields stay."""
    config = ServerConfig(
        l2_redis_url=f"rediss://kv:{SECRET}@cache.example:6380/2",
        l2_redis_username="kv-user",
        l2_redis_password=SECRET,
    )
    assert SECRET not in repr(config) and "kv-user" not in repr(config)
    public = config.public_dict()
    assert SECRET not in str(public) and "kv-user" not in str(public)
    assert public["l2_redis_url"] == "rediss://***@cache.example:6380/2"
    assert public["l2_redis_password"] == public["l2_redis_username"] == "***"
    assert ServerConfig(l2_redis_url="redis://h:1").public_dict()["l2_redis_url"] == "redis://h:1"


def test_bad_redis_settings_are_refused_without_echoing_them() -> None:
    """A bad URL or credential type names the flag and never the value."""
    with pytest.raises(ValueError, match="--l2-redis must be a redis:// or rediss:// URL") as exc:
        ServerConfig(l2_redis_url=f"http://u:{SECRET}@h")
    assert SECRET not in str(exc.value)
    with pytest.raises(ValueError, match="--l2-redis-pool-size"):
        ServerConfig(l2_redis_url="redis://h", l2_redis_pool_size=0)
    with pytest.raises(ValueError, match="--l2-redis-key-prefix"):
        ServerConfig(l2_redis_key_prefix="")


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("field", "bad", "bounds"),
    [
        ("l1_size_gb", [INF, -INF, NAN, 1e300, 0, -1, True], r"\(0, 1048576\] GiB"),
        ("l2_disk_size_gb", [INF, NAN, 1e300, 0], r"\(0, 1048576\] GiB"),
        ("heartbeat_timeout_s", [INF, NAN, 1e300, 1e-6, 0.4, 86401, 0], r"\[0.5, 86400\] seconds"),
        ("max_message_mb", [INF, NAN, 1e300, 1e-9, 0, 2049], r"\[0.0625, 2048\] MiB"),
        ("switch_interval_ms", [INF, NAN, 1e300, 0, 0.049, -1, 100.5, True], r"\[0.05, 100\] ms"),
        ("l2_timeout_s", [INF, NAN, 1e300, 1e-9, 0, 601], r"\[0.001, 600\] seconds"),
        ("l2_redis_timeout_s", [INF, NAN, 1e300, 1e-9, 0, 601], r"\[0.001, 600\] seconds"),
    ],
)
def test_server_floats_must_be_finite_and_in_range(field: str, bad: list[Any], bounds: str) -> None:
    """Every float setting refuses inf, nan, and absurdly large or small values with a
    message naming its flag and the allowed range (issue 18, item 7: inf overflowed into a
    raw traceback; a heartbeat timeout of inf killed clients' heartbeats, 1e-6 reaped
    every instance as it registered)."""
    flag = "--" + field.replace("_", "-")
    for value in bad:
        with pytest.raises(ValueError, match=f"^{flag} must be a finite number in {bounds}"):
            ServerConfig(**{field: value})


@pytest.mark.parametrize(
    ("field", "bad", "bounds"),
    [
        ("tracing_ttl_s", [INF, NAN, 1e300, 0.5, 0, 86401], r"\[1, 86400\] seconds"),
        ("export_interval_s", [INF, NAN, 1e300, 1e-6, 0, 86401], r"\[0.1, 86400\] seconds"),
    ],
)
def test_observability_floats_must_be_finite_and_in_range(
    field: str, bad: list[Any], bounds: str
) -> None:
    """The observability float settings refuse non-finite and absurd values likewise."""
    flag = "--" + field.replace("_", "-")
    for value in bad:
        with pytest.raises(ValueError, match=f"^{flag} must be a finite number in {bounds}"):
            ObservabilityConfig(**{field: value})
    with pytest.raises(ValueError, match="--l0-sample-rate"):
        ObservabilityConfig(l0_sample_rate=NAN)


def test_float_bounds_are_inclusive_and_small_l1_stays_allowed() -> None:
    """The range ends are accepted, and a tiny L1 (tests and benchmarks use KiBs) is valid."""
    ServerConfig(heartbeat_timeout_s=0.5, max_message_mb=0.0625, l2_timeout_s=0.001,
                 l2_redis_timeout_s=600, l1_size_gb=(1 << 20) / (1 << 30))  # fmt: skip
    ServerConfig(heartbeat_timeout_s=86400, max_message_mb=2048, l1_size_gb=1 << 20,
                 l2_disk_size_gb=1 << 20, switch_interval_ms=100)  # fmt: skip
    ServerConfig(switch_interval_ms=0.05)
    ObservabilityConfig(tracing_ttl_s=1, export_interval_s=0.1)
    ObservabilityConfig(tracing_ttl_s=86400, export_interval_s=86400)


@pytest.mark.parametrize("bad", [-1, (1 << 26) + 1, True, 1.5])
def test_the_blend_index_bound_is_a_count_from_zero(bad: Any) -> None:
    """--blend-index-chunks takes 0 (blend off) to 2**26 chunks, nothing else."""
    assert ServerConfig(blend_index_chunks=0).blend_index_chunks == 0
    with pytest.raises(
        ValueError, match=r"--blend-index-chunks must be an integer in \[0, 67108864\]"
    ):
        ServerConfig(blend_index_chunks=bad)
