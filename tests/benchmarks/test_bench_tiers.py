"""benchmarks/bench_tiers.py --quick runs end to end and reports every figure (no timing
assertions: the figures only have to exist and be positive): the disk tier, and the
Redis tier against a redis-server the benchmark starts itself (that part skips, saying
so, only where redis-server is not installed)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.requirements import find, require_or_skip

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_tiers.py"
SECTIONS = ("tiers", "scaling", "latency", "prefetch", "redis")
HAVE_REDIS = find("redis-server") is not None


def _figures(obj: object, path: str = "") -> list[tuple[str, float]]:
    """Measured numbers of a result section, counts (which may be 0) left out."""
    if isinstance(obj, dict):
        return [f for k, v in obj.items() if k != "counts" for f in _figures(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [f for i, v in enumerate(obj) for f in _figures(v, f"{path}[{i}]")]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return [(path, float(obj))]
    return []


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    """One --quick run (disk and, where redis-server exists, Redis): (JSON, stdout, --dir)."""
    tmp = tmp_path_factory.mktemp("bench-tiers")
    out = tmp / "tiers.json"
    work = tmp / "disk"
    work.mkdir()
    cmd = [sys.executable, str(SCRIPT), "--quick", "--dir", str(work), "--json", str(out)]
    if not HAVE_REDIS:
        cmd.append("--no-redis")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout + done.stderr, work


@pytest.mark.slow
def test_quick_run_reports_every_figure(quick: tuple[dict[str, Any], str, Path]) -> None:
    res, output, work = quick
    assert "pass" in output or "FAIL" in output  # the table was printed
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
    figures = [f for section in SECTIONS if section in res for f in _figures(res[section], section)]
    assert len(figures) > 40
    for path, value in figures:
        if path.endswith("_pct"):  # an added latency: signed
            assert math.isfinite(value), path
        else:
            assert value > 0 and math.isfinite(value), f"{path} = {value}"
    assert res["latency"]["counts"]["written_through_chunks"] > 0
    assert list(work.iterdir()) == []  # the benchmark cleaned up after itself


@pytest.mark.slow
def test_quick_run_covers_the_redis_tier(quick: tuple[dict[str, Any], str, Path]) -> None:
    require_or_skip("redis-server", "the benchmark's Redis section (the quick run had --no-redis)")
    res, output, _ = quick
    server = res["machine"]["redis"]
    assert server["started_here"] and server["local"]
    assert server["redis_version"] not in ("", "?")
    assert "started a local redis-server" in output and "stopped at its end" in output
    cases = res["redis"]["cases"]
    assert [case["model"] for case in cases] == ["32MiB", "1MiB"]
    for case in cases:
        for name in ("tier_store", "tier_load", "ceil_set", "ceil_get"):
            assert case["gbps"][name] > 0, (case["model"], name)
        assert case["store_ratio"] > 0 and case["load_ratio"] > 0
    lookup = res["redis"]["lookup"]
    assert lookup["keys"] == 500
    for name in ("tier_p50_ms", "tier_p90_ms", "ceiling_p50_ms", "ceiling_p90_ms", "ratio"):
        assert lookup[name] > 0, name
    counts = lookup["counts"]
    assert counts["tier_round_trips"] == 1  # a structural fact, not a timing
    assert counts["ceiling_round_trips"] == 1
    assert counts["tier_exists_calls"] == counts["ceiling_exists_calls"] == 500
    for line in ("redis store 32MiB GB/s", "redis load 1MiB GB/s", "redis contains 500 keys"):
        assert line in output, line
    port = int(server["url"].rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock:  # the benchmark stopped its server
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "its redis-server still listens"
