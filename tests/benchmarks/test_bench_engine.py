"""benchmarks/bench_engine.py on the CPU at its small size: the bit-exact round trip,
the per-op and sustained timings and their JSON run end to end; the on/off figures
themselves are GPU measurements (docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_engine.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_small_cpu_run_reports_every_round_and_the_spread(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    done = _run("--device", "cpu", "--small", "--cases", "fa-bf16-bs16", "sgl-mha-bf16-bs1",
                "--reps", "1", "--rounds", "3", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == ["fa-bf16-bs16", "sgl-mha-bf16-bs1"]
    for row in rows:
        assert len(row["sustained_rounds"]) == 3
        assert all(x > 0 for x in row["sustained_rounds"])
        assert sorted(row["sustained_rounds"])[1] == row["sustained_on_off"]  # the median
        assert row["dropped"] == 0 and row["open_ops"] == 0
        assert row["ends"] > 0  # the observed engine published its stores' END events
    assert "sustained rounds: 6, on/off interquartile range" in done.stdout


def test_rounds_below_one_are_refused_by_name() -> None:
    done = _run("--device", "cpu", "--rounds", "0")
    assert done.returncode == 2
    assert "--reps and --rounds must be >= 1" in done.stderr
