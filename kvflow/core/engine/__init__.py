"""The cache engine: what a store, retrieve or lookup does, in-process.

`CacheEngine` converts and checks a request's ids at its boundary (`request`), keys
its chunks (`keys`), asks the storage tiers which chunks exist and where they go,
moves bytes between an instance's KV blocks and tier memory (`movers`) and observes
every operation through START/END event pairs (`ops`, `observability`). It never
imports the server or the demo: both are built on top of it.
"""

from kvflow.core.engine.cache_engine import CacheEngine

__all__ = ["CacheEngine"]
