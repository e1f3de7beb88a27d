"""benchmarks/bench_ttft.py on the CPU at toy size: the whole flow (a real server
subprocess over shared memory, a real transformer, the paged cache) runs and its checks
hold; the figures themselves are GPU measurements (docs/PERFORMANCE.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_ttft.py"


def _load() -> object:
    spec = importlib.util.spec_from_file_location("bench_ttft", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ttft"] = module
    spec.loader.exec_module(module)
    return module


def test_toy_run_on_cpu_checks_logits_and_writes_rows_and_plot(tmp_path: Path) -> None:
    rows_path, png = tmp_path / "rows.json", tmp_path / "ttft.png"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "toy", "--lengths",
         "512,1024", "--repeat", "1", "--json", str(rows_path), "--png", str(png)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(rows_path.read_text())
    assert [(r["prompt"], r["prefix"], r["suffix"]) for r in rows] == [
        (512, 256, 256),
        (1024, 768, 256),
    ]
    for row in rows:
        assert row["logits_rel_err"] <= 0.05
        assert row["prefix_gib"] == row["prefix"] * 2 * 2 * 2 * 32 * 2 / (1 << 30)
        for key in (
            "recompute_ms",
            "kvflow_ms",
            "copy_ms",
            "suffix_ms",
            "retrieve_ms",
            "landed_ms",
        ):
            assert row[key] > 0, key
        assert math.isfinite(row["added_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "(a) recompute" in done.stdout and "(b-d)/c" in done.stdout


@pytest.mark.parametrize(("blocks", "slots"), [("in-order", 0), ("shuffled", 0), ("shuffled", 2)])
def test_layerwise_rows_on_cpu_for_blocks_in_order_and_shuffled(
    tmp_path: Path, blocks: str, slots: int
) -> None:
    """(e) on the toy model over shared memory, with the prompt's blocks placed in order
    (a fresh engine) or shuffled, shuffled ones also through a staging ring of the
    engine's: the layerwise columns are filled and the logits agree."""
    rows_path = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "toy", "--lengths", "512",
         "--repeat", "1", "--layerwise", "--blocks", blocks, "--staging-slots", str(slots),
         "--json", str(rows_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(rows_path.read_text())
    assert row["logits_rel_err"] <= 0.05
    assert row["layerwise_ms"] > 0 and row["layerwise_call_ms"] > 0
    assert row["blocks"] == blocks
    layers = 2  # the toy shape's
    assert row["staged_layers"] == (layers if slots else 0)
    assert row["ring_scatters"] == (layers if slots else 0)  # the first layers go alone
    assert row["wait_host_ms"] > 0 and "host in waits" in done.stdout
    by_layer = row["wait_host_by_layer_ms"]  # the host time of every layer's wait
    assert len(by_layer) == layers and all(ms > 0 for ms in by_layer)
    assert sum(by_layer) <= row["wait_host_ms"] * 1.5 and "of it layer 0" in done.stdout
    assert row["paired_over_floor"] > 0 and "e/floor paired" in done.stdout
    assert "(e) layerwise" in done.stdout
    # every repetition's (d), (e) and host in waits, for a pair's decomposition
    runs = [row[f"{k}_runs_ms"] for k in ("suffix", "layerwise", "wait_host")]
    assert [len(r) for r in runs] == [1, 1, 1] and all(r[0] > 0 for r in runs)
    assert runs[1][0] == row["layerwise_ms"] and runs[2][0] == row["wait_host_ms"]


def test_paged_cache_round_trips_a_transformers_cache() -> None:
    """write() then past() gives back the prefix's K and V exactly (independent of kvflow)."""
    import torch
    from transformers import DynamicCache

    bench = _load()
    shape = bench.SHAPES["toy"]  # type: ignore[attr-defined]
    model = bench.build_model(shape, torch.bfloat16, torch.device("cpu"))  # type: ignore[attr-defined]
    cache = bench.PagedCache(shape, 8, torch.bfloat16, torch.device("cpu"))  # type: ignore[attr-defined]
    past = DynamicCache(config=model.config)
    gen = torch.Generator().manual_seed(1)
    for layer in range(shape.layers):
        k, v = (torch.randn(1, shape.kv_heads, 40, shape.head_dim, generator=gen).bfloat16()
                for _ in range(2))  # fmt: skip
        past.update(k, v, layer)
    table = torch.tensor([5, 2, 7])
    cache.write(past, 32, table[:2])
    back = cache.past(model, 32, table[:2])
    for layer in range(shape.layers):
        assert torch.equal(back.layers[layer].keys, past.layers[layer].keys[:, :, :32])
        assert torch.equal(back.layers[layer].values, past.layers[layer].values[:, :, :32])
    # token t of the prefix lives in block table[t // 16] at row t % 16 (the engine layout)
    assert torch.equal(cache.layers[0][0, 2, 3], past.layers[0].keys[0, :, 19])


def test_layerwise_past_waits_for_a_layer_after_its_projections_and_before_its_reads() -> None:
    """Each layer's wait comes after that layer's q/k/v projections (where vLLM's attention
    waits for a layerwise load), layers in order; a load that writes a layer's blocks only
    in its wait still gives the logits of a forward over blocks written beforehand."""
    import torch

    bench = _load()
    shape = bench.SHAPES["toy"]  # type: ignore[attr-defined]
    model = bench.build_model(shape, torch.float32, torch.device("cpu"))  # type: ignore[attr-defined]
    cache = bench.PagedCache(shape, 8, torch.float32, torch.device("cpu"))  # type: ignore[attr-defined]
    ids = torch.randint(0, shape.vocab, (48,), generator=torch.Generator().manual_seed(2))
    table = torch.tensor([6, 1])
    with torch.no_grad():
        full = model(ids[:32].unsqueeze(0), use_cache=True)
    cache.write(full["cache"] if "cache" in full else full["past_key_values"], 32, table)
    written = [view[:, table].clone() for view in cache.layers]
    in_place = bench.layerwise_past(cache, model, 32, table, bench.IN_PLACE)  # type: ignore[attr-defined]
    expected = bench._last_logits(model, ids[32:], in_place)  # type: ignore[attr-defined]
    cache.fill(table, float("nan"))
    seen: list[str] = []

    class LateLoad:
        def wait_layer(self, layer: int) -> None:
            seen.append(f"wait {layer}")
            cache.layers[layer][:, table] = written[layer]

    hooks = [
        block.self_attn.v_proj.register_forward_hook(lambda *_, i=i: seen.append(f"v {i}"))
        for i, block in enumerate(model.model.layers)
    ]
    try:
        past = bench.layerwise_past(cache, model, 32, table, LateLoad())  # type: ignore[attr-defined]
        got = bench._last_logits(model, ids[32:], past)  # type: ignore[attr-defined]
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == [f"{what} {i}" for i in range(shape.layers) for what in ("v", "wait")]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("argv", [["--models", "nope"], ["--lengths", "100"], ["--repeat", "0"]])
def test_bad_arguments_are_usage_errors(argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", *argv],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2 and "--models from" in done.stderr


def test_kvflow_part_is_the_paired_difference_not_the_medians_difference() -> None:
    """((b) - (d)) / (c) divides the median of back-to-back (b) - (d) pairs by the copy:
    the medians of (b) and (d) alone drift apart with the suffix prefill's noise."""
    bench = _load()
    row = bench.Row(  # type: ignore[attr-defined]
        model="toy", prompt=512, prefix=256, suffix=256, prefix_gib=0.1, recompute_ms=40.0,
        kvflow_ms=30.0, copy_ms=2.0, suffix_ms=20.0, added_ms=3.0, retrieve_ms=1.0,
        retrieve_server_ms=0.5, landed_ms=2.5, logits_rel_err=0.0,
    )  # fmt: skip
    assert row.over_copy == 1.5
    assert row.ratio == 0.75
