"""benchmarks/bench_probes.py at a small size on the CPU: it starts a real server, times
/healthz and /readyz idle and under store/retrieve load, and prints its table (no timing
assertions: the 10 ms target is the benchmark's to report, docs/OPERATIONS.md, Probes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_probes.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=280, cwd=ROOT
    )


def test_small_run_times_both_probes_idle_and_busy_and_prints_the_table(tmp_path: Path) -> None:
    """20 GETs of each probe per phase, one busy client: exit 0, every answer a 200 with
    the probe's body, a row per probe and phase with p50 <= p99 <= max, the busy phase
    really under load, the server stopped cleanly."""
    out = tmp_path / "probes.json"
    done = _run("--requests", "20", "--warmup", "2", "--busy-clients", "1", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads(out.read_text())
    assert set(res["phases"]) == {"idle", "busy"}
    for phase, probes in res["phases"].items():
        assert set(probes) == {"/healthz", "/readyz"}
        for path, row in probes.items():
            assert row["requests"] == 20 and row["codes"] == {"200": 20}, (phase, path)
            assert row["unexpected"] == []
            figures = (row["p50_ms"], row["p99_ms"], row["max_ms"])
            assert all(math.isfinite(x) and x > 0 for x in figures), (phase, path, figures)
            assert row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
    assert res["busy_clients_working"] == 1  # it had stored before the timing began
    assert set(res["busy_ops"]) == {"stores", "retrieves"}
    assert res["busy_errors"] == [] and res["server_exit"] == 0
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("probe"))
    assert (
        "p50 ms" in lines[header]
        and "p99 ms" in lines[header]
        and "target p99 < 10 ms" in lines[header]
    )
    rows = [line.split() for line in lines[header + 1 : header + 5]]
    assert [(r[0], r[1]) for r in rows] == [
        ("/healthz", "idle"), ("/readyz", "idle"), ("/healthz", "busy"), ("/readyz", "busy"),
    ]  # fmt: skip
    assert all(r[-1] in ("pass", "FAIL") for r in rows)
    assert "busy phase: 1 clients" in done.stdout


def test_bad_arguments_exit_2_naming_them() -> None:
    """--requests 0 is a usage error (exit 2) before any server starts."""
    done = _run("--requests", "0")
    assert done.returncode == 2
    assert "--requests >= 1" in done.stderr
