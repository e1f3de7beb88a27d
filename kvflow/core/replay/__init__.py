"""After-the-fact questions answered from a recorded event log (docs/EVENTLOG.md).

`kvflow replay` feeds a log's events, in order, through the subscribers a server
runs (metrics, logs, traces, L0 lifecycle; OTLP export too) and prints what they
computed; `kvflow whatif` simulates L1 at other capacities from the recorded
lookups, stores and retrieves.
This room imports kvflow.events, kvflow.subscribers and kvflow.core.config only.
"""
