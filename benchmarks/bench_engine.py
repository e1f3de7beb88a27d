"""CacheEngine store/retrieve throughput vs a pinned memcpy of the same bytes, obs on vs off.

Per case (format, realistic model shape, page size) it checks a round trip bit for
bit, then times, interleaved, the engines' order alternating per repetition: a
contiguous pinned D2H and H2D copy of one op's bytes (the ceiling), and `store` (fresh
tokens every time, so every chunk is written and L1 evicts) and `retrieve` (the same
hit prefix every time) on two engines sharing the cache: observability off, and on
(metrics with a Prometheus endpoint, L0 sampling 1%, logging, GPU-stamped END events).
Wall-clock per call: GB/s from the median time, ratios as the median of per-repetition
ratios (each op against the copy timed in its repetition); each engine's subscribers
drain between samples (untimed), so one engine's deferred event work is not charged to
the other. A
block of back-to-back ops per engine then measures the sustained on/off ratio with all
of that work inside it.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.demo.tally import OpTally
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.events import EventType
from kvflow.kernels import KVFormat, KVLayout, cuda_available
from kvflow.kernels.synthetic import block_bytes, make_kv_caches
from kvflow.subscribers.kv_events import KVEventLog

BF16 = torch.bfloat16


#: rounds of one block of store+retrieve pairs per engine for the sustained ratio (its
#: median over the rounds): 5 rounds let identical engines (--control) differ by 3-11%
SUSTAINED_ROUNDS = 15


@dataclass(frozen=True)
class Case:
    """One engine configuration: cache format and shape, chunk size, chunks per op."""

    name: str
    fmt: KVFormat
    layers: int
    heads: int
    head_size: int
    block: int
    chunk: int
    chunks: int
    noncontiguous: bool = False


CASES = [
    Case("fa-bf16-bs16", KVFormat.VLLM_FLASH_ATTN, 32, 8, 128, 16, 256, 16),
    Case("fi-bf16-HND-bs16", KVFormat.VLLM_FLASHINFER, 32, 8, 128, 16, 256, 16, True),
    Case("cross-bf16-bs16", KVFormat.VLLM_CROSS_LAYER, 32, 8, 128, 16, 256, 16),
    Case("sgl-mha-bf16-bs1", KVFormat.SGLANG_MHA, 32, 8, 128, 1, 256, 16),
    Case("mla-bf16-576-bs64", KVFormat.VLLM_MLA, 61, 1, 576, 64, 256, 32),
    Case("sgl-mla-bf16-576-bs1", KVFormat.SGLANG_MLA, 61, 1, 576, 1, 256, 32),
    Case("fa-bf16-bs1024", KVFormat.VLLM_FLASH_ATTN, 32, 8, 128, 1024, 1024, 4),
    Case("mla-bf16-576-bs1024", KVFormat.VLLM_MLA, 61, 1, 576, 1024, 1024, 8),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: with --event-log, the observed engine also records its events here (a temporary directory)
EVENT_LOG_DIR: str | None = None
#: with --kv-events, the observed engine's bus also feeds a KV-event log, as a server's does
KV_EVENTS = False
#: --control: the "on" engine is built with observability off too (an A/A run: its on/off
#: columns show the spread of two identical engines)
CONTROL = False


def _engine(case: Case, l1_bytes: int, observe: bool) -> CacheEngine:
    obs = (
        ObservabilityConfig(
            prometheus_port=_free_port(), l0_sample_rate=0.01, event_log_dir=EVENT_LOG_DIR
        )
        if observe
        else ObservabilityConfig(enabled=False)
    )
    engine = CacheEngine(
        ServerConfig(chunk_size=case.chunk, l1_size_gb=l1_bytes / 2**30, observability=obs)
    )
    if observe and KV_EVENTS:
        engine.bus.register(KVEventLog())
    return engine


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of `fn` from an idle device until the caller's stream has finished it.

    The engine returns once its own streams are done; only the caller's stream is
    synchronised after it (a device-wide sync would also wait for unrelated work,
    e.g. the event stamper's side streams).
    """
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.current_stream(device).synchronize()
    return time.perf_counter() - t0


def _check_round_trip(
    engine: CacheEngine, kv: Any, kw: dict[str, Any], src: list[int], dst: list[int], case: Case
) -> None:
    """Store from `src` blocks, retrieve into `dst` blocks; the bytes must match exactly."""
    tokens = np.arange(2 * case.chunk, dtype=np.int32) + 2_000_000_000
    engine.store("bench", tokens, src, request_id="check")
    assert engine.retrieve("bench", tokens, dst, request_id="check") == 2 * case.chunk
    n = len(tokens) // case.block
    if not torch.equal(block_bytes(kv, kw, src[:n]), block_bytes(kv, kw, dst[:n])):
        raise AssertionError(f"{case.name}: retrieved blocks differ from the stored ones")


