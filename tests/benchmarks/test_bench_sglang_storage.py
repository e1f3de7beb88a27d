"""benchmarks/bench_sglang_storage.py at a tiny size in the SGLang venv: SGLang's own MHA
and MLA host pools, a real server, every step timed and written (no timing assertions:
the >= 0.8 target is the benchmark's to report, docs/SGLANG.md, Cost of the extra hop)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.requirements import require_or_skip

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_sglang_storage.py"
TINY = ("--pages", "4", "--reps", "2", "--layers", "2", "--heads", "2", "--head-dim", "8",
        "--page-size", "4")  # fmt: skip


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    python = require_or_skip("sglang-venv", "the benchmark runs SGLang's own host pools")
    return subprocess.run(
        [python, str(SCRIPT), *args], capture_output=True, text=True, timeout=280, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("pool", "layout", "page_bytes", "extra"),
    [
        ("mha", "page_first", 2 * 2 * 4 * 2 * 8 * 2, ()),  # K and V, layers, tokens, heads, values
        ("mla", "page_unified", 2 * 4 * 16 * 2, ("--mla", "--kv-lora-rank", "12", "--rope-dim", "4")),
    ],
    ids=["mha", "mla"],
)  # fmt: skip
def test_a_tiny_run_times_every_step_of_either_pool(
    tmp_path: Path, pool: str, layout: str, page_bytes: int, extra: tuple[str, ...]
) -> None:
    """Exit 0; the JSON names the pool and layout, its pages' size (fp16 or bf16 values)
    and a finite, positive rate and ratio for every step."""
    out = tmp_path / "figures.json"
    done = _run(*TINY, "--layout", layout, "--warm-l1", "--mover", "--json", str(out), *extra)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["pool"], res["layout"], res["pages"]) == (pool, layout, 4)
    assert res["page_bytes"] == page_bytes
    for step in ("set", "get", "copy", "copy1", "store", "retrieve"):
        rate = res[f"{step}_gb_per_s"]
        assert math.isfinite(rate) and rate > 0, (step, rate)
    for step in ("set", "get", "store", "retrieve"):
        assert math.isfinite(res[f"{step}_over_copy"]) and res[f"{step}_over_copy"] > 0, step
    assert f"{pool} {layout}: 4 pages of 0 KiB" in done.stdout


def test_a_layout_the_pool_lacks_is_refused_by_name() -> None:
    done = _run(*TINY, "--mla", "--layout", "page_head")
    assert done.returncode != 0 and "--mla: --layout must be one of" in done.stderr
    done = _run(*TINY, "--layout", "page_unified", "--pages", "0")
    assert done.returncode != 0 and "must be >= 1" in done.stderr
