"""Adapters that let inference engines use a kvflow server (docs/VLLM.md for vLLM).

Each engine's adapter imports its engine lazily, so kvflow itself never needs it.
Integrations may import `kvflow.core` (the client and shared memory), nothing else.
"""
