"""The backend's extra-config rules, without SGLang (kvflow.integrations.sglang.config)."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.integrations.sglang.config import StorageConfig

BASE = {"interface_v1": 1, "allocator": "shm", "backend_name": "kvflow", "other": "left alone"}


def _config(**kvflow: Any) -> StorageConfig:
    return StorageConfig.from_extra_config(
        {**BASE, **{f"kvflow.{k}": v for k, v in kvflow.items()}}
    )


def test_defaults_and_values() -> None:
    assert _config() == StorageConfig()
    config = _config(endpoint="ipc:///tmp/kv", timeout_s="0.5", model_name="m", cache_salt="s")
    assert (config.endpoint, config.timeout_s, config.model_name, config.cache_salt) == (
        "ipc:///tmp/kv", 0.5, "m", "s",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"allocator": "shm"}, "interface_v1"),
        ({"interface_v1": 1}, '"allocator": "shm"'),
        ({**BASE, "allocator": "default"}, '"allocator": "shm"'),
        ({**BASE, "kvflow.timeout_s": 0}, "kvflow.timeout_s"),
        ({**BASE, "kvflow.timeout_s": True}, "kvflow.timeout_s"),
        ({**BASE, "kvflow.timeout_s": "soon"}, "kvflow.timeout_s"),
        ({**BASE, "kvflow.endpoint": "127.0.0.1:5555"}, "tcp://HOST:PORT"),
        ({**BASE, "kvflow.endpoint": "tcp://a:1,b:2"}, "got 'b:2'"),
        ({**BASE, "kvflow.endpoint": "tcp://a:1,"}, "got ''"),
        ({**BASE, "kvflow.model_name": ""}, "kvflow.model_name"),
        ({**BASE, "kvflow.curve_key": "k"}, "go together"),
        ({**BASE, "kvflow.salt": "x"}, "kvflow.cache_salt"),
    ],
)
def test_bad_configs_name_the_key(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        StorageConfig.from_extra_config(extra)


def test_a_list_of_servers_gives_each_rank_its_own() -> None:
    """One endpoint serves every rank (and counts every rank in a lookup); a list names
    one server per rank, rank 0's first, and must have one for each rank of the world."""
    one = _config(endpoint="tcp://h:1")
    assert one.server_of(4, 3) == ("tcp://h:1", False)
    listed = _config(endpoint="tcp://h:1, tcp://h:2,ipc:///tmp/k3")
    assert listed.endpoints == ("tcp://h:1", "tcp://h:2", "ipc:///tmp/k3")
    assert [listed.server_of(3, r) for r in range(3)] == [
        ("tcp://h:1", True), ("tcp://h:2", True), ("ipc:///tmp/k3", True),
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"lists 3 servers but this model's KV has 2 ranks"):
        listed.server_of(2, 0)
