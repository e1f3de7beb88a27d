"""`kvflow bench NAME` runs benchmarks/bench_NAME.py as `python benchmarks/bench_NAME.py`
would: from any working directory, with the benchmark's siblings importable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_benchmark_importing_a_sibling_runs_from_elsewhere(tmp_path: Path) -> None:
    # bench_kernel_l2 imports bench_kernels' build variants; --help needs no GPU
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "bench", "kernel_l2", "--help"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--victim-mib" in done.stdout and "cs" in done.stdout


def test_an_unknown_benchmark_is_named_with_the_available_ones(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli", "bench", "nosuch"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert "unknown benchmark 'nosuch'" in done.stderr and "two_gpus" in done.stderr
