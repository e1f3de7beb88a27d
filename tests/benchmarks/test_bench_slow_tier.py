"""benchmarks/bench_slow_tier.py at a tiny size on the CPU: a burst against a disk tier
without and with a per-chunk delay, under a long and a zero backlog wait; it prints its
table and every row's figures exist (no timing assertions beyond what the backpressure
guarantees: with the long wait nothing is dropped and every chunk reaches the disk)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_slow_tier.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=280, cwd=ROOT
    )


def test_tiny_run_prints_a_row_per_delay_and_wait(tmp_path: Path) -> None:
    """L1 4 MiB, a burst of 2x L1 in 1 MiB stores, delays 0 and 500 ms per chunk (slower
    than the CPU engine's copies even on a loaded box), waits 10 s and 0 s: exit 0, four
    rows; the long wait drops nothing and puts every chunk on disk (the stores past the
    bound waited for the slow tier); the zero wait against the 500 ms tier drops (the
    backlog of 2 chunks fills after two stores), and what it did not drop is on disk;
    the disk was cleaned up."""
    out = tmp_path / "slow.json"
    work = tmp_path / "work"
    work.mkdir()
    done = _run(
        "--l1-mib", "4", "--store-mib", "1", "--burst-x", "2", "--delays-ms", "0,500",
        "--backlog-wait-s", "10", "--short-wait-s", "0", "--rounds", "1",
        "--dir", str(work), "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads(out.read_text())
    for key in ("cpu_model", "cpu_count", "python", "torch", "date"):
        assert res["machine"][key], key
    rows = {(r["delay_ms"], r["wait_s"]): r for r in res["rows"]}
    assert set(rows) == {(0.0, 10.0), (500.0, 10.0), (0.0, 0.0), (500.0, 0.0)}
    for row in rows.values():
        assert row["stores"] == 8 and row["chunks"] == 8 and row["store_chunks"] == 1
        assert len(row["store_ms"]) == 8
        figures = (row["p50_ms"], row["p99_ms"], row["max_ms"], row["burst_s"])
        assert all(math.isfinite(x) and x > 0 for x in figures), row
        assert row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert row["stored_chunks"] + row["dropped_chunks"] == row["chunks"]
        assert row["bound_bytes"] == 2 << 20
    for delay in (0.0, 500.0):
        assert rows[(delay, 10.0)]["dropped_chunks"] == 0
        assert rows[(delay, 10.0)]["stored_chunks"] == 8
    slow = rows[(500.0, 0.0)]
    assert slow["dropped_chunks"] > 0 and slow["drop_bursts"] >= 1
    # with the long wait the stores past the bound waited for the 500 ms tier
    assert rows[(500.0, 10.0)]["waits"] > 0 and rows[(500.0, 10.0)]["waited_s"] > 0.5
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("delay ms/chunk"))
    for name in ("p50 ms", "p99 ms", "waited s", "dropped", "on disk"):
        assert name in lines[header], name
    assert len([ln for ln in lines[header + 1 : header + 5] if ln.split()]) == 4
    assert list(work.iterdir()) == []


def test_bad_arguments_exit_2_naming_them() -> None:
    """A negative delay and a store larger than half of L1 are usage errors (exit 2)."""
    done = _run("--delays-ms", "0,-1")
    assert done.returncode == 2 and "--delays-ms" in done.stderr
    done = _run("--l1-mib", "4", "--store-mib", "3")
    assert done.returncode == 2 and "--store-mib" in done.stderr
