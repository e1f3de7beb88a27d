"""`kvflow demo`: an in-process CacheEngine serving a synthetic engine's workload.

Runs multi-turn chats and document Q&A with shared prefixes through a synthetic
paged-KV engine (GPU when present, else CPU), with an L2 disk tier behind an L1
sized so that shared prefixes age out of L1 and come back from disk. Prints one
line per request while the Prometheus endpoint is up, and ends with a summary of
what moved, where hits came from, and what the event pipeline saw.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import os
import socket
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.demo.logfile import LogFile
from kvflow.core.demo.sim import ModelShape, RequestOutcome, SimEngine, kv_bytes_per_token
from kvflow.core.demo.tally import OpTally, OpTotals, RequestTiers, TierTrace, WriteBackTotals
from kvflow.core.demo.tiers import L1Sizing, TierRow, default_l1, tier_rows, tier_table
from kvflow.core.demo.workload import SimRequest, WorkloadShape, chunk_footprint, make_workload
from kvflow.core.engine.cache_engine import GIB, CacheEngine
from kvflow.core.errors import KVFlowError
from kvflow.events import EventType
from kvflow.events.stats import BusStats
from kvflow.kernels import KVFormat, cuda_available

_DEFAULTS = ServerConfig()
_OBS = ObservabilityConfig()
#: the in-flight gauges (kvflow_inflight_*) the summary reads back, L2 ones included
_INFLIGHT = ("stores", "retrieves", "l2_stores", "l2_loads", "prefetches")
#: the longest the demo waits for background L2 work before its summary
SETTLE_S = 10.0


class DemoError(Exception):
    """A setting or resource the demo cannot run with (exit status 2, one line)."""


def _parser() -> argparse.ArgumentParser:
    """`kvflow demo`'s command line, its options in three groups (not argparse groups:
    `--help` lists them as one)."""
    p = argparse.ArgumentParser(prog="kvflow demo", description=__doc__.splitlines()[0])
    _engine_args(p)
    _tier_args(p)
    _observability_args(p)
    return p


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The synthetic engine and its workload: format, device, chats and documents."""
    p.add_argument(
        "--format",
        default=KVFormat.VLLM_FLASH_ATTN.value,
        choices=[f.value for f in KVFormat],
        help="KV cache format of the engine",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the KV cache lives (auto: cuda when usable)",
    )
    p.add_argument("--chats", type=int, default=8, help="multi-turn conversations")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--docs", type=int, default=4, help="documents for Q&A")
    p.add_argument("--questions", type=int, default=5, help="questions per document")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=_DEFAULTS.chunk_size)


def _tier_args(p: argparse.ArgumentParser) -> None:
    """L1 and the L2 disk tier."""
    p.add_argument(
        "--l1-size-gb",
        type=float,
        default=None,
        help="L1 capacity in GiB (default: a third of the workload's distinct chunks, at "
        "least twice its largest request, so shared prefixes get evicted from L1)",
    )
    p.add_argument("--no-l2", action="store_true", help="run without the L2 disk tier")
    p.add_argument(
        "--l2-disk",
        metavar="PATH[,PATH]",
        default=None,
        help="L2 disk directories (default: a fresh temporary directory, removed at exit)",
    )
    p.add_argument(
        "--l2-disk-size-gb",
        type=float,
        default=_DEFAULTS.l2_disk_size_gb,
        help=f"L2 disk capacity in GiB (default {_DEFAULTS.l2_disk_size_gb:g})",
    )


