"""kvflow: a KV-cache offloading server for LLM inference, observed through an event bus."""

__version__ = "0.1.0"
