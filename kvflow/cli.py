"""The `kvflow` command: dispatches to each subcommand's own module."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "server": ("kvflow.core.server.cli", "run a kvflow server"),
    "status": ("kvflow.core.server.cli", "print a running server's status"),
    "keygen": ("kvflow.core.server.cli", "write a CURVE key pair for server or client"),
    "admin": ("kvflow.core.server.admin_cli", "clear, resize L1, drain, tenant quotas"),
    "demo": ("kvflow.core.demo.app", "run an in-process engine on a synthetic workload"),
    "bench": ("kvflow.core.demo.bench", "run a benchmark from benchmarks/"),
    "top": ("kvflow.core.observe.top", "live terminal view of a running server"),
    "report": ("kvflow.core.observe.report", "plots and a summary of a server over an interval"),
    "replay": ("kvflow.core.replay.replay", "feed a recorded event log through the subscribers"),
    "whatif": ("kvflow.core.replay.whatif", "L1 hit rate at other sizes, from an event log"),
}


def _usage() -> str:
    lines = ["usage: kvflow <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvflow` console script."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvflow: unknown command {name!r}\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(name, rest))


if __name__ == "__main__":
    sys.exit(main())