def _observability_args(p: argparse.ArgumentParser) -> None:
    """Metrics endpoint, L0 sampling, logs, progress lines and the event log."""
    p.add_argument("--prometheus-host", default=_OBS.prometheus_host)
    p.add_argument(
        "--prometheus-port",
        type=int,
        default=_OBS.prometheus_port,
        help="metrics endpoint port (0 = off)",
    )
    p.add_argument(
        "--l0-sample-rate",
        type=float,
        default=1.0,
        help="share of KV blocks whose lifecycle is tracked (servers default to 0.01)",
    )
    p.add_argument(
        "--log-level",
        default="warning",
        help="level of the logging subscriber's per-event logs (stderr)",
    )
    p.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="keep the metrics endpoint up this many seconds after the summary",
    )
    p.add_argument("--quiet", action="store_true", help="no per-request progress lines")
    p.add_argument(
        "--event-log",
        metavar="DIR",
        default=None,
        help="keep the run's event log in DIR (default: a new temporary directory, kept and"
        " printed at the end, for kvflow replay and kvflow whatif)",
    )
    p.add_argument("--no-event-log", action="store_true", help="record no event log")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The demo's settings from its command line (see `kvflow demo --help`)."""
    return _parser().parse_args(argv)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and cuda_available()):
        if not cuda_available():
            raise SystemExit("kvflow demo: --device cuda needs a CUDA GPU and pycuda")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gb(n: float) -> str:
    """A size in GiB, the unit of --l1-size-gb (rates stay in GB/s: 1e9 bytes/s)."""
    return f"{n / (1 << 30):.3f} GiB"


def scrape(host: str, port: int) -> dict[str, float]:
    """The endpoint's samples summed over labels, by sample name (e.g. *_count, *_sum)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                totals[sample.name] += sample.value
    return totals


def _l0_rows(m: dict[str, float]) -> list[tuple[str, str]]:
    """L0 lifecycle and in-flight rows read back from the Prometheus endpoint."""

    def hist(name: str) -> str:
        n, total = m.get(f"{name}_seconds_count", 0.0), m.get(f"{name}_seconds_sum", 0.0)
        return f"{int(n)} x, mean {1e3 * total / n:.1f} ms" if n else "none yet"

    return [
        ("L0 allocations", f"{int(m.get('kvflow_l0_allocation_records_total', 0)):,} records, "
                           f"{int(m.get('kvflow_l0_allocated_blocks_total', 0)):,} blocks, "
                           f"{int(m.get('kvflow_l0_tracked_blocks', 0)):,} tracked now"),
        ("L0 block lifetime", hist("kvflow_l0_block_lifetime")),
        ("L0 idle to evict", hist("kvflow_l0_block_idle_before_evict")),
        ("L0 reuse gap", hist("kvflow_l0_block_reuse_gap")),
        ("in flight now", ", ".join(f"{op.replace('_', ' ')} "
                                    f"{int(m.get(f'kvflow_inflight_{op}', 0))}"
                                    for op in _INFLIGHT)),
    ]  # fmt: skip


@dataclass
class DemoReport:
    """What one demo run saw: per request its outcome and tier record, per tier its
    totals, the prefetch and write-back totals, the ops and events the bus carried."""

    config: ServerConfig
    outcomes: list[tuple[str, RequestOutcome]]
    requests: dict[str, RequestTiers]  # by request id, in serving order
    tiers: list[TierRow]
    prefetch: dict[str, int] | None  # status()["l2"]["prefetch"]; None without L2
    write_back: WriteBackTotals
    ops: dict[EventType, OpTotals]
    bus: BusStats
    wall_s: float
    clean: bool = True

    @property
    def events(self) -> dict[str, int]:
        """Events published, by type label."""
        return {t.label: n for t, n in sorted(self.bus.published.items())}

    @property
    def verified_blocks(self) -> int:
        return sum(o.verified_blocks for _, o in self.outcomes)

    @property
    def retrieves_after_write_back(self) -> int:
        """Retrieves of requests whose lookup hit L2 that read every chunk from L1: the
        lookup's prefetch had written the L2 part back before the retrieve came."""
        return sum(
            1 for r in self.requests.values()
            if r.retrieved and r.l2_hit_tokens and not r.retrieved_l2_chunks
        )  # fmt: skip

    @property
    def retrieves_from_l2(self) -> int:
        """Retrieves that got some chunks from an L2 load still running (or their own)."""
        return sum(1 for r in self.requests.values() if r.retrieved_l2_chunks)


@dataclass(frozen=True)
class Setup:
    """How the demo was configured, for its header lines."""

    args: argparse.Namespace
    config: ServerConfig
    sizing: L1Sizing | None  # None when --l1-size-gb was given
    l2_temporary: bool


