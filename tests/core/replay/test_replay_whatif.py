"""Replay gives the live run's metric values; whatif's exact mode gives its L1 hit tokens.

A live run: the demo's synthetic engine serves the demo workload through an
in-process CacheEngine (CPU, no L2) whose bus feeds the server's subscribers (into
an in-memory MetricsCapture) and the event log. Then the log is replayed and
simulated, and the results compared exactly.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.demo.sim import ModelShape, SimEngine, kv_bytes_per_token
from kvflow.core.demo.workload import WorkloadShape, make_workload
from kvflow.core.engine.cache_engine import GIB, CacheEngine
from kvflow.core.replay import replay as replay_cli
from kvflow.core.replay import whatif as whatif_cli
from kvflow.core.replay.lru import simulate
from kvflow.core.replay.replay import replay
from kvflow.core.replay.trace import LOOKUP, TOUCH, Trace, read_trace
from kvflow.core.replay.whatif import curve
from kvflow.events import EventBus, Sampler
from kvflow.subscribers import build_subscribers
from kvflow.subscribers.eventlog_format import segment_name
from kvflow.subscribers.eventlog_read import LogReader
from kvflow.subscribers.testing import MetricsCapture
from tests.support.metric_points import metric_points

CHUNK = 256
FORMAT = "vllm_flash_attn"
#: read from the live process, not from events: absent from (or different in) a replay
NOT_FROM_EVENTS = ("kvflow.bus.",)


@dataclass
class LiveRun:
    log: Path
    capture: MetricsCapture
    l1_chunks: int
    lookup_hit_tokens: int


def live_run(log: Path, l1_chunks: int, *, l0_rate: float = 1.0) -> LiveRun:
    """Serve the demo workload with an L1 of `l1_chunks` chunks; log and capture it."""
    shape = ModelShape()
    chunk_nbytes = kv_bytes_per_token(FORMAT, shape) * CHUNK
    obs = ObservabilityConfig(prometheus_port=0, logging_enabled=False, l0_sample_rate=l0_rate,
                              event_log_dir=str(log))  # fmt: skip
    config = ServerConfig(chunk_size=CHUNK, l1_size_gb=l1_chunks * chunk_nbytes / GIB,
                          observability=obs)  # fmt: skip
    capture = MetricsCapture(kvflow_provider=True)
    bus = EventBus(capacity=1_000_000)
    pipeline = build_subscribers(obs, bus=bus, meter_provider=capture.provider)
    bus.start()
    engine = CacheEngine(config, bus=bus)
    sim = SimEngine(engine, kv_format=FORMAT, shape=shape, device="cpu")
    hits = 0
    for req in make_workload(WorkloadShape(chats=5, turns=3, docs=3, questions=4), seed=1):
        hits += sim.serve(req).lookup_hit_tokens
    sim.close()
    engine.close()
    assert pipeline.shutdown(10.0)
    assert bus.stats().total_dropped == 0
    return LiveRun(log, capture, l1_chunks, hits)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> LiveRun:
    return live_run(tmp_path_factory.mktemp("live") / "log", l1_chunks=20)


def _points(capture: MetricsCapture, *, skip_l0: bool = False) -> dict[tuple[Any, ...], Any]:
    """Every metric point that events make (without kvflow.l0.* when `skip_l0`)."""
    return metric_points(
        capture,
        lambda name: (
            not name.startswith(NOT_FROM_EVENTS) and not (skip_l0 and name.startswith("kvflow.l0"))
        ),
    )


def test_replay_gives_the_live_metric_values(run: LiveRun) -> None:
    replayed = MetricsCapture(kvflow_provider=True)
    result = replay(LogReader.open(run.log), replayed.provider)
    assert result.l0_sample_rate == 1.0, "defaults to the run's rate, from the log"
    live, again = _points(run.capture), _points(replayed)
    names = {k[0] for k in live}
    assert {"kvflow.store.tokens", "kvflow.lookup.hit_tokens", "kvflow.store.duration",
            "kvflow.l0.block_lifetime", "kvflow.l0.allocated_blocks"} <= names  # fmt: skip
    assert again == live
    replayed.shutdown()


def test_replay_at_another_l0_rate_changes_only_l0(run: LiveRun) -> None:
    replayed = MetricsCapture(kvflow_provider=True)
    replay(LogReader.open(run.log), replayed.provider, l0_sample_rate=0.25, sample_seed=7)
    assert _points(replayed, skip_l0=True) == _points(run.capture, skip_l0=True)
    l0 = {k: v for k, v in _points(replayed).items() if k[0] == "kvflow.l0.block_lifetime"}
    live_l0 = {k: v for k, v in _points(run.capture).items() if k[0] == "kvflow.l0.block_lifetime"}
    assert l0 and l0 != live_l0
    replayed.shutdown()


def test_whatif_exact_reproduces_the_live_l1_hit_tokens(run: LiveRun, tmp_path: Path) -> None:
    """At the size the run had, the simulation's L1 hit tokens are the lookups' own; at
    other sizes they equal live runs at those sizes."""
    trace = read_trace(LogReader.open(run.log))
    assert trace.live_l1_hit_tokens == run.lookup_hit_tokens > 0
    dist = simulate(trace)
    obj = trace.object_bytes()
    other = live_run(tmp_path / "log2", l1_chunks=45)
    sizes = [n * obj / GIB for n in (run.l1_chunks, other.l1_chunks)]
    rows = curve(trace, dist, sizes)
    assert [r.objects for r in rows] == [run.l1_chunks, other.l1_chunks]
    assert rows[0].hit_tokens == run.lookup_hit_tokens
    assert rows[1].hit_tokens == other.lookup_hit_tokens > run.lookup_hit_tokens
    assert rows[0].hit_rate == run.lookup_hit_tokens / trace.requested_tokens


def test_cli_prints_metrics_table_and_png(run: LiveRun, tmp_path: Path) -> None:
    out = io.StringIO()
    assert replay_cli.run([str(run.log), "--format", "json", "--from", "0"], out) == 0
    doc = json.loads(out.getvalue())
    assert doc["summary"][0].startswith("replayed ")
    assert any(p["name"] == "kvflow.store.requests" for p in doc["metrics"])
    out = io.StringIO()
    assert replay_cli.run([str(run.log), "--to", "0"], out) == 0  # an empty window
    assert "no events in the window" in out.getvalue()
    out = io.StringIO()
    args = [str(run.log), "--l1-size-gb", "0.01,0.02,1", "--out", str(tmp_path)]
    assert whatif_cli.run(args, out) == 0
    assert "hit rate" in out.getvalue() and (tmp_path / "whatif.png").stat().st_size > 1000
    assert len((tmp_path / "whatif.csv").read_text().splitlines()) == 4
    # a run without L2 (its log's header names no disk tier): --l2-size-gb 0 or absent,
    # the same L1-only output
    zero = io.StringIO()
    assert whatif_cli.run([*args, "--l2-size-gb", "0"], zero) == 0

    def table(text: str) -> list[str]:  # the timing words differ between runs
        return [line for line in text.splitlines() if "simulated" not in line]

    assert table(zero.getvalue()) == table(out.getvalue())


def test_cli_bad_input_is_one_clear_line(run: LiveRun, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert replay_cli.main("replay", [str(tmp_path)]) == 1
    assert "not an event log" in capsys.readouterr().err
    assert whatif_cli.main("whatif", [str(tmp_path / "nope"), "--l1-size-gb", "1"]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert whatif_cli.main("whatif", [str(run.log), "--l1-size-gb", "x"]) == 2
    assert "--l1-size-gb must be sizes in GiB" in capsys.readouterr().err
    assert whatif_cli.main("whatif", [str(run.log), "--l1-size-gb", "1", "--chunk-size", "16"]) == 2
    assert "differs from the log's 256" in capsys.readouterr().err
    assert replay_cli.main("replay", [str(run.log), "--from", "yesterday"]) == 2
    assert "--from must be seconds" in capsys.readouterr().err
    # a torn copy of the log: the readable part is replayed, the damage named
    torn = tmp_path / "torn"
    torn.mkdir()
    data = (run.log / segment_name(1)).read_bytes()
    (torn / segment_name(1)).write_bytes(data[: len(data) - 100])
    out = io.StringIO()
    assert replay_cli.run([str(torn)], out) == 0
    assert "torn last record" in capsys.readouterr().err
    assert "kvflow_store_requests" in out.getvalue()
    # an empty log (header only) is not an error for replay, and a clear one for whatif
    empty = tmp_path / "empty"
    from kvflow.subscribers.eventlog import EventLogSubscriber

    EventLogSubscriber(empty).shutdown()
    out = io.StringIO()
    assert replay_cli.run([str(empty)], out) == 0
    assert "the log holds no events" in out.getvalue()
    assert whatif_cli.main("whatif", [str(empty), "--l1-size-gb", "1"]) == 1
    assert "no lookups in the log" in capsys.readouterr().err


def test_sampled_mode_keeps_the_samplers_keys_and_is_deterministic(run: LiveRun) -> None:
    """Rate 1 is the exact simulation; a rate < 1 simulates the keys `Sampler` keeps
    (the L0 subscriber's hash), the same ones on every run for one seed."""
    trace = read_trace(LogReader.open(run.log))
    exact = simulate(trace)
    assert simulate(trace, rate=1.0).distances.tolist() == exact.distances.tolist()
    a, b = simulate(trace, rate=0.5, seed=3), simulate(trace, rate=0.5, seed=3)
    assert a.distances.tolist() == b.distances.tolist()
    kept = Sampler(0.5, 3).keep_mask(ids=trace.keys.view(np.int64))
    lookups = np.repeat(trace.kind == 0, np.diff(trace.start))
    assert len(a.distances) == int((kept & lookups).sum()) < len(exact.distances)
    rows = curve(trace, a, [1.0])
    assert 0.0 <= rows[0].hit_rate <= 1.0


def test_sampled_estimator_at_rate_one_is_the_exact_curve(run: LiveRun) -> None:
    """With every key sampled, each popularity stratum's miss ratio is its exact one, so
    the sampled estimator (strata, ratio estimates) gives the exact hit tokens."""
    trace = read_trace(LogReader.open(run.log))
    exact = simulate(trace)
    full = simulate(trace, rate=1.0, sampled=True)
    assert full.strata is not None and len(full.distances) == len(exact.distances)
    obj = trace.object_bytes()
    sizes = [n * obj / GIB for n in (5, 10, 20, 30, 45, 2000)]
    for a, b in zip(curve(trace, exact, sizes), curve(trace, full, sizes), strict=True):
        assert b.hit_tokens == pytest.approx(a.hit_tokens, abs=1e-6)


def synthetic_trace(requests: int, docs: int, seed: int = 0) -> Trace:
    """Requests that share document prefixes (Zipf 0.9 popularity) plus 1-3 chunks of
    their own, as the engine records them: lookup, retrieve of half the document, store
    of the whole chain (1 MiB objects, chunks of 16 tokens)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, docs + 1) ** 0.9
    doc = rng.choice(docs, size=requests, p=weights / weights.sum())
    doc_len = rng.integers(2, 16, size=docs)
    own = rng.integers(1, 4, size=requests)
    doc_keys = rng.integers(0, 2**63, size=(docs, 16), dtype=np.int64).tolist()
    own_keys = iter(rng.integers(0, 2**63, size=int(own.sum()), dtype=np.int64).tolist())
    kinds: list[int] = []
    lengths: list[int] = []
    keys: list[int] = []
    for d, o in zip(doc.tolist(), own.tolist(), strict=True):
        n = int(doc_len[d])
        chain = doc_keys[d][:n] + [next(own_keys) for _ in range(o)]
        for kind, part in ((LOOKUP, chain), (TOUCH, chain[: n // 2]), (TOUCH, chain)):
            kinds.append(kind)
            lengths.append(len(part))
            keys += part
    start = np.zeros(len(kinds) + 1, dtype=np.int64)
    np.cumsum(lengths, out=start[1:])
    kind_of = np.asarray(kinds, dtype=np.int8)
    lookup_chunks = int(np.diff(start)[kind_of == LOOKUP].sum())
    return Trace(
        kind=kind_of, space=np.zeros(len(kinds), np.int32), world=np.ones(len(kinds), np.int32),
        start=start, keys=np.asarray(keys, dtype=np.int64).view(np.uint64),
        requested_tokens=lookup_chunks * 16, chunk_size=16, lookups=requests,
        space_bytes={0: 1 << 20}, spaces={("m", 1, 0): 0},
    )  # fmt: skip


def test_sampled_at_one_percent_is_within_two_points_at_every_size() -> None:
    """1% of ~1M chunk references (40k requests over 20k documents), 2-128 GiB of L1
    (2k-128k objects): for each of five seeds, the sampled hit rate stays within 0.02
    of the exact one at every size (measured: 0.004-0.011)."""
    trace = synthetic_trace(40_000, 20_000)
    sizes = [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
    exact = curve(trace, simulate(trace), sizes)
    assert 0.15 < exact[0].hit_rate < exact[-1].hit_rate < 0.7
    for seed in range(5):
        sampled = curve(trace, simulate(trace, rate=0.01, seed=seed), sizes)
        worst = max(abs(a.hit_rate - b.hit_rate) for a, b in zip(exact, sampled, strict=True))
        assert worst <= 0.02, (seed, worst)
