"""kvflow whatif: exact against 1%-sampled (SHARDS) L1 simulation on a synthetic log.

Writes a log of at least --events events (default 1,000,000) with the event-log
subscriber: requests that share document prefixes (Zipf popularity) and add
unique chunks of their own, each published as the engine does (LOOKUP_START/END
with chunk_hashes, RETRIEVE and STORE pairs, BLOCK_ALLOCATION, END_SESSION). Then
simulates L1 exactly and, for --seeds sampler seeds, sampled, at every size, and
reports the times (read = the log's batch indexes into a trace, simulate = the LRU
pass and, sampled, the estimate's strata), each seed's end-to-end speed-up and its
largest absolute hit-rate difference over the sizes (the targets: <= 0.02 at every
size and >= 20x end to end at 1%). Each mode reads the log itself (page cache warm).
Run: python benchmarks/bench_whatif.py [--events N] [--rate R] [--seeds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.core.replay.lru import simulate
from kvflow.core.replay.trace import read_trace
from kvflow.core.replay.whatif import curve
from kvflow.events import Event, EventType
from kvflow.subscribers.eventlog import EventLogSubscriber
from kvflow.subscribers.eventlog_read import LogReader

CHUNK = 256
OBJECT_BYTES = 1 << 20
SIZES_GB = [4, 8, 16, 32, 64, 128, 256, 512]
MASK = (1 << 64) - 1


def _key(a: int, b: int) -> bytes:
    return struct.pack("<Q", ((a * 0x9E3779B97F4A7C15) ^ (b * 0xBF58476D1CE4E5B9)) & MASK)


def write_log(path: Path, n_events: int, *, docs: int = 50_000, seed: int = 0) -> int:
    """A log of >= n_events events; returns how many were written."""
    rng = np.random.default_rng(seed)
    sub = EventLogSubscriber(path, max_mb=1 << 20, segment_mb=256, fsync="none")
    ts, op, written = 1_000_000_000, 0, 0
    batch: list[Event] = [
        Event(EventType.REGISTER, ts, None, None,
              {"instance_id": "gpu0", "model_name": "m", "world_size": 1, "rank": 0})
    ]  # fmt: skip
    weights = 1.0 / np.arange(1, docs + 1) ** 0.9
    weights /= weights.sum()
    doc_len = rng.integers(2, 24, size=docs)
    req = 0
    while written + len(batch) < n_events:
        chosen = rng.choice(docs, size=4096, p=weights)
        for d in chosen.tolist():
            rid = f"r{req}"
            own = int(rng.integers(1, 5))
            hashes = [_key(d + 1, i) for i in range(int(doc_len[d]))]
            hashes += [_key(1 << 40 | req, i) for i in range(own)]
            tokens = len(hashes) * CHUNK + 17
            attrs = {"instance_id": "gpu0", "model_name": "m"}
            ts += 1000
            op += 3
            batch += [
                Event(EventType.LOOKUP_START, ts, rid, op, {"model_name": "m", "tokens": tokens}),
                Event(EventType.LOOKUP_END, ts + 50, rid, op,
                      {"model_name": "m", "tokens": tokens, "requested_tokens": tokens,
                       "hit_tokens": 0, "ok": True, "error": None, "chunk_hashes": hashes,
                       "chunk_size": CHUNK, "world_size": 1}),
                Event(EventType.BLOCK_ALLOCATION, ts + 60, None, None,
                      {**attrs, "block_size": 16, "records": []}),
                Event(EventType.RETRIEVE_START, ts + 100, rid, op + 1, {**attrs, "tokens": tokens}),
                Event(EventType.RETRIEVE_END, ts + 200, rid, op + 1,
                      {**attrs, "tokens": 0, "bytes": 0, "ok": True, "error": None,
                       "hit_tokens": 0, "chunks": 0, "chunk_hashes": hashes[: int(doc_len[d]) // 2]}),
                Event(EventType.STORE_START, ts + 300, rid, op + 2, {**attrs, "tokens": tokens}),
                Event(EventType.STORE_END, ts + 400, rid, op + 2,
                      {**attrs, "tokens": own * CHUNK, "bytes": own * OBJECT_BYTES, "ok": True,
                       "error": None, "chunk_hashes": hashes, "chunk_bytes": OBJECT_BYTES}),
                Event(EventType.END_SESSION, ts + 500, rid, None, {}),
            ]  # fmt: skip
            req += 1
            if len(batch) >= 2048:
                sub.on_events(batch)
                written += len(batch)
                batch = []
            if written + len(batch) >= n_events:
                break
    sub.on_events(batch)
    written += len(batch)
    sub.shutdown()
    return written


def run_mode(path: Path, rate: float, seed: int = 0) -> dict[str, Any]:
    """Read and simulate once; wall and CPU times (the box may be shared) and the curve."""
    t0, c0 = time.perf_counter(), time.process_time()
    trace = read_trace(LogReader.open(path))
    t1, c1 = time.perf_counter(), time.process_time()
    dist = simulate(trace, rate=rate, seed=seed)
    t2, c2 = time.perf_counter(), time.process_time()
    rows = curve(trace, dist, SIZES_GB)
    return {"read_s": t1 - t0, "simulate_s": t2 - t1, "total_s": t2 - t0,
            "cpu_read_s": c1 - c0, "cpu_simulate_s": c2 - c1, "cpu_total_s": c2 - c0,
            "hit_rates": [r.hit_rate for r in rows], "chunks": len(trace.keys)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--rate", type=float, default=0.01)
    p.add_argument("--seeds", type=int, default=5, help="sampler seeds tried (each reported)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvflow-bench-whatif-") as tmp:
        path = Path(tmp)
        t0 = time.perf_counter()
        n = write_log(path, args.events)
        write_s = time.perf_counter() - t0
        log_mb = sum(f.stat().st_size for f in path.iterdir()) / 2**20
        exact = run_mode(path, 1.0)
        sampled = [run_mode(path, args.rate, seed) for seed in range(args.seeds)]
    errors = [max(abs(a - b) for a, b in zip(exact["hit_rates"], s["hit_rates"], strict=True))
              for s in sampled]  # fmt: skip
    speedups = [exact["total_s"] / s["total_s"] for s in sampled]
    cpu_speedups = [exact["cpu_total_s"] / s["cpu_total_s"] for s in sampled]
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "events": n, "log_mb": round(log_mb, 1), "write_s": round(write_s, 2),
        "chunks": exact["chunks"], "sizes_gb": SIZES_GB,
        "exact": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in exact.items()},
        "sampled_rate": args.rate,
        "sampled_read_s": [round(s["read_s"], 3) for s in sampled],
        "sampled_simulate_s": [round(s["simulate_s"], 3) for s in sampled],
        "sampled_total_s": [round(s["total_s"], 3) for s in sampled],
        "max_abs_error_per_seed": [round(e, 4) for e in errors],
        "speedup_total_per_seed": [round(x, 1) for x in speedups],
        "cpu_speedup_total_per_seed": [round(x, 1) for x in cpu_speedups],
        "speedup_simulate": round(exact["simulate_s"] / min(s["simulate_s"] for s in sampled), 1),
    }  # fmt: skip
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{n:,} events, {log_mb:.0f} MiB log, {exact['chunks']:,} chunk references")
    print(f"exact:   read {exact['read_s']:.2f} s, simulate {exact['simulate_s']:.2f} s "
          f"(CPU {exact['cpu_read_s']:.2f} + {exact['cpu_simulate_s']:.2f} s)")  # fmt: skip
    for seed, (s, e, x, cx) in enumerate(zip(sampled, errors, speedups, cpu_speedups, strict=True)):
        print(f"sampled {args.rate:g} seed {seed}: read {s['read_s']:.3f} s, simulate "
              f"{s['simulate_s']:.3f} s, {x:.1f}x end to end ({cx:.1f}x CPU), "
              f"max |hit rate - exact| {e:.4f}")  # fmt: skip
    print(
        f"worst: {max(errors):.4f} (target <= 0.02), slowest {min(speedups):.1f}x"
        f" ({min(cpu_speedups):.1f}x CPU; target >= 20x)"
    )
    print("L1 GiB  exact hit rate")
    for gb, r in zip(SIZES_GB, exact["hit_rates"], strict=True):
        print(f"{gb:>6g}  {r:.4f}")


if __name__ == "__main__":
    main()
