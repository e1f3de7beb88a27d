"""Checks shared by the engine adapters' `kvflow.`-prefixed settings (vLLM's
`kv_connector_extra_config`, SGLang's storage extra config): each bad value raises
ValueError naming its key, so both adapters word their refusals alike."""

from __future__ import annotations

import math
from typing import Any

PREFIX = "kvflow."


def seconds(key: str, value: Any, low: float, high: float) -> float:
    """`value` as a finite number of seconds in [low, high] (numbers or numeric strings;
    booleans refused)."""
    return amount(key, value, low, high, "seconds")


def amount(key: str, value: Any, low: float, high: float, unit: str) -> float:
    """`value` as a finite number of `unit` in [low, high] (numbers or numeric strings;
    booleans refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{PREFIX}{key} must be a number of {unit}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{PREFIX}{key} must be a number of {unit}, got {value!r}") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{PREFIX}{key} must be in [{low:g}, {high:g}] {unit}, got {value!r}")
    return number


def whole(key: str, value: Any, low: int, high: int) -> int:
    """`value` as a whole number in [low, high] (ints or their strings; booleans refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{PREFIX}{key} must be a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{PREFIX}{key} must be a whole number, got {value!r}") from None
    if not low <= number <= high:
        raise ValueError(f"{PREFIX}{key} must be in [{low}, {high}], got {value!r}")
    return number


def text(key: str, value: Any) -> str:
    """`value` as a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{PREFIX}{key} must be a non-empty string, got {value!r}")
    return value


def split_endpoints(endpoint: str) -> tuple[str, ...]:
    """The servers a `kvflow.endpoint` value names: one, or a comma-separated list of one
    per rank."""
    return tuple(part.strip() for part in endpoint.split(","))


def endpoint_list(key: str, value: Any) -> str:
    """`value` as a ZMQ endpoint or a comma-separated list of them (`split_endpoints`),
    each tcp://... or ipc://... (the first that is not is named)."""
    listed = text(key, value)
    for part in split_endpoints(listed):
        if not part.startswith(("tcp://", "ipc://")):
            raise ValueError(
                f"{PREFIX}{key} must look like tcp://HOST:PORT (or a comma-separated list of"
                f" them, one server per rank), got {part!r}"
            )
    return listed
