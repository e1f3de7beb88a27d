"""The connection flags `kvflow top` and `kvflow report` share, and the client they make.

Both read a server's status request, so both need what any client needs to reach
it: the endpoint, a timeout, and for a server that requires CURVE the server's
public key and this client's key pair (docs/SERVER.md, "Authentication with CURVE").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvflow.core.server.client import KVFlowClient

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"


def seconds_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds in [low, high] (a clear error otherwise)."""

    def parse(text: str) -> float:
        value = float(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be a number of seconds in [{low:g}, {high:g}], got {text}"
            )
        return value

    return parse


def parse_args(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`p.parse_args(argv)`, refusing one CURVE flag without the other (exit 2)."""
    args = p.parse_args(argv)
    if (args.curve_server_key is None) != (args.curve_key is None):
        p.error("--curve-server-key and --curve-key go together")
    return args


def add_connection_args(p: argparse.ArgumentParser, timeout: Callable[[str], float]) -> None:
    """--endpoint, --timeout-s (parsed by `timeout`), --curve-server-key and --curve-key."""
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="the server's tcp://HOST:PORT")
    p.add_argument("--timeout-s", type=timeout, default=5.0, help="status request timeout")
    p.add_argument(
        "--curve-server-key", metavar="FILE", help="the server's CURVE public key (NAME.key)"
    )
    p.add_argument(
        "--curve-key", metavar="FILE", help="this client's CURVE key pair (NAME.key_secret)"
    )


def connect(args: argparse.Namespace) -> KVFlowClient:
    """A client of the server the parsed connection flags name (ValueError if they clash)."""
    return KVFlowClient(
        args.endpoint,
        timeout_s=args.timeout_s,
        curve_server_key=args.curve_server_key,
        curve_key=args.curve_key,
    )
