"""benchmarks/bench_blend.py on the CPU at toy size: the whole flow (a real server
subprocess over shared memory, the paged cache, blend lookup and retrieves, the selective
recompute) runs and its checks hold; the figures themselves are GPU measurements
(docs/E2E.md, "Blend")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_blend.py"


def _run(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def test_toy_run_on_cpu_blends_both_documents_and_checks_full_recompute(tmp_path: Path) -> None:
    rows_path = tmp_path / "rows.json"
    done = _run("--device", "cpu", "--shape", "toy", "--doc-tokens", "256", "--question-tokens",
                "16", "--fractions", "0,1", "--repeat", "1", "--json", str(rows_path))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(rows_path.read_text())
    # system 256 + B 256 + A 256 + question 16; both documents are whole chunks
    assert [(r["prompt"], r["prefix"], r["blended"], r["fraction"]) for r in rows] == [
        (784, 256, 512, 0.0),
        (784, 256, 512, 1.0),
    ]
    # fraction 0: the question, the first 4 tokens of each document; 1.0: all past the prefix
    assert [r["recomputed"] for r in rows] == [16 + 2 * 4, 528]
    assert rows[1]["logits_rel_err"] <= 0.05
    for row in rows:
        for key in ("full_ms", "prefix_ms", "blend_ms", "lookup_ms", "retrieve_ms", "recompute_ms"):
            assert row[key] > 0, key
        assert row["speedup"] == row["full_ms"] / row["blend_ms"]
    assert "(c) blend" in done.stdout and "says nothing about a trained model" in done.stdout


def _load(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The script as a module (its folder on sys.path, as when it runs as a script)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_blend", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_blend", module)  # its dataclass looks it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv", [["--doc-tokens", "100"], ["--fractions", "1.5"], ["--repeat", "0"]]
)
def test_bad_arguments_are_usage_errors(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _load(monkeypatch).main(["--device", "cpu", "--shape", "toy", *argv])
    assert exc.value.code == 2 and "--doc-tokens >=" in capsys.readouterr().err


def test_cuda_without_a_gpu_and_pycuda_refuses_saying_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = _load(monkeypatch)
    monkeypatch.setattr("kvflow.kernels.cuda_available", lambda: False)
    assert bench.main(["--device", "cuda", "--shape", "8b"]) == 1
    assert "needs a CUDA GPU and pycuda" in capsys.readouterr().err
