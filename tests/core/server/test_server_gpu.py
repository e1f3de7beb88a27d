"""GPU: KV shared with a server process through CUDA IPC round-trips bit-exactly (skips on CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.kernels import cuda_available

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_ipc_roundtrip.py"


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_cuda_ipc_round_trip_between_processes() -> None:
    """Three layouts, stored without synchronizing, retrieved into other blocks: exact."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--repeat", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
