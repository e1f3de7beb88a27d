"""Hosts in `--host` and tcp:// endpoints, as the server binds them and clients connect:
an IPv6 address may come in brackets ("[::1]"). It imports nothing, so the command line
can use it without loading the server."""

from __future__ import annotations


def bare_host(host: str) -> str:
    """`host` without the brackets an IPv6 address may come in ("[::1]" is "::1")."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint as written (tcp://HOST:PORT or tcp://SOURCE;HOST:PORT,
    an IPv6 address in brackets); None when it is not tcp or has no host and port."""
    if not endpoint.startswith("tcp://"):
        return None
    address = endpoint[len("tcp://") :].rpartition(";")[2]
    host, sep, _ = address.rpartition(":")
    return host if sep and host else None