def _ops_row(t: OpTotals, what: str) -> str:
    return (
        f"{t.ops} ops, {t.tokens:,} tokens, {_gb(t.bytes)}, {t.gb_per_s:.2f} GB/s, "
        f"{t.failed} failed"
        if what == "tokens"
        else f"{t.ops} ops, {_gb(t.bytes)}, {t.gb_per_s:.2f} GB/s, {t.failed} failed"
    )


def _setup_rows(setup: Setup, sim: SimEngine, report: DemoReport) -> list[tuple[str, str]]:
    """Engine, requests, and the L1/L2 configuration."""
    s, cfg = sim.shape, setup.config
    kinds = Counter(kind for kind, _ in report.outcomes)
    l1 = (setup.sizing.describe() if setup.sizing is not None
          else f"{_gb(cfg.l1_size_gb * GIB)} (--l1-size-gb)")  # fmt: skip
    if cfg.l2_disk_paths:
        where = ", ".join(cfg.l2_disk_paths)
        kept = " (temporary, removed at exit)" if setup.l2_temporary else ""
        l2 = f"disk, {_gb(cfg.l2_disk_size_gb * GIB)} in {where}{kept}"
    else:
        l2 = "none (--no-l2)"
    return [
        ("engine", f"{setup.args.format} on {sim.layout.device}, {s.num_layers} layers x "
                   f"{s.num_heads} heads x {s.head_size}, {str(s.dtype).removeprefix('torch.')}, "
                   f"{s.num_blocks} blocks of {s.block_size}, chunk {cfg.chunk_size} tokens"),
        ("requests", f"{len(report.outcomes)} ("
                     f"{', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}) "
                     f"in {report.wall_s:.1f} s"),
        ("L1", l1),
        ("L2", l2),
    ]  # fmt: skip


def _traffic_rows(report: DemoReport) -> list[tuple[str, str]]:
    """Hit rate by tier, local hits, what moved between engine, L1 and L2."""
    requested = sum(o.prompt_tokens for _, o in report.outcomes)
    hit = sum(o.lookup_hit_tokens for _, o in report.outcomes)
    by_tier = ", ".join(f"{t.name} {t.hit_tokens:,}" for t in report.tiers)
    ops = report.ops
    rows = [
        ("lookup hit rate", f"{100 * hit / max(requested, 1):.1f} % ({hit:,} of "
                            f"{requested:,} prompt tokens; by tier: {by_tier})"),
        ("engine-local hits", f"{sum(o.local_hit_tokens for _, o in report.outcomes):,} "
                              "tokens (skipped by retrieve)"),
        ("stored (new to L1)", _ops_row(ops[EventType.STORE_START], "tokens")),
        ("retrieved (from L1)", _ops_row(ops[EventType.RETRIEVE_START], "tokens")),
    ]  # fmt: skip
    if report.prefetch is not None:
        rows += [
            ("L2 writes", _ops_row(ops[EventType.L2_STORE_START], "bytes")),
            ("L2 loads", _ops_row(ops[EventType.L2_LOAD_START], "bytes")),
        ]
    rows.append(("verified", f"{report.verified_blocks:,} retrieved blocks bit-exact"))
    rows += [
        ("about GB/s", "bytes per second of op time, on this CPU in one process with the"
                       " simulated engine and its checks;"),
        ("", "stores also hash chunks and place L1 objects, so they run slower than"
             " retrieves. GPU figures: docs/PERFORMANCE.md"),
    ]  # fmt: skip
    return rows


def _l2_rows(report: DemoReport) -> list[tuple[str, str]]:
    """Prefetch, write-back and how the retrieves of L2 hits were served."""
    pf, wb = report.prefetch, report.write_back
    if pf is None:
        return []
    reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(wb.kept_by_reason.items()))
    return [
        ("prefetch", f"{pf['requests']} requests, {pf['loaded']:,} chunks loaded, "
                     f"{pf['written_back']:,} written back, {pf['discarded']:,} discarded"),
        ("write-back", f"{wb.events} events, {wb.kept:,} chunks kept in L1 ({reasons or 'none'})"
                       f", {wb.discarded:,} discarded, {_gb(wb.bytes)}"),
        ("retrieves of L2 hits", f"{report.retrieves_after_write_back} served from L1 after "
                                 f"write-back, {report.retrieves_from_l2} waited on L2 loads"),
    ]  # fmt: skip


