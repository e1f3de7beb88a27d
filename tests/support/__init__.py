"""Helpers only kvflow's own tests use: a small engine on a recording bus, an event
script builder, a naive KV transfer model, and real OTLP / Prometheus collectors
(these need dev-only dependencies: grpcio, the `prometheus` binary).

Helpers meant for users' own tests stay public in the package:
`kvflow.events.testing` and `kvflow.subscribers.testing`.
"""
