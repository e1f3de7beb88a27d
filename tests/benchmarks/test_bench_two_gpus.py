"""benchmarks/bench_two_gpus.py over shared memory: a world_size=2 model with one instance
per rank (each rank a process of its own, or a thread) through one real server
subprocess, both ranks storing and retrieving at once;
its checks (a lookup hits only once both ranks stored, retrieved blocks equal the stored
ones on each rank) must hold. The GB/s figures are GPU measurements (docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_two_gpus.py"


@pytest.mark.parametrize(
    ("flags", "through"),
    [
        ([], "through one server, a process per rank (2)"),
        (["--rank-threads"], "through one server, ranks as threads of one process"),
        (["--in-process"], "one engine in this process"),
        (["--server-per-rank"], "a server per rank, a process per rank (2)"),
        (["--shards", "2"], "through one server of 2 shards, a process per rank (2)"),
    ],
    ids=["rank-processes", "rank-threads", "in-process", "server-per-rank", "shards"],
)
def test_two_ranks_on_cpu_pass_the_checks_and_report_every_phase(
    tmp_path: Path, flags: list[str], through: str
) -> None:
    """Each rank alone and both at once, both ops, with all/rank0 ratios, through a server,
    a server per rank, or (--in-process) one engine in the benchmark's process, whose
    event lines stay out of the table."""
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "512", "--repeat", "1",
         "--json", str(out), *flags],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"2 ranks, cpu, {through}" in done.stdout
    assert "kvflow.events" not in done.stdout + done.stderr
    for phase in ("rank0", "rank1", "all"):
        for op in ("store", "retrieve"):
            row = re.search(rf"^{phase}\s+{op}\s+([\d.]+)$", done.stdout, re.M)
            assert row is not None and float(row.group(1)) > 0, done.stdout
    figures = json.loads(out.read_text())
    assert figures["ranks"] == 2
    assert figures["rank_processes"] == (0 if "process per rank" not in through else 2)
    for op in ("store", "retrieve"):
        assert figures[f"{op}_scaling"] == figures[f"all_{op}_gbps"] / figures[f"rank0_{op}_gbps"]
        assert f"{op} all/rank0:" in done.stdout
    # through a server, each rank alone and with the others: its calls' round trip and the
    # server's share of it
    served = "--in-process" not in flags
    for rank in (0, 1):
        for prefix, when in ((f"rank{rank}", "alone"), (f"all_rank{rank}", "with the others")):
            line = re.search(rf"^rank{rank} {when}, medians: store round trip ([\d.]+) ms, in"
                             rf" the server ([\d.]+); retrieve round trip ([\d.]+) ms, in the"
                             rf" server ([\d.]+)$", done.stdout, re.M)  # fmt: skip
            assert (line is not None) == served, done.stdout
            for op in ("store", "retrieve"):
                keys = (f"{prefix}_{op}_round_trip_ms", f"{prefix}_{op}_server_ms")
                assert all(k in figures for k in keys) == served
                if served:
                    assert 0 < figures[keys[1]] < figures[keys[0]]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ranks", "3"], "--ranks must be 2, 4 or 8"),
        (["--in-process", "--server-flag=--disable-observability"], "--server-flag needs a server"),
        (["--in-process", "--server-per-rank"], "exclude each other"),
        (["--in-process", "--rank-threads"], "runs every rank as a thread already"),
        (["--server-per-rank", "--shards", "2"], "--shards needs the one server"),
    ],
    ids=[
        "ranks-that-do-not-split-the-heads",
        "server-flags-in-process",
        "per-rank-in-process",
        "rank-threads-in-process",
        "shards-per-rank",
    ],
)
def test_usage_errors_exit_2_naming_what_is_wrong(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", *flags],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and message in done.stderr


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
