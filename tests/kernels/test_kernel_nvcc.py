"""Every .cu file compiles for sm_90 with warnings as errors, and the hot kernel never spills."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvflow.kernels.loader import CSRC_DIR

NVCC = shutil.which("nvcc")
SOURCES = sorted(CSRC_DIR.glob("*.cu"))
HOT_KERNELS = {"kvf_block_transfer", "kvf_block_transfer_linear"}


def _ptxas_report(source: Path, tmp_path: Path) -> dict[str, tuple[int, int, int]]:
    """Compile to a cubin; return {function: (registers, spill stores, spill loads)}."""
    assert NVCC is not None
    cmd = [
        NVCC,
        "-cubin",
        "-arch=sm_90",
        "-std=c++17",
        "-Werror",
        "all-warnings",
        "-Xptxas",
        "-v",
        "-o",
        str(tmp_path / (source.stem + ".cubin")),
        str(source),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report: dict[str, tuple[int, int, int]] = {}
    name = ""
    spills = (0, 0)
    for line in done.stderr.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            name = m.group(1)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            report[name] = (int(m.group(1)), *spills)
    return report


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_for_sm90_without_spills(source: Path, tmp_path: Path) -> None:
    """nvcc -cubin -arch=sm_90 -Werror all-warnings succeeds; ptxas reports zero spills."""
    report = _ptxas_report(source, tmp_path)
    print(source.name, report)
    assert set(report) >= HOT_KERNELS or source.name != "block_transfer.cu", report
    for name, (_, stores, loads) in report.items():
        if name in HOT_KERNELS:
            assert (stores, loads) == (0, 0), f"{name} spills: {stores} B stored, {loads} B loaded"


def test_the_hot_kernel_source_exists() -> None:
    """The package ships the transfer kernel's source (also checked where nvcc is absent)."""
    assert (CSRC_DIR / "block_transfer.cu").is_file()
