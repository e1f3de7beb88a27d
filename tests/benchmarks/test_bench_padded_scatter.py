"""benchmarks/bench_padded_scatter.py: its hand-written bounds check their own results
before they are timed (GPU), and it refuses bad arguments and a machine without CUDA
by name. Its figures are GPU measurements (docs/PERFORMANCE.md, Limits)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.kernels import cuda_available

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_padded_scatter.py"
SCATTERS = ("kvflow", "owned_words", "owned_words_prefetched", "pad_rewritten", "pad_zeroed")


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip


def test_without_cuda_it_says_what_it_needs() -> None:
    done = _run(env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert "bench_padded_scatter needs a CUDA GPU and pycuda" in done.stderr


def test_a_chunk_count_under_one_is_a_usage_error() -> None:
    done = _run("--chunks", "0")
    assert done.returncode == 2 and "--chunks must be at least 1" in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_every_scatter_lands_its_rows_and_is_timed_against_the_copy() -> None:
    done = _run("--chunks", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in SCATTERS:
        row = re.search(rf"^{name}\s+.+?\s+(\d+)\s+([\d.]+)$", done.stdout, re.M)
        assert row is not None, done.stdout
        assert float(row.group(1)) > 0 and float(row.group(2)) > 0
