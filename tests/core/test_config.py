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
