"""The server's client socket: a ROUTER bound where the config says (docs/SERVER.md).

A server listens on TCP (`--host`, `--port`), with CURVE when configured, and refuses a
reachable address without authentication unless told not to care. A shard of a sharded
server (`ServerConfig.shard_endpoint`) listens on an ipc:// socket in its front's private
directory instead: only its front, a process of the same user, reaches it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from kvflow.core.config import ServerConfig
from kvflow.core.server.addresses import bare_host
from kvflow.core.server.curve import CurveServer

log = logging.getLogger("kvflow.server")


def _check_host(host: str) -> None:
    """OSError naming --host unless it resolves (ZMQ would take an unknown name for a
    network interface and answer "No such device")."""
    if host == "*":
        return
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        raise OSError(
            f"--host {host!r} cannot be resolved ({exc.strerror}); give an IP address or a "
            "host name of this machine"
        ) from None


def _bind_address(host: str) -> tuple[str, bool]:
    """How ZMQ binds `host` (bare), and whether that needs its IPv6 option: an IPv6
    address goes in brackets, on a socket with IPv6 on."""
    try:
        ipv6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        return host, False
    return (f"[{host}]", True) if ipv6 else (host, False)


def _loopback_only(host: str) -> bool:
    """Whether every address `host` (bare) names is a loopback one ("*" is every interface)."""
    if host == "*":
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None)
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _check_exposure(config: ServerConfig, host: str) -> None:
    """ValueError unless the server listens on loopback only (`host`: --host, bare), uses
    CURVE, or is told not to care."""
    if config.curve or config.insecure_listen or _loopback_only(host):
        return
    raise ValueError(
        f"--host {config.host} accepts connections from other machines, and without"
        " authentication any of them could store, retrieve and read KV: give"
        " --curve-secret-key and --curve-authorized-keys (make keys with `kvflow keygen`),"
        " or --insecure-listen to accept every client that reaches the port"
    )


def listen(
    ctx: zmq.Context[Any], config: ServerConfig, max_bytes: int
) -> tuple[zmq.Socket[Any], CurveServer | None]:
    """The bound ROUTER socket and its CURVE authenticator (None: no CURVE); OSError
    naming the address when it cannot listen there (nothing left open)."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 1000
    # Frames up to twice the limit get an error reply; ZMQ drops larger ones (and the peer).
    router.setsockopt(zmq.MAXMSGSIZE, 2 * max_bytes)
    curve: CurveServer | None = None
    if config.shard_endpoint is not None:
        where = config.shard_endpoint
    else:
        where = f"{config.host}:{config.port}"
    try:
        if config.shard_endpoint is not None:
            router.bind(config.shard_endpoint)
            return router, None
        host = bare_host(config.host)
        _check_host(host)
        _check_exposure(config, host)
        if config.curve_secret_key and config.curve_authorized_keys:
            curve = CurveServer(ctx, config.curve_secret_key, config.curve_authorized_keys)
            curve.secure(router)
        address, router.ipv6 = _bind_address(host)
        port = "*" if config.port == 0 else str(config.port)
        router.bind(f"tcp://{address}:{port}")
    except BaseException as exc:
        close_listener(router, curve)
        if isinstance(exc, (zmq.ZMQError, OSError)):
            raise OSError(f"cannot listen on {where}: {exc}") from None
        raise
    return router, curve


def close_listener(router: zmq.Socket[Any], curve: CurveServer | None) -> None:
    """Close the socket at once and stop its authenticator."""
    router.close(0)
    if curve is not None:
        curve.stop()


def received(router: zmq.Socket[Any], most: int) -> Iterator[tuple[bytes, list[zmq.Frame]]]:
    """Up to `most` requests waiting on `router`: each peer's identity and its frames."""
    for _ in range(most):
        try:
            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        yield frames[0].bytes, frames[1:]


def send_reply(router: zmq.Socket[Any], frames: Sequence[Any]) -> None:
    """Send a reply's frames (the peer's identity first) without waiting: a peer that is
    gone, or whose queue is full, loses it."""
    try:
        router.send_multipart(frames, zmq.NOBLOCK)
    except zmq.ZMQError:
        log.debug("reply to a gone client dropped")
