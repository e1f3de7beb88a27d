"""kvflow as SGLang's HiCache storage tier: `KVFlowHiCacheStorage`, built by SGLang's
`StorageBackendFactory` (`--hicache-storage-backend dynamic`, extra config
`"module_path": "kvflow.integrations.sglang", "class_name": "KVFlowHiCacheStorage"`).

The class subclasses SGLang's `HiCacheStorage` and so imports SGLang: it is loaded only
when asked for, so importing this package, and kvflow, never needs SGLang. config,
identity and layout are plain kvflow + torch. docs/SGLANG.md says how to run it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVFlowHiCacheStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVFlowHiCacheStorage":
        from kvflow.integrations.sglang import storage

        return storage.KVFlowHiCacheStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
