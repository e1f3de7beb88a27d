"""benchmarks/bench_kv_events.py at its smallest: the stream, flood, on/off and log parts
run end to end and print and write their figures (no timing assertions: the figures
only have to exist; docs/PERFORMANCE.md, KV events, has the measured ones)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_kv_events.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_tiny_run_prints_and_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "kv_events.json"
    # the benchmark stores for two seconds and at least three times, however slow a
    # loaded machine makes the first ones: it counts evictions from the third store on
    done = _run("--seconds", "2", "--ops", "2", "--rounds", "3", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads(out.read_text())
    stream = res["stream"]
    assert stream["stores"] >= 3 and stream["stores_per_s"] > 0
    # every chunk event the stores produced reached the subscriber: nothing lost
    assert stream["chunk_events_delivered"] == stream["chunk_events_produced"] > 0
    assert stream["records_lost"] == 0
    flood = res["flood"]
    assert 0 < flood["chunk_events_delivered"] <= flood["chunk_events_published"]
    onoff = res["onoff"]
    assert (onoff["rounds"], onoff["ops_per_round"], onoff["control"]) == (3, 2, False)
    assert onoff["on_off_median"] > 0 and len(onoff["on_off_iqr"]) == 2
    assert res["log"]["chunk_events_per_s"] > 0
    assert res["log_share_of_store"] > 0 and math.isfinite(res["log_share_of_store"])
    for line in ("stream: ", "flood: ", "on/off (KV-event log on): median ", "log alone: ",
                 "log work per store: "):  # fmt: skip
        assert line in done.stdout, line
