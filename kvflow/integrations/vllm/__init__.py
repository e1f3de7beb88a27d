"""kvflow as a vLLM KV connector: `kv_connector_module_path = "kvflow.integrations.vllm"`.

`KVFlowConnector` (connector.py) subclasses vLLM's `KVConnectorBase_V1` and so
imports vLLM: it is loaded only when asked for (vLLM's `getattr` on this module),
so importing this package, and kvflow, never needs vLLM. The rest (config,
layout, plan, scheduler, worker, shared_kv) is plain kvflow + torch. docs/VLLM.md
says how to run it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVFlowConnector"]


def __getattr__(name: str) -> Any:
    if name in ("KVFlowConnector", "KVFlowConnectorMetadata"):
        from kvflow.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
