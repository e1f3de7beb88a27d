"""`kvflow demo`: an in-process CacheEngine serving a synthetic engine's workload.

Runs multi-turn chats and document Q&A with shared prefixes through a synthetic
paged-KV engine (GPU when present, else CPU), prints one line per request while
the Prometheus endpoint is up, and ends with a summary of what moved and what the
event pipeline saw.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import socket
import sys
import time
import urllib.request
from collections import Counter, defaultdict

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.demo.sim import ModelShape, RequestOutcome, SimEngine
from kvflow.core.demo.tally import OpTally
from kvflow.core.demo.workload import WorkloadShape, make_workload
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.errors import KVFlowError
from kvflow.events import EventType
from kvflow.kernels import KVFormat, cuda_available

_DEFAULTS = ServerConfig()
_OBS = ObservabilityConfig()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvflow demo", description=__doc__.splitlines()[0])
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
    p.add_argument("--l1-size-gb", type=float, default=_DEFAULTS.l1_size_gb)
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
    return p


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
    return f"{n / 1e9:.3f} GB"


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
        ("in flight now", f"stores {int(m.get('kvflow_inflight_stores', 0))}, "
                          f"retrieves {int(m.get('kvflow_inflight_retrieves', 0))}"),
    ]  # fmt: skip


def _summary(
    args: argparse.Namespace,
    engine: CacheEngine,
    sim: SimEngine,
    tally: OpTally,
    outcomes: list[tuple[str, RequestOutcome]],
    wall_s: float,
    metrics: dict[str, float] | None,
) -> list[str]:
    """The final table's lines."""
    kinds = Counter(kind for kind, _ in outcomes)
    requested = sum(o.prompt_tokens for _, o in outcomes)
    hit = sum(o.lookup_hit_tokens for _, o in outcomes)
    local = sum(o.local_hit_tokens for _, o in outcomes)
    verified = sum(o.verified_blocks for _, o in outcomes)
    totals = tally.snapshot()
    st, rt = totals[EventType.STORE_START], totals[EventType.RETRIEVE_START]
    l1 = engine.l1_stats()
    stats = engine.bus.stats()
    s = sim.shape
    events = [f"{t.label} {n}" for t, n in sorted(stats.published.items())]
    rows: list[tuple[str, str]] = [
        ("engine", f"{args.format} on {sim.layout.device}, {s.num_layers} layers x "
                   f"{s.num_heads} heads x {s.head_size}, {str(s.dtype).removeprefix('torch.')}, "
                   f"{s.num_blocks} blocks of {s.block_size}, chunk {engine.chunk_size} tokens"),
        ("requests", f"{len(outcomes)} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})"
                     f" in {wall_s:.1f} s"),
        ("L1 lookup hit rate", f"{100 * hit / max(requested, 1):.1f} % "
                               f"({hit:,} of {requested:,} prompt tokens)"),
        ("engine-local hits", f"{local:,} tokens (skipped by retrieve)"),
        ("stored (to L1)", f"{st.ops} ops, {st.tokens:,} tokens, {_gb(st.bytes)}, "
                           f"{st.gb_per_s:.2f} GB/s, {st.failed} failed"),
        ("retrieved (from L1)", f"{rt.ops} ops, {rt.tokens:,} tokens, {_gb(rt.bytes)}, "
                                f"{rt.gb_per_s:.2f} GB/s, {rt.failed} failed"),
        ("verified", f"{verified:,} retrieved blocks bit-exact"),
        ("L1", f"{_gb(l1['usage_bytes'])} of {_gb(l1['capacity_bytes'])}, {l1['objects']} "
               f"objects, {l1['evicted_chunks']} evicted"),
        ("events", ", ".join(events[:6])),
        ("", ", ".join(events[6:])),
        ("event drops", f"{stats.total_dropped} (bus capacity {stats.capacity}); subscriber "
                        f"errors {sum(stats.subscriber_errors.values())}"),
    ]  # fmt: skip
    if metrics is not None:
        rows += _l0_rows(metrics)
    else:
        rows.append(("L0 lifecycle", "not shown: the Prometheus endpoint is off"))
    width = max(len(k) for k, _ in rows)
    return ["", "kvflow demo summary", *(f"  {k:<{width}}  {v}" for k, v in rows)]


def _progress(i: int, n: int, rid: str, o: RequestOutcome) -> str:
    return (
        f"[{i:>3}/{n}] {rid:<14} prompt {o.prompt_tokens:>5}  local {o.local_hit_tokens:>5}"
        f"  l1 hit {o.lookup_hit_tokens:>5}  retrieved {o.retrieved_tokens:>5}"
        f"  stored {o.stored_tokens:>5}"
    )


def main(command: str, argv: list[str]) -> int:
    """Entry point of `kvflow demo` (see `kvflow demo --help`)."""
    args = _parser().parse_args(argv)
    try:
        obs = ObservabilityConfig(
            prometheus_host=args.prometheus_host,
            prometheus_port=args.prometheus_port,
            l0_sample_rate=args.l0_sample_rate,
            log_level=args.log_level,
        )
        config = ServerConfig(
            chunk_size=args.chunk_size, l1_size_gb=args.l1_size_gb, observability=obs
        )
        workload = WorkloadShape(
            chats=args.chats, turns=args.turns, docs=args.docs, questions=args.questions
        )
    except ValueError as exc:
        print(f"kvflow demo: {exc}", file=sys.stderr)
        return 2
    if obs.prometheus_port and not _port_free(obs.prometheus_host, obs.prometheus_port):
        print(
            f"kvflow demo: --prometheus-port {obs.prometheus_port} on {obs.prometheus_host} is "
            "in use (another kvflow?); pass a free port, or 0 to run without the endpoint",
            file=sys.stderr,
        )
        return 2
    device = _device(args.device)
    requests = make_workload(workload, seed=args.seed)
    engine = CacheEngine(config)
    try:
        tally = OpTally()
        engine.bus.register(tally)
        try:
            sim = SimEngine(engine, kv_format=args.format, shape=ModelShape(), device=device)
        except KVFlowError as exc:
            print(f"kvflow demo: {exc}", file=sys.stderr)
            return 2
        if obs.prometheus_port:
            print(f"metrics: http://{obs.prometheus_host}:{obs.prometheus_port}/metrics")
        print(f"serving {len(requests)} requests ({args.format} KV cache on {device})")
        outcomes: list[tuple[str, RequestOutcome]] = []
        t0 = time.perf_counter()
        for i, req in enumerate(requests, 1):
            outcome = sim.serve(req)
            outcomes.append((req.kind, outcome))
            if not args.quiet:
                print(_progress(i, len(requests), req.request_id, outcome), flush=True)
        wall = time.perf_counter() - t0
        engine.bus.flush(5.0)
        metrics = scrape(obs.prometheus_host, obs.prometheus_port) if obs.prometheus_port else None
        sim.close()
        engine.bus.flush(5.0)
        for line in _summary(args, engine, sim, tally, outcomes, wall, metrics):
            print(line)
        if obs.prometheus_port and args.linger > 0:
            print(f"metrics stay up for {args.linger:g} s (Ctrl-C to stop)", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                time.sleep(args.linger)
    finally:
        clean = engine.close()
    if not clean:
        print("kvflow demo: the event pipeline did not shut down cleanly", file=sys.stderr)
    return 0
