"""Operator views of a running `kvflow server`: `kvflow top` and `kvflow report`.

Both read only the server's status request (`KVFlowClient.status()`), whose
engine part carries running totals (`activity`, see kvflow/core/engine/activity.py);
rates are differences between consecutive snapshots. This room may import the
engine and the server; neither imports it.
"""
