"""The blend hit rate next to the prefix hit rate: in the engine's activity totals (what a
status carries), in `kvflow top`, in `kvflow report`'s summary and figure, and on the
Grafana dashboard, whose panel queries metrics the metrics subscriber exports.

Blend hit rate = tokens blend lookups found past their prefix / the blend lookups' prompt
tokens; the prefix hit rate stays tokens found from token 0 / tokens looked up (a blend
lookup's prefix lookup included). The events come from an engine on CPU
(tests/subscribers/blend_run.py): the system prompt is the prefix hit, documents B and
A (3 of the prompt's chunks) are found past it and copied."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from rich.console import Console

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.observe import plots
from kvflow.core.observe.report import summary
from kvflow.core.observe.snapshot import Rates, Snapshot
from kvflow.core.observe.top import render
from kvflow.core.observe.units import percent
from kvflow.subscribers import MetricsSubscriber, PrometheusEndpoint, make_meter_provider
from tests.observe.test_dashboard import METRIC, _dashboard, _panels
from tests.subscribers.blend_run import Blended, blend_once, refused_blend, stored_docs
from tests.support.engine import CHUNK, small_engine


def _engine() -> CacheEngine:
    """An engine with its own bus and pipeline, so its status carries activity totals."""
    return CacheEngine(
        ServerConfig(
            chunk_size=CHUNK, l1_size_gb=(1 << 20) / (1 << 30),
            observability=ObservabilityConfig(prometheus_port=0, logging_enabled=False),
        )
    )  # fmt: skip


def _snapshot(engine: CacheEngine) -> Snapshot:
    assert engine.bus.flush(5.0)
    return Snapshot.of(engine.status())


def _blended() -> tuple[Snapshot, Snapshot, Blended]:
    """Snapshots before and after a blend and a refused blend retrieve, and the blend."""
    engine = _engine()
    try:
        docs = stored_docs(engine)
        before = _snapshot(engine)
        run = blend_once(engine, docs)
        refused_blend(engine, run)
        after = _snapshot(engine)
    finally:
        engine.close()
    return before, after, run


def test_the_status_carries_blend_totals_beside_the_lookup_ones() -> None:
    before, after, run = _blended()
    assert before.totals["blend_lookup.requests"] == 0 and before.blend_hit_by_tier == {}
    asked = len(run.prompt)
    want = {
        "lookup.requests": 1, "lookup.requested_tokens": asked, "lookup.hit_tokens": CHUNK,
        "blend_lookup.requests": 1, "blend_lookup.errors": 0,
        "blend_lookup.requested_tokens": asked, "blend_lookup.hit_tokens": 3 * CHUNK,
        "blend_retrieve.requests": 2, "blend_retrieve.errors": 1,
        "blend_retrieve.tokens": 3 * CHUNK, "retrieve.requests": 0,
    }  # fmt: skip
    assert {k: after.totals[k] - before.totals[k] for k in want} == want
    assert after.blend_hit_by_tier == {"l1": 3 * CHUNK}
    assert after.hit_rate() == CHUNK / asked
    assert after.hit_rate("blend_lookup") == 3 * CHUNK / asked
    rates = Rates.between(before, after)
    assert rates.hit_rate == CHUNK / asked and rates.blend_hit_rate == 3 * CHUNK / asked


def _screen(snap: Snapshot, rates: Rates | None) -> str:
    console = Console(record=True, width=140)
    console.print(render(snap, rates))
    return console.export_text()


def _row(screen: str, label: str) -> list[str]:
    """The cells of the row whose first cell is `label`."""
    (line,) = [ln for ln in screen.splitlines() if ln.strip().startswith(label)]
    return line.strip()[len(label) :].split()


def test_top_shows_the_blend_hit_rate_next_to_the_prefix_one() -> None:
    before, after, run = _blended()
    asked = len(run.prompt)
    screen = _screen(before, None)
    assert _row(screen, "prefix, all tiers") == ["-", "-"]
    assert _row(screen, "blend, all tiers") == ["-", "-"]
    screen = _screen(after, Rates.between(before, after))
    prefix, blend = percent(CHUNK / asked), percent(3 * CHUNK / asked)
    assert _row(screen, "prefix, all tiers") == [prefix, prefix]
    assert _row(screen, "blend, all tiers") == [blend, blend]
    lines = screen.splitlines()
    at = next(i for i, ln in enumerate(lines) if "blend, all tiers" in ln)
    assert lines[at + 1].split() == ["l1", blend], "the blend hits by tier follow"
    assert "blend: hits past the prefix / blend-lookup tokens" in screen
    lookups, retrieves = _row(screen, "blend_lookup"), _row(screen, "blend_retrieve")
    assert float(lookups[0]) > 0 and lookups[1] == "0"  # req/s, errors/s
    assert float(retrieves[1]) > 0 and retrieves[-1] == "GB/s"
    assert "blend_lookup 0  blend_retrieve 0" in screen  # in flight


def test_report_gives_the_blend_hit_rate_next_to_the_prefix_one(tmp_path: Path) -> None:
    before, after, run = _blended()
    asked = len(run.prompt)
    text = summary([before, after])
    prefix = re.search(r"^- token hit rate \(prefix\) over the interval: \*\*(.+?)\*\* "
                       r"\((\d+) of (\d+) tokens\)", text, re.MULTILINE)  # fmt: skip
    blend = re.search(r"^- blend hit rate over the interval: \*\*(.+?)\*\* \((\d+) of (\d+) "
                      r"blend-lookup tokens", text, re.MULTILINE)  # fmt: skip
    assert prefix is not None and blend is not None, text
    assert prefix.groups() == (percent(CHUNK / asked), str(CHUNK), str(asked))
    assert blend.groups() == (percent(3 * CHUNK / asked), str(3 * CHUNK), str(asked))
    assert text.index("token hit rate (prefix)") < text.index("blend hit rate")
    assert f"  - l1 (since start): {percent(3 * CHUNK / asked)}" in text
    assert re.search(r"^\| blend_retrieve \| 2 \| 1 \| ", text, re.MULTILINE), text
    assert re.search(rf"^\| blend_lookup \| 1 \| 0 \| \S+ \| {asked} \|", text, re.MULTILINE)
    assert plots.timeline_figure([before, after], tmp_path / "t.png").stat().st_size > 10_000


def _prometheus_names() -> set[str]:
    """The series names a Prometheus scrape of a metrics subscriber shows after a blend."""
    endpoint = PrometheusEndpoint(port=0)  # never started: its registry renders the text
    provider = make_meter_provider([endpoint.reader])
    engine, _ = small_engine()
    engine.bus.register(MetricsSubscriber(provider))
    try:
        blend_once(engine, stored_docs(engine))
        assert engine.bus.flush(5.0)
        text = generate_latest(endpoint.registry).decode()
    finally:
        engine.close()
        provider.shutdown()
    return {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln[:1] != "#"}


def test_the_dashboard_shows_the_blend_hit_rate_next_to_the_prefix_one() -> None:
    """In the cache-effectiveness row, right under the prefix hit rate stat and as wide;
    its query divides the blend lookup counters the subscriber exports for MODEL."""
    dash = _dashboard()
    by_title: dict[str, Any] = {p["title"]: p for p in _panels(dash)}
    prefix, blend = by_title["Token hit rate"], by_title["Blend hit rate"]
    assert blend["type"] == prefix["type"] == "stat"
    assert blend["fieldConfig"]["defaults"]["unit"] == "percentunit"
    p, b = prefix["gridPos"], blend["gridPos"]
    assert (b["x"], b["w"], b["y"]) == (p["x"], p["w"], p["y"] + p["h"])
    rows = [q for q in dash["panels"] if q["type"] == "row"]
    row_y = next(r["gridPos"]["y"] for r in rows if "effectiveness" in r["title"])
    next_row = min(r["gridPos"]["y"] for r in rows if r["gridPos"]["y"] > row_y)
    assert row_y < b["y"] < b["y"] + b["h"] <= next_row
    (target,) = blend["targets"]
    names = METRIC.findall(target["expr"])
    assert names == [
        "kvflow_blend_lookup_hit_tokens_total", "kvflow_blend_lookup_requested_tokens_total"
    ]  # fmt: skip
    assert set(names) <= _prometheus_names()
    assert target["expr"].count('model_name=~"$model"') == 2  # filtered as the prefix one is
