"""Composition of events, kernels and storage into the cache engine and server."""

from kvflow.core.config import ObservabilityConfig, ServerConfig

__all__ = ["ObservabilityConfig", "ServerConfig"]
