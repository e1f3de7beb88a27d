"""Composition of events, kernels and storage into the cache engine and server."""

from kvflow.core.client import KVFlowClient
from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine import CacheEngine
from kvflow.core.server import KVFlowServer
from kvflow.core.shm import empty_shared

__all__ = [
    "CacheEngine",
    "KVFlowClient",
    "KVFlowServer",
    "ObservabilityConfig",
    "ServerConfig",
    "empty_shared",
]