def run_case(
    case: Case, device: torch.device, reps: int, rounds: int = SUSTAINED_ROUNDS
) -> dict[str, Any]:
    """Check and time one case; returns its row of figures."""
    per_chunk = case.chunk // case.block
    blocks = case.chunks * per_chunk
    kv, kw = make_kv_caches(
        case.fmt, num_layers=case.layers, num_blocks=2 * blocks, block_size=case.block,
        num_heads=case.heads, head_size=case.head_size, dtype=BF16,
        noncontiguous=case.noncontiguous, device=device,
    )  # fmt: skip
    layout = KVLayout.from_kv_caches(kv, **kw)
    op_bytes = case.chunks * layout.chunk_nbytes(case.chunk)
    perm = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(0)).tolist()
    src, dst = perm[:blocks], perm[blocks:]
    engines = {
        "off": _engine(case, 3 * op_bytes, observe=False),
        "on": _engine(case, 3 * op_bytes, observe=not CONTROL),
    }
    tally = OpTally()
    engines["on"].bus.register(tally)
    for engine in engines.values():
        engine.register_kv_caches("bench", kv, model_name=case.name, **kw)
    _check_round_trip(engines["off"], kv, kw, src, dst, case)

    pinned = device.type == "cuda"
    host = torch.empty(op_bytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(op_bytes, dtype=torch.uint8, device=device)
    fixed = np.arange(case.chunks * case.chunk, dtype=np.int32)
    times: dict[str, list[float]] = {k: [] for k in (
        "d2h", "h2d", "store_off", "store_on", "retrieve_off", "retrieve_on")}  # fmt: skip
    for engine in engines.values():
        engine.store("bench", fixed, src, request_id="fixed")
    warmup = 3
    for rep in range(warmup + reps):
        fresh = fixed + (rep + 1) * 1_000_000
        sample = {
            "d2h": _timed(lambda: host.copy_(dev, non_blocking=True), device),
            "h2d": _timed(lambda: dev.copy_(host, non_blocking=True), device),
        }
        # engines alternate which goes first, so neither always follows the ceiling copies
        for mode, engine in list(engines.items())[:: 1 if rep % 2 == 0 else -1]:
            rid = f"{mode}{rep}"
            sample[f"store_{mode}"] = _timed(
                lambda e=engine, t=fresh, r=rid: e.store("bench", t, src, request_id=r), device
            )
            sample[f"retrieve_{mode}"] = _timed(
                lambda e=engine, r=rid: e.retrieve("bench", fixed, dst, request_id=r), device
            )
            # untimed: let subscribers finish this engine's events, so its deferred work
            # (GIL-holding Python) does not land in the next engine's or copy's timing
            engine.bus.flush(10.0)
        if rep >= warmup:
            for k, v in sample.items():
                times[k].append(v)
    # Sustained: blocks of consecutive store+retrieve pairs per engine, so the subscriber
    # work each op causes lands inside the block that caused it (per-op timings let one
    # op's event processing spill into the next op, whichever engine that is). Several
    # rounds, the engines' order alternating, each round's off/on ratio from blocks timed
    # side by side: one block each swung the ratio by +-30% with the machine's drift.
    block_ratios: list[float] = []
    for rnd in range(rounds):
        block: dict[str, float] = {}
        for mode, engine in list(engines.items())[:: 1 if rnd % 2 == 0 else -1]:

            def pairs(e: CacheEngine = engine, m: str = mode, r: int = rnd) -> None:
                for i in range(reps):
                    fresh = fixed + (100 + r * reps + i) * 1_000_000
                    e.store("bench", fresh, src, request_id=f"{m}-s{r}-{i}")
                    e.retrieve("bench", fixed, dst, request_id=f"{m}-r{r}-{i}")

            block[mode] = _timed(pairs, device)
            engine.bus.flush(10.0)  # untimed, as above: a block's leftover work stays its own
        block_ratios.append(block["off"] / block["on"])
    on = engines["on"]
    on.bus.flush(10.0)
    stats = on.bus.stats()
    evicted = on.l1_stats()["evicted_chunks"]
    for engine in engines.values():
        engine.close()
    gbps = {k: op_bytes / statistics.median(v) / 1e9 for k, v in times.items()}

    def paired(slow: str, fast: str) -> float:
        """Median over repetitions of time[fast] / time[slow], both timed in that
        repetition, so a drift of the machine's speed between repetitions cancels."""
        return statistics.median(f / s for f, s in zip(times[fast], times[slow], strict=True))

    return {
        "case": case.name,
        "format": case.fmt.value,
        "chunk_mib": layout.chunk_nbytes(case.chunk) / 2**20,
        "op_mib": op_bytes / 2**20,
        "gbps": gbps,
        "store_vs_copy": paired("store_off", "d2h"),
        "retrieve_vs_copy": paired("retrieve_off", "h2d"),
        "store_on_off": paired("store_on", "store_off"),
        "retrieve_on_off": paired("retrieve_on", "retrieve_off"),
        "sustained_on_off": statistics.median(block_ratios),
        "sustained_rounds": block_ratios,
        "open_ops": tally.open_ops(),
        "ops_seen": sum(t.ops for t in tally.snapshot().values()),
        "dropped": stats.total_dropped,
        "evicted_chunks": evicted,
        "stream_stamped": on.bus.stamper is not None,
        "ends": stats.published.get(EventType.STORE_END, 0),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per case: ceiling, engine off/on GB/s, the target ratios, sustained on/off."""
    head = (
        f"{'case':<22}{'op MiB':>7}{'d2h':>6}{'st off':>7}{'st on':>6}{'st/cp':>6}{'on/off':>7}"
        f"{'h2d':>6}{'rt off':>7}{'rt on':>6}{'rt/cp':>6}{'on/off':>7}{'pairs':>7}{'drop':>5}{'open':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        g = r["gbps"]
        print(
            f"{r['case']:<22}{r['op_mib']:>7.0f}{g['d2h']:>6.1f}{g['store_off']:>7.1f}"
            f"{g['store_on']:>6.1f}{r['store_vs_copy']:>6.2f}{r['store_on_off']:>7.3f}"
            f"{g['h2d']:>6.1f}{g['retrieve_off']:>7.1f}{g['retrieve_on']:>6.1f}"
            f"{r['retrieve_vs_copy']:>6.2f}{r['retrieve_on_off']:>7.3f}{r['sustained_on_off']:>7.3f}"
            f"{r['dropped']:>5}{r['open_ops']:>5}"
        )


def _round_spread(rows: list[dict[str, Any]]) -> str:
    """The sustained rounds' interquartile range over all cases: how steady the machine
    was during the run (identical engines on a quiet H100 VM: about 0.99-1.01)."""
    ratios = sorted(x for r in rows for x in r["sustained_rounds"])
    if len(ratios) < 2:
        return f"sustained rounds: {len(ratios)} (too few for a spread)"
    low, _, high = statistics.quantiles(ratios, n=4)
    return (
        f"sustained rounds: {len(ratios)}, on/off interquartile range {low:.3f}-{high:.3f}"
        " (the machine's steadiness: a wide range makes single cells unreliable)"
    )


def main() -> None:
    """Run every case (or those named) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per case")
    parser.add_argument("--rounds", type=int, default=SUSTAINED_ROUNDS,
                        help="rounds of the sustained on/off blocks (median over rounds)")  # fmt: skip
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--small", action="store_true",
                        help="4 layers and 2 chunks per op: a quick CPU sanity run")  # fmt: skip
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--event-log", action="store_true",
                        help="the observed engine also writes an event log (temporary directory);"
                             " compare its on/off with a run without")  # fmt: skip
    parser.add_argument("--kv-events", action="store_true",
                        help="the observed engine also keeps a KV-event log (as `kvflow server`"
                             " does); compare its on/off with a run without")  # fmt: skip
    parser.add_argument("--control", action="store_true",
                        help="both engines with observability off: the on/off columns then"
                             " measure the spread between identical engines")  # fmt: skip
    args = parser.parse_args()
    if args.reps < 1 or args.rounds < 1:
        parser.error(f"--reps and --rounds must be >= 1, got {args.reps} and {args.rounds}")
    global EVENT_LOG_DIR, CONTROL, KV_EVENTS
    CONTROL = args.control
    KV_EVENTS = args.kv_events
    if args.event_log:
        EVENT_LOG_DIR = tempfile.mkdtemp(prefix="kvflow-bench-engine-events-")
    use_cuda = args.device == "cuda" or (args.device == "auto" and cuda_available())
    if use_cuda and not cuda_available():
        raise SystemExit("bench_engine --device cuda needs a CUDA GPU and pycuda")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    rows = []
    for case in CASES:
        if args.cases and case.name not in args.cases:
            continue
        if args.small:
            case = replace(case, layers=4, chunks=2)
        rows.append(run_case(case, device, args.reps, args.rounds))
        if use_cuda:
            torch.cuda.empty_cache()
    where = torch.cuda.get_device_name() if use_cuda else "CPU (no pinned memory)"
    print(
        f"device: {where}; GB/s = bytes moved per op / median wall time per op; ratios = "
        "median of per-repetition ratios"
    )
    print_table(rows)
    print(_round_spread(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