def _event_rows(report: DemoReport) -> list[tuple[str, str]]:
    """Events per type (five a line) and the bus's drops."""
    events = [f"{label} {n}" for label, n in report.events.items()]
    lines = [", ".join(events[i : i + 5]) for i in range(0, len(events), 5)] or ["none"]
    stats = report.bus
    return [
        *((("events" if i == 0 else ""), line) for i, line in enumerate(lines)),
        ("event drops", f"{stats.total_dropped} (bus capacity {stats.capacity}); subscriber "
                        f"errors {sum(stats.subscriber_errors.values())}"),
    ]  # fmt: skip


def _summary(
    setup: Setup, sim: SimEngine, report: DemoReport, metrics: dict[str, float] | None
) -> list[str]:
    """The final summary's lines: settings and traffic rows, the tier table, L2 and events."""
    rows = _setup_rows(setup, sim, report) + _traffic_rows(report)
    tail = _l2_rows(report) + _event_rows(report)
    if metrics is not None:
        tail += _l0_rows(metrics)
    else:
        tail.append(("L0 lifecycle", "not shown: the Prometheus endpoint is off"))
    width = max(len(k) for k, _ in rows + tail)
    return [
        "",
        "kvflow demo summary",
        *(f"  {k:<{width}}  {v}" for k, v in rows),
        "  tiers",
        *(f"    {line}" for line in tier_table(report.tiers)),
        *(f"  {k:<{width}}  {v}" for k, v in tail),
    ]


def _progress(i: int, n: int, rid: str, o: RequestOutcome, tiers: RequestTiers | None) -> str:
    """One request's line; with L2, its hit tokens per tier, whether its lookup started a
    prefetch, and the chunks its retrieve still took from L2."""
    head = f"[{i:>3}/{n}] {rid:<14} prompt {o.prompt_tokens:>5}  local {o.local_hit_tokens:>5}"
    tail = f"  stored {o.stored_tokens:>5}"
    if tiers is None:
        return (f"{head}  l1 hit {o.lookup_hit_tokens:>5}  retrieved {o.retrieved_tokens:>5}"
                f"{tail}")  # fmt: skip
    by_tier = tiers.hit_tokens_by_tier
    hits = "  ".join(f"{name} {n:>5}" for name, n in sorted(by_tier.items(), key=_l1_first))
    pf = "prefetch" if tiers.prefetches else " " * 8
    n_l2 = tiers.retrieved_l2_chunks
    via = f" ({n_l2} chunk{'s' * (n_l2 != 1)} via L2)" if n_l2 else ""
    return f"{head}  hit {hits:<18} {pf}  retrieved {o.retrieved_tokens:>5}{via}{tail}"


def _l1_first(item: tuple[str, int]) -> tuple[bool, str]:
    return (item[0] != "l1", item[0])


def _configs(args: argparse.Namespace) -> tuple[ServerConfig, WorkloadShape]:
    """The engine's and the workload's settings, L1 still at --l1-size-gb or the default."""
    try:
        obs = ObservabilityConfig(
            prometheus_host=args.prometheus_host,
            prometheus_port=args.prometheus_port,
            l0_sample_rate=args.l0_sample_rate,
            log_level=args.log_level,
            event_log_dir=_event_log_dir(args),
        )
        config = ServerConfig(
            chunk_size=args.chunk_size,
            l1_size_gb=_DEFAULTS.l1_size_gb if args.l1_size_gb is None else args.l1_size_gb,
            l2_disk_size_gb=args.l2_disk_size_gb,
            observability=obs,
        )
        workload = WorkloadShape(
            chats=args.chats, turns=args.turns, docs=args.docs, questions=args.questions
        )
    except ValueError as exc:
        raise DemoError(str(exc)) from None
    if obs.prometheus_port and not _port_free(obs.prometheus_host, obs.prometheus_port):
        raise DemoError(
            f"--prometheus-port {obs.prometheus_port} on {obs.prometheus_host} is in use "
            "(another kvflow?); pass a free port, or 0 to run without the endpoint"
        )
    return config, workload


