"""benchmarks/bench_rpc.py at a small size on the CPU: a real server, every case's row
with the hits it must find, and issue 39's ratios printed (no timing assertions: the
targets are the benchmark's to report, docs/PERFORMANCE.md, RPC)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_rpc.py"


def test_small_run_prints_every_case_with_its_hits_and_the_ratios() -> None:
    """2,048 tokens (8 chunks of 256), 12 calls a case: the stored prompt hits in full
    from an array, a session and a list; the prompt changed on every call hits nothing."""
    args = ["--iterations", "12", "--tokens", "2048", "--short-tokens", "256"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    hits = {
        m.group(1).strip(): int(m.group(2))
        for m in re.finditer(r"^(\d+ tokens[^\n]*?)\s+(\d+)\s+\d+us", done.stdout, re.M)
    }
    assert hits == {
        "2048 tokens, no request_id": 2048,
        "2048 tokens, same request_id": 2048,
        "2048 tokens as a list, no req_id": 2048,
        "2048 tokens, new prompt per call": 0,
        "256 tokens, no request_id": 256,
    }
    assert re.search(r"server p50 without / with a request id: \d+\.\d\d", done.stdout)
    assert re.search(r"round trip p50 from a list / from an array: \d+\.\d\d", done.stdout)
    assert re.search(r"kvflow as_int32_array \(its C loop\)\s+\d+us", done.stdout)
    assert re.search(
        r"keys of 2048 tokens, p50: chain_hashes \d+us; .* blake3 .* \d+us", done.stdout
    )
