"""The device a GPU test runs on: `cuda:0`, and `cuda:1` with `cuda:0`'s context current.

A server drives every GPU of its host from a few threads, so each thread has whichever
context it last made current. The second case reproduces that on purpose: the test
thread makes device 0's primary context current, then works with an instance on
device 1, so any CUDA object made in "the current context" lands on the wrong device
and the test fails (CUDA_ERROR_INVALID_HANDLE). Tests of it carry the `gpu2` mark and
skip, saying why, on a machine with fewer than two GPUs.
"""

from __future__ import annotations

import pytest
import torch

#: fixture params: device index, with the `gpu2` mark on the second device
DEVICE_PARAMS = [
    pytest.param(0, id="cuda0"),
    pytest.param(1, id="cuda1-ctx0", marks=pytest.mark.gpu2),
]


def gpu_count() -> int:
    """CUDA devices torch sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_gpus(n: int) -> None:
    """Skip the calling test unless `n` GPUs are visible, naming how many are."""
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} CUDA GPUs, this machine has {have} (gpu2 tests need two)")


def make_context_current(index: int) -> None:
    """Make device `index`'s primary context (torch's) current on this thread."""
    torch.cuda.set_device(index)
    torch.zeros(1, device=torch.device("cuda", index)).add_(1)  # forces the context current


def device_under_test(index: int) -> torch.device:
    """`cuda:index`; for index > 0, with device 0's context current on this thread."""
    require_gpus(index + 1)
    make_context_current(0)
    return torch.device("cuda", index)
