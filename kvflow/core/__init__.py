"""Composition of events, kernels and storage tiers into the cache engine, its server and its demo.

Rooms: `engine` (the in-process `CacheEngine`), `tiers` (where chunk objects live: L1
now, L2 next), `server` (the wire: `KVFlowServer`, `KVFlowClient`, memory sharing, CLI)
and `demo` (`kvflow demo`, `kvflow bench`). `config`, `errors` and `arrays` are shared
by all of them. This module re-exports the public API, each name imported on first use:
importing a leaf (a tier's interface, `server.shm` in a vLLM worker) loads neither ZMQ
nor the engine, client or server.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvflow.core.config import ObservabilityConfig, ServerConfig
    from kvflow.core.engine.cache_engine import CacheEngine
    from kvflow.core.server.client import KVFlowClient
    from kvflow.core.server.server import KVFlowServer
    from kvflow.core.server.shm import empty_shared

#: exported name -> the module that defines it
_EXPORTS = {
    "CacheEngine": "kvflow.core.engine.cache_engine",
    "KVFlowClient": "kvflow.core.server.client",
    "KVFlowServer": "kvflow.core.server.server",
    "ObservabilityConfig": "kvflow.core.config",
    "ServerConfig": "kvflow.core.config",
    "empty_shared": "kvflow.core.server.shm",
}

__all__ = [
    "CacheEngine",
    "KVFlowClient",
    "KVFlowServer",
    "ObservabilityConfig",
    "ServerConfig",
    "empty_shared",
]


def __getattr__(name: str) -> Any:
    """Import an exported name's module on first access and keep the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