def _event_log_dir(args: argparse.Namespace) -> str | None:
    """--event-log, or a fresh temporary directory (kept: the summary names it), or None
    with --no-event-log."""
    if args.no_event_log:
        return None
    if args.event_log is not None:
        return str(args.event_log)
    return tempfile.mkdtemp(prefix="kvflow-demo-events-")


def _sized(
    args: argparse.Namespace, config: ServerConfig, requests: list[SimRequest], shape: ModelShape
) -> tuple[ServerConfig, L1Sizing | None]:
    """The config with the default L1 (sized against the workload) unless one was given."""
    if args.l1_size_gb is not None:
        return config, None
    chunk_nbytes = kv_bytes_per_token(args.format, shape) * config.chunk_size
    sizing = default_l1(chunk_footprint(requests, config.chunk_size), chunk_nbytes)
    return dataclasses.replace(config, l1_size_gb=sizing.nbytes / GIB), sizing


def _with_l2(
    args: argparse.Namespace, config: ServerConfig, stack: contextlib.ExitStack
) -> ServerConfig:
    """The config with the L2 disk paths: --l2-disk, or a temporary directory the stack
    removes; unchanged with --no-l2."""
    if args.no_l2:
        return config
    if args.l2_disk is None:
        paths: tuple[str, ...] = (stack.enter_context(tempfile.TemporaryDirectory(
            prefix="kvflow-demo-l2-")),)  # fmt: skip
    else:
        paths = tuple(args.l2_disk.split(","))
    try:
        return dataclasses.replace(config, l2_disk_paths=paths)
    except ValueError as exc:
        raise DemoError(str(exc)) from None


def _l2_idle(engine: CacheEngine) -> bool:
    """No L2 load, prefetch or write-through is in flight (always true without L2)."""
    l2 = engine.status()["l2"]
    if l2 is None:
        return True
    in_flight = l2["in_flight"]
    return not in_flight["loading"] and not in_flight["write_through"]["calls"]


def _settle(engine: CacheEngine, tally: OpTally, timeout: float = SETTLE_S) -> bool:
    """Wait until the background L2 work the requests started has finished and its
    events are delivered (every START has its END), so the summary counts all of it."""
    deadline = time.monotonic() + timeout
    while True:
        engine.bus.flush(max(deadline - time.monotonic(), 0.0))
        if _l2_idle(engine) and tally.open_ops() == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _serve(
    args: argparse.Namespace,
    engine: CacheEngine,
    sim: SimEngine,
    trace: TierTrace,
    requests: list[SimRequest],
) -> list[tuple[str, RequestOutcome]]:
    """Serve every request in order, printing a line per request unless --quiet."""
    outcomes: list[tuple[str, RequestOutcome]] = []
    for i, req in enumerate(requests, 1):
        outcome = sim.serve(req)
        outcomes.append((req.kind, outcome))
        if not args.quiet:
            engine.bus.flush(5.0)  # the request's lookup and retrieve events, for its line
            tiers = None if args.no_l2 else trace.request(req.request_id)
            print(_progress(i, len(requests), req.request_id, outcome, tiers), flush=True)
    return outcomes


def _report(
    config: ServerConfig,
    engine: CacheEngine,
    tally: OpTally,
    trace: TierTrace,
    requests: list[SimRequest],
    outcomes: list[tuple[str, RequestOutcome]],
    wall_s: float,
) -> DemoReport:
    """Gather the run's totals once the events are in."""
    status = engine.status()
    ops = tally.snapshot()
    return DemoReport(
        config=config,
        outcomes=outcomes,
        requests={r.request_id: trace.request(r.request_id) for r in requests},
        tiers=tier_rows(status, trace, ops, engine.chunk_size),
        prefetch=None if status["l2"] is None else dict(status["l2"]["prefetch"]),
        write_back=trace.write_back,
        ops=ops,
        bus=engine.bus.stats(),
        wall_s=wall_s,
    )


