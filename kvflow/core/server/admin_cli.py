"""`kvflow admin`: an operator's calls to a running server (docs/OPERATIONS.md).

`kvflow admin clear|resize|drain|undrain|quota [options]` sends one admin request
and prints its JSON result; `drain --wait` then polls until the server is drained.
Exit status: 0 done, 1 the server refused or failed (the message says why), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from kvflow.core.server.cli import STATUS_MAX_TIMEOUT_S, UsageError, _Parser, _unresolvable_host
from kvflow.core.server.protocol import (
    AdminClear,
    AdminDrain,
    AdminQuota,
    AdminRequest,
    AdminResize,
)

#: how often `drain --wait` asks whether the server is drained
_POLL_S = 0.2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvflow admin",
        description="Operate a running kvflow server: clear, resize L1, drain, tenant quotas."
        " Only admins may: a client whose CURVE key is in the server's --admin-keys, or,"
        " without CURVE, a client on the server's own machine (loopback).",
    )
    parser.add_argument(
        "--endpoint", default="tcp://127.0.0.1:5555", help="the server (tcp://HOST:PORT)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=30.0, metavar="X", help="seconds to wait (default 30)"
    )
    parser.add_argument(
        "--curve-server-key", metavar="FILE", help="the server's CURVE public key (NAME.key)"
    )
    parser.add_argument(
        "--curve-key", metavar="FILE", help="this admin's CURVE key pair (NAME.key_secret)"
    )
    actions = parser.add_subparsers(dest="action", required=True, parser_class=_Parser)
    clear = actions.add_parser("clear", help="drop a model's or a salt's objects from tiers")
    clear.add_argument("--model", metavar="NAME", help="only this model's objects")
    clear.add_argument("--salt", metavar="SALT", help="only objects with this cache_salt")
    clear.add_argument(
        "--tier", action="append", default=[], metavar="NAME",
        help="l1 or an L2 tier's name (repeat; default: every tier)",
    )  # fmt: skip
    clear.add_argument("--all", action="store_true", help="every object (no filter)")
    resize = actions.add_parser("resize", help="set L1's capacity live")
    resize.add_argument("--l1-size-gb", type=float, required=True, metavar="X")
    drain = actions.add_parser("drain", help="refuse new stores and registrations")
    drain.add_argument(
        "--wait", action="store_true", help="return once in-flight work has finished"
    )
    drain.add_argument(
        "--wait-timeout-s", type=float, default=300.0, metavar="X",
        help="longest --wait, in seconds (default 300); exit 1 if not drained by then",
    )  # fmt: skip
    actions.add_parser("undrain", help="take stores and registrations again")
    quota = actions.add_parser("quota", help="set or remove a tenant's L1 byte limit")
    who = quota.add_mutually_exclusive_group(required=True)
    who.add_argument("--salt", metavar="SALT", help="the tenant is this cache_salt")
    who.add_argument("--model", metavar="NAME", help="the tenant is this model")
    size = quota.add_mutually_exclusive_group(required=True)
    size.add_argument("--limit-gb", type=float, metavar="X", help="the limit in GiB")
    size.add_argument("--remove", action="store_true", help="remove the tenant's limit")
    return parser


def _request(args: argparse.Namespace) -> AdminRequest:
    """The admin request the parsed arguments describe."""
    action = args.action
    if action == "clear":
        if args.all and (args.model is not None or args.salt is not None):
            raise UsageError("clear: --all clears everything; give it without --model/--salt")
        if not args.all and args.model is None and args.salt is None:
            raise UsageError("clear needs --model, --salt or --all")
        return AdminClear(
            model_name=args.model, cache_salt=args.salt, tiers=args.tier, everything=args.all
        )
    if action == "resize":
        if not (math.isfinite(args.l1_size_gb) and args.l1_size_gb > 0):
            raise UsageError(f"--l1-size-gb must be a number > 0, got {args.l1_size_gb!r}")
        return AdminResize(l1_size_gb=args.l1_size_gb)
    if action in ("drain", "undrain"):
        return AdminDrain(undrain=action == "undrain")
    limit = None if args.remove else args.limit_gb
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise UsageError(f"--limit-gb must be a number > 0, got {limit!r}")
    if args.salt is not None:
        return AdminQuota(kind="salt", name=args.salt, limit_gb=limit)
    return AdminQuota(kind="model", name=args.model, limit_gb=limit)


def main(command: str, argv: list[str]) -> int:
    """Run `kvflow admin ...`; returns the exit status."""
    from kvflow.core.errors import KVFlowError
    from kvflow.core.server.client import KVFlowClient

    try:
        args = build_parser().parse_args(argv)
        if not (math.isfinite(args.timeout_s) and 0 < args.timeout_s <= STATUS_MAX_TIMEOUT_S):
            raise UsageError(
                f"--timeout-s must be a finite number in (0, {STATUS_MAX_TIMEOUT_S:g}] seconds,"
                f" got {args.timeout_s!r}"
            )
        if (args.curve_server_key is None) != (args.curve_key is None):
            raise UsageError("--curve-server-key and --curve-key go together")
        request = _request(args)
    except UsageError as exc:
        print(f"kvflow admin: error: {exc}", file=sys.stderr)
        return 2
    unresolved = _unresolvable_host(args.endpoint)
    if unresolved is not None:
        print(f"kvflow admin: error: {unresolved}", file=sys.stderr)
        return 1
    try:
        client = KVFlowClient(
            args.endpoint, timeout_s=args.timeout_s,
            curve_server_key=args.curve_server_key, curve_key=args.curve_key,
        )  # fmt: skip
    except ValueError as exc:
        print(f"kvflow admin: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = client.admin(request)
        if args.action == "drain" and args.wait:
            deadline = time.monotonic() + args.wait_timeout_s
            while not result["drained"] and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                result = client.status()["server"]["drain"]
            if not result["drained"]:
                print(json.dumps(result, indent=2, sort_keys=True))
                print(
                    f"kvflow admin: error: not drained after {args.wait_timeout_s:g} s",
                    file=sys.stderr,
                )
                return 1
    except KVFlowError as exc:
        print(f"kvflow admin: error: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0
