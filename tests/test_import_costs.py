"""Importing a leaf module loads only what it uses (issue 40): the tier interface and the
shared-memory helpers the vLLM worker maps its KV caches with need neither ZMQ nor the
server, client or engine, so `kvflow.core`'s package import must not pull them in."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: modules a leaf import must leave unloaded: the wire library and the big rooms
HEAVY = (
    "zmq",
    "kvflow.core.engine.cache_engine",
    "kvflow.core.server.server",
    "kvflow.core.server.client",
)


def _loaded_after(statement: str) -> set[str]:
    """The HEAVY modules `sys.modules` holds after running `statement` in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("module", ["kvflow.core.tiers.base", "kvflow.core.server.shm"])
def test_leaf_modules_do_not_load_zmq_or_the_server(module: str) -> None:
    assert _loaded_after(f"import {module}") == set()


def test_package_names_still_resolve_on_first_use() -> None:
    """`from kvflow.core import X` works for every exported X, loading X's module then."""
    loaded = _loaded_after(
        "import kvflow.core as core\n"
        "assert set(core.__all__) <= set(dir(core))\n"
        "from kvflow.core import KVFlowClient, KVFlowServer, CacheEngine\n"
        "from kvflow.core import ObservabilityConfig, ServerConfig, empty_shared\n"
        "assert KVFlowServer.__module__ == 'kvflow.core.server.server'"
    )
    assert loaded == set(HEAVY)
