"""benchmarks/bench_two_gpus.py over shared memory: a world_size=2 model with one instance
per rank through one real server subprocess, both ranks storing and retrieving at once;
its checks (a lookup hits only once both ranks stored, retrieved blocks equal the stored
ones on each rank) must hold. The GB/s figures are GPU measurements (docs/PERFORMANCE.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_two_gpus.py"


def test_two_ranks_on_cpu_pass_the_checks_and_report_both_phases() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "512", "--repeat", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for op in ("store", "retrieve"):
        row = re.search(rf"^{op}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", done.stdout, re.M)
        assert row is not None, done.stdout
        one, two, ratio = map(float, row.groups())
        assert one > 0 and two > 0 and ratio > 0  # printed rounded: no ratio arithmetic


def test_too_few_gpus_is_a_clear_failure() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 1 and "needs 2 GPUs" in done.stdout


def test_same_gpu_needs_cuda_and_one_gpu() -> None:
    """--same-gpu (both ranks on cuda:0) is refused on the CPU by name, and without any
    GPU fails as clearly as the two-GPU run."""
    wrong = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--same-gpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert wrong.returncode == 2 and "--same-gpu needs --device cuda" in wrong.stderr
    none = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--same-gpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert none.returncode == 1 and "needs a GPU, found 0" in none.stdout