def _engine(config: ServerConfig) -> CacheEngine:
    try:
        return CacheEngine(config)
    except (ValueError, KVFlowError) as exc:  # e.g. an --l2-disk path that cannot be used
        raise DemoError(str(exc)) from None


def run(args: argparse.Namespace) -> DemoReport:
    """Serve the workload through an in-process engine; prints progress and the summary.

    Raises DemoError for settings or resources it cannot run with.
    """
    config, workload = _configs(args)
    shape = ModelShape()
    device = _device(args.device)
    requests = make_workload(workload, seed=args.seed)
    config, sizing = _sized(args, config, requests, shape)
    with contextlib.ExitStack() as stack:
        config = _with_l2(args, config, stack)
        setup = Setup(args, config, sizing, l2_temporary=args.l2_disk is None)
        log = LogFile(_log_path(config))
        stack.callback(log.release)
        with log.building():
            engine = _engine(config)
        log.capture()  # warnings go to the file, not between the progress lines
        try:
            report = _run_engine(setup, engine, requests, shape, device)
        finally:
            clean = engine.close()
        report.clean = clean
    log_dir = config.observability.event_log_dir
    if log_dir is not None:  # after close: every event is in the log
        print(f"  event log: {log_dir} (kvflow replay {log_dir}; kvflow whatif {log_dir}"
              f" --l1-size-gb {config.l1_size_gb:.4g},{2 * config.l1_size_gb:.4g})")  # fmt: skip
    print(f"  log: {log.summary()}")
    return report


def _log_path(config: ServerConfig) -> Path:
    """The run's log file: in the event log's directory, else a new temporary file."""
    log_dir = config.observability.event_log_dir
    if log_dir is not None:
        return Path(log_dir) / "demo.log"
    fd, name = tempfile.mkstemp(prefix="kvflow-demo-", suffix=".log")
    os.close(fd)
    return Path(name)


def _run_engine(
    setup: Setup,
    engine: CacheEngine,
    requests: list[SimRequest],
    shape: ModelShape,
    device: torch.device,
) -> DemoReport:
    """The run proper, on a built engine: serve, settle, report, print the summary."""
    args, obs = setup.args, setup.config.observability
    tally, trace = OpTally(), TierTrace()
    engine.bus.register(tally)
    engine.bus.register(trace)
    try:
        sim = SimEngine(engine, kv_format=args.format, shape=shape, device=device)
    except KVFlowError as exc:
        raise DemoError(str(exc)) from None
    if obs.prometheus_port:
        print(f"metrics: http://{obs.prometheus_host}:{obs.prometheus_port}/metrics")
    print(f"serving {len(requests)} requests ({args.format} KV cache on {device})")
    print(
        "  per request, in tokens: prompt; local = already in the engine's blocks; hit = the"
        " lookup's hits by tier;\n  retrieved = copied back into the engine; stored = the"
        " prompt's full chunks kvflow holds after its store, in L1 or L2\n  (already-cached"
        " chunks included: the summary's 'stored (new to L1)' counts only newly written tokens)"
    )
    t0 = time.perf_counter()
    outcomes = _serve(args, engine, sim, trace, requests)
    wall = time.perf_counter() - t0
    _settle(engine, tally)
    metrics = scrape(obs.prometheus_host, obs.prometheus_port) if obs.prometheus_port else None
    sim.close()
    engine.bus.flush(5.0)
    report = _report(setup.config, engine, tally, trace, requests, outcomes, wall)
    for line in _summary(setup, sim, report, metrics):
        print(line)
    if obs.prometheus_port and args.linger > 0:
        print(f"metrics stay up for {args.linger:g} s (Ctrl-C to stop)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.linger)
    return report


def main(command: str, argv: list[str]) -> int:
    """Entry point of `kvflow demo` (see `kvflow demo --help`)."""
    try:
        report = run(parse_args(argv))
    except DemoError as exc:
        print(f"kvflow demo: {exc}", file=sys.stderr)
        return 2
    if not report.clean:
        print("kvflow demo: the event pipeline did not shut down cleanly", file=sys.stderr)
    return 0
