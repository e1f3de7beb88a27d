"""tests/e2e/gpu_e2e.py checked without a GPU: `--device cpu` runs every case through
shared memory, the tensor-parallel rows included, and exits 0 only if all pass."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e import gpu_e2e, paged_kv

ROOT = Path(__file__).resolve().parents[2]


def test_every_case_passes_on_cpu_tensor_parallel_rows_included() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.e2e.gpu_e2e", "--device", "cpu", "--repeat", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    cases = len(paged_kv.LAYOUTS) * len(gpu_e2e.DTYPES) * (len(gpu_e2e.SKIPS) + 1)
    assert f"{cases}/{cases} cases passed" in done.stdout, done.stdout
    for layout in paged_kv.LAYOUTS:
        for dtype in gpu_e2e.DTYPES:
            row = rf"^tp2-{layout}\s+{dtype}\s+0 PASS\s+cpu,cpu\s"
            assert re.search(row, done.stdout, re.M), done.stdout
    assert "skipped" not in done.stdout


def test_one_gpu_skips_the_tensor_parallel_case_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    devices, skipped = gpu_e2e.tp_devices(torch.device("cuda", 0))
    assert devices == []
    assert skipped == "tensor-parallel case skipped: needs two GPUs, found 1"
