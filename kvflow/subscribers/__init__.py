"""Consumers of the event stream: metrics, logging, tracing, L0 lifecycle."""
