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
        ({"l1_size_gb": 0}, r"--l1-size-gb must be a number > 0"),
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
    assert ObservabilityConfig(tracing_enabled=True, otlp_endpoint="http://127.0.0.1:4317")


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
