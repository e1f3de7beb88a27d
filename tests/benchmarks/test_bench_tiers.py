"""benchmarks/bench_tiers.py --quick runs end to end and reports every figure (no timing
assertions: the figures only have to exist and be positive)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_tiers.py"
SECTIONS = ("tiers", "scaling", "latency", "prefetch")


def _figures(obj: object, path: str = "") -> list[tuple[str, float]]:
    """Measured numbers of a result section, counts (which may be 0) left out."""
    if isinstance(obj, dict):
        return [f for k, v in obj.items() if k != "counts" for f in _figures(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [f for i, v in enumerate(obj) for f in _figures(v, f"{path}[{i}]")]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return [(path, float(obj))]
    return []


@pytest.mark.slow
def test_quick_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    work = tmp_path / "disk"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dir", str(work), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pass" in done.stdout or "FAIL" in done.stdout  # the table was printed
    res = json.loads(out.read_text())
    for key in ("cpu_model", "cpu_count", "python", "torch", "date"):
        assert res["machine"][key], key
    (d,) = res["machine"]["dirs"]
    assert d["fstype"] != "?" and d["free_bytes"] > 0
    assert {case["model"] for case in res["tiers"]} == {"32MiB", "1MiB"}
    for name in ("tier_store", "tier_load", "ceil_write", "ceil_read"):
        assert all(case["gbps"][name] > 0 for case in res["tiers"]), name
    for name in ("store_ratio", "load_ratio"):
        assert res["scaling"][name] > 0, name
    for name in ("added_p50_pct", "added_p90_pct", "on_p50_ms", "off_p50_ms"):
        assert name in res["latency"], name
    assert len(res["prefetch"]) == 2
    figures = [f for section in SECTIONS for f in _figures(res[section], section)]
    assert len(figures) > 40
    for path, value in figures:
        if path.endswith("_pct"):  # an added latency: signed
            assert math.isfinite(value), path
        else:
            assert value > 0 and math.isfinite(value), f"{path} = {value}"
    assert res["latency"]["counts"]["written_through_chunks"] > 0
    assert list(work.iterdir()) == []  # the benchmark cleaned up after itself
