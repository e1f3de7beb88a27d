"""The backend's settings, from SGLang's `--hicache-storage-backend-extra-config` JSON.

SGLang's `dynamic` backend needs `backend_name`, `module_path` and `class_name`; the
zero-copy path needs `interface_v1` (else SGLang copies every page through Python
tensors) and the host pool in shared memory needs `allocator: "shm"`. kvflow's own
keys carry a `kvflow.` prefix; unknown ones are refused. Every bad value raises
ValueError naming the key (docs/SGLANG.md lists them). No SGLang import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvflow.integrations.extra_config import PREFIX, endpoint_list, seconds, split_endpoints, text


@dataclass(frozen=True)
class StorageConfig:
    """The `kvflow.*` keys of the extra config (docs/SGLANG.md, Config keys)."""

    #: the kvflow server's ZMQ endpoint, or a comma-separated list of one server per
    #: rank of kvflow's world (rank 0's first: `server_of`)
    endpoint: str = "tcp://127.0.0.1:5555"
    #: the longest one batch (exists, get or set) waits for the server; then it failed
    timeout_s: float = 5.0
    #: the model name keys are made with (default: SGLang's model name, the KV dtype, MHA/MLA)
    model_name: str | None = None
    #: a salt mixed into every key: engines whose KV must not mix use different salts
    cache_salt: str | None = None
    #: the prefix of the instance id this rank registers (`<prefix>-tp<t>-pp<p>...`)
    instance_id: str = "sglang"
    #: CURVE: the server's public key (NAME.key or its 40 Z85 characters) ...
    curve_server_key: str | None = None
    #: ... and this client's key pair (NAME.key_secret)
    curve_key: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageConfig:
        """Check SGLang's switches this backend needs, then read the `kvflow.*` keys."""
        extra = extra or {}
        if extra.get("interface_v1") not in (1, True, "1", "true", "True"):
            raise ValueError(
                'kvflow moves pages only zero-copy: add "interface_v1": 1 to'
                " --hicache-storage-backend-extra-config"
            )
        if extra.get("allocator") != "shm":
            raise ValueError(
                'kvflow maps SGLang\'s host pool in shared memory: add "allocator": "shm" to'
                " --hicache-storage-backend-extra-config"
            )
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for full_key, value in extra.items():
            if not isinstance(full_key, str) or not full_key.startswith(PREFIX):
                continue
            key = full_key[len(PREFIX) :]
            if key not in known:
                raise ValueError(
                    f"unknown extra-config key {full_key!r}; known:"
                    f" {', '.join(PREFIX + k for k in sorted(known))}"
                )
            if key == "timeout_s":
                values[key] = seconds(key, value, 0.001, 3600.0)
            else:
                values[key] = endpoint_list(key, value) if key == "endpoint" else text(key, value)
        config = cls(**values)
        if (config.curve_server_key is None) != (config.curve_key is None):
            raise ValueError(
                f"{PREFIX}curve_server_key and {PREFIX}curve_key go together (the server's"
                " public key and this client's NAME.key_secret)"
            )
        return config

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoint's servers: one, or one per rank."""
        return split_endpoints(self.endpoint)

    def server_of(self, world_size: int, rank: int) -> tuple[str, bool]:
        """(the server rank `rank` of a world of `world_size` talks to, whether it is that
        rank's own): the one endpoint, or the rank's of a list, which must name one server
        per rank (ValueError naming both counts otherwise)."""
        servers = self.endpoints
        if len(servers) == 1:
            return servers[0], False
        if len(servers) != world_size:
            raise ValueError(
                f"{PREFIX}endpoint lists {len(servers)} servers but this model's KV has"
                f" {world_size} ranks: list one server per rank, rank 0's first"
            )
        return servers[rank], True
