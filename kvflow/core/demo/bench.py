"""`kvflow bench NAME [args]`: run benchmarks/bench_NAME.py from a source checkout."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


def available() -> list[str]:
    """Benchmark names found next to the package (a source checkout)."""
    return sorted(p.stem.removeprefix("bench_") for p in BENCH_DIR.glob("bench_*.py"))


def main(command: str, argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: kvflow bench NAME [args]\nbenchmarks: {', '.join(names) or 'none found'}")
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        print(
            f"kvflow bench: unknown benchmark {name!r} (available: {', '.join(names) or 'none'};"
            f" benchmarks run from a source checkout, looked in {BENCH_DIR})",
            file=sys.stderr,
        )
        return 2
    sys.argv = [f"bench_{name}.py", *argv[1:]]
    # as `python benchmarks/bench_NAME.py` would: the script's folder first on the path,
    # so a benchmark imports its siblings (bench_two_gpus uses bench_ttft's server)
    sys.path.insert(0, str(BENCH_DIR))
    runpy.run_path(str(BENCH_DIR / f"bench_{name}.py"), run_name="__main__")
    return 0
