"""Composition of events, kernels and storage tiers into the cache engine, its server and its demo.

Rooms: `engine` (the in-process `CacheEngine`), `tiers` (where chunk objects live: L1
now, L2 next), `server` (the wire: `KVFlowServer`, `KVFlowClient`, memory sharing, CLI)
and `demo` (`kvflow demo`, `kvflow bench`). `config`, `errors` and `arrays` are shared
by all of them. This module re-exports the public API.
"""

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.server.client import KVFlowClient
from kvflow.core.server.server import KVFlowServer
from kvflow.core.server.shm import empty_shared

__all__ = [
    "CacheEngine",
    "KVFlowClient",
    "KVFlowServer",
    "ObservabilityConfig",
    "ServerConfig",
    "empty_shared",
]
