"""The connector's settings: the `kvflow.`-prefixed keys of vLLM's `kv_connector_extra_config`.

Parsed and validated without vLLM, so the rules are testable anywhere. Every bad
value raises ValueError naming the key (docs/VLLM.md lists them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvflow.core.server.staging import MAX_SLOTS
from kvflow.integrations.extra_config import (
    PREFIX,
    amount,
    endpoint_list,
    seconds,
    split_endpoints,
    text,
    whole,
)

#: the staging ring a CUDA worker loading layer by layer gets when the config names none:
#: this many slots, each one layer of DEFAULT_SLOT_TOKENS tokens (a longer prompt's layers
#: go the server's way); on the H200 it took a 32k prompt in shuffled blocks from 1.18 to
#: 1.08 of its floor (docs/PERFORMANCE.md, "Layerwise: (e)")
DEFAULT_RING_SLOTS = 4
DEFAULT_SLOT_TOKENS = 32768


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{PREFIX}{key} must be a boolean, got {value!r}")


@dataclass(frozen=True)
class ConnectorConfig:
    """What the connector reads from `kv_connector_extra_config` (docs/VLLM.md, Config keys)."""

    #: the kvflow server's ZMQ endpoint, or a comma-separated list of one per rank (a
    #: server process per GPU: rank r talks to the r-th, lookups ask each for its rank)
    endpoint: str = "tcp://127.0.0.1:5555"
    #: the longest a store, retrieve or registration waits for the server
    timeout_s: float = 30.0
    #: the longest the scheduler's background lookup waits; then the request runs as a miss
    lookup_timeout_s: float = 5.0
    #: the model name chunk keys are made with (default: vLLM's model and dtype)
    model_name: str | None = None
    #: a salt mixed into every key (requests' own `cache_salt` wins)
    cache_salt: str | None = None
    #: load hits into vLLM's blocks
    load: bool = True
    #: store the prompts' full chunks after each forward pass
    store: bool = True
    #: report block allocations to the server (its L0 lifecycle subscriber)
    report_allocations: bool = True
    #: set vLLM's kv_load_failure_policy to "recompute": a chunk lost between lookup and
    #: load is recomputed, never an error (vLLM's own default, "fail", ends the request)
    recompute_failed_loads: bool = True
    #: load layer by layer, each layer waited for right before its attention (None: on
    #: for CUDA caches, where the copy hides behind the forward pass; off on CPU)
    layerwise: bool | None = None
    #: with layerwise loads: a staging ring of this many slots (0: none) of
    #: `staging_slot_mb` each in the worker's GPU memory, where the server stages a layer
    #: whose blocks need a scatter and the worker scatters it (docs/ENGINE.md, "Staging in
    #: the engine"); a slot should hold one layer of the longest prompt. None: on CUDA
    #: `DEFAULT_RING_SLOTS` slots of one layer of `DEFAULT_SLOT_TOKENS` tokens, none on CPU
    staging_slots: int | None = None
    staging_slot_mb: float | None = None
    #: the prefix of the registered instance ids (`<prefix>-rank<r>`; default: vLLM's engine id)
    instance_id: str | None = None
    #: CURVE: the server's public key (NAME.key or its 40 Z85 characters) ...
    curve_server_key: str | None = None
    #: ... and this client's key pair (NAME.key_secret)
    curve_key: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Read the `kvflow.*` keys; other keys are left to others, unknown `kvflow.*` ones refused."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for full_key, value in (extra or {}).items():
            if not isinstance(full_key, str) or not full_key.startswith(PREFIX):
                continue
            key = full_key[len(PREFIX) :]
            if key not in known:
                raise ValueError(
                    f"unknown kv_connector_extra_config key {full_key!r}; known:"
                    f" {', '.join(PREFIX + k for k in sorted(known))}"
                )
            values[key] = cls._parse(key, value)
        config = cls(**values)
        mb = config.staging_slot_mb
        if config.staging_slots == 0 and mb:
            raise ValueError(
                f"{PREFIX}staging_slot_mb sizes the slots of a staging ring, but"
                f" {PREFIX}staging_slots is 0 (no ring)"
            )
        if mb == 0 and config.staging_slots != 0:  # 0 with 0 slots: no ring, as it always was
            raise ValueError(
                f"{PREFIX}staging_slot_mb must be more than 0 MiB (or 0 with"
                f" {PREFIX}staging_slots 0: no ring), got 0"
            )
        if config.staging_slots and config.layerwise is False:
            raise ValueError(f"{PREFIX}staging_slots needs layerwise loads ({PREFIX}layerwise)")
        if (config.curve_server_key is None) != (config.curve_key is None):
            raise ValueError(
                f"{PREFIX}curve_server_key and {PREFIX}curve_key go together (the server's"
                " public key and this client's NAME.key_secret)"
            )
        return config

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoint, or each rank's when `endpoint` lists one per rank."""
        return split_endpoints(self.endpoint)

    def rank_endpoints(self, world_size: int) -> tuple[str, ...]:
        """One endpoint for the whole engine, or one per rank (ValueError unless the list
        has exactly world_size of them)."""
        endpoints = self.endpoints
        if len(endpoints) > 1 and len(endpoints) != world_size:
            raise ValueError(
                f"{PREFIX}endpoint lists {len(endpoints)} endpoints for a world of"
                f" {world_size} ranks: give one, or one per rank"
            )
        return endpoints

    def endpoint_of(self, rank: int, world_size: int) -> str:
        """The endpoint rank `rank` stores to and loads from."""
        endpoints = self.rank_endpoints(world_size)
        return endpoints[rank] if len(endpoints) > 1 else endpoints[0]

    @staticmethod
    def _parse(key: str, value: Any) -> Any:
        if key == "endpoint":
            return endpoint_list(key, value)
        if key == "timeout_s":
            return seconds(key, value, 0.001, 86400.0)
        if key == "lookup_timeout_s":
            return seconds(key, value, 0.001, 600.0)
        if key in ("load", "store", "report_allocations", "recompute_failed_loads", "layerwise"):
            return _bool(key, value)
        if key == "staging_slots":
            return whole(key, value, 0, MAX_SLOTS)
        if key == "staging_slot_mb":
            return amount(key, value, 0.0, 65536.0, "MiB")
        return text(key, value)


def staging_ring(
    config: ConnectorConfig, layerwise: bool, cuda: bool, layer_token_bytes: int
) -> tuple[int, int]:
    """(slots, bytes per slot) of a worker's staging ring, (0, 0) for none: what the config
    names, else on CUDA with layerwise loads DEFAULT_RING_SLOTS slots of one layer of
    DEFAULT_SLOT_TOKENS tokens (`layer_token_bytes`: a token's bytes in the widest layer);
    none on CPU, where the engine's own scatter only costs."""
    slots = config.staging_slots
    if slots is None:
        slots = DEFAULT_RING_SLOTS if cuda else 0
    if not layerwise or not slots:
        return 0, 0
    if config.staging_slot_mb is not None:
        return slots, int(config.staging_slot_mb * (1 << 20))
    return slots, layer_token_bytes * DEFAULT_SLOT_TOKENS
