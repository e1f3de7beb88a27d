"""Stores into a cold L1: GB/s while L1 is still being pinned against a warm L1.

First a throwaway engine with a small L1 stores once, so CUDA's start-up and the
kernels' build are paid before the clock starts. Then a fresh in-process CacheEngine
(observability off) with an --l1-size-gb L1 on cuda:0 starts pinning its host memory in
the background at construction; the instance is registered (timed: its CUDA calls share
the driver with the pinning threads). As soon as the first segment is pinned (what a
ready server has; `l1_pinning` in status) it stores --stores requests of --mb MiB with
fresh tokens back to back, timing each: these run while L1 is still growing (the output
says how much was pinned when they began and ended, and warns when growth was already
over). Then it waits for the pinning to finish, stores the same number again into the
full, warm L1 (evicting), and prints the cold/warm ratio of the median GB/s (target
>= 0.9: no store waits on a registration) with the pinning timeline.

    python benchmarks/bench_cold_l1.py [--l1-size-gb 8] [--mb 512] [--stores 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.kernels import KVFormat, cuda_available
from kvflow.kernels.synthetic import make_kv_caches

CHUNK, BLOCK, LAYERS, HEADS, HEAD = 256, 16, 32, 8, 128  # an 8B shape, 128 KiB per token


def _store_times(
    engine: CacheEngine, blocks: list[int], tokens: int, n: int, seed: int
) -> list[float]:
    rng = np.random.default_rng(seed)
    times = []
    for i in range(n):
        toks = rng.integers(0, 1 << 30, tokens, dtype=np.int64)
        started = time.perf_counter()
        assert engine.store("bench", toks, blocks, request_id=f"s{seed}-{i}") == tokens
        times.append(time.perf_counter() - started)
        engine.end_session(f"s{seed}-{i}")
    return times


def _engine(l1_size_gb: float, pin_threads: int) -> CacheEngine:
    obs = ObservabilityConfig(enabled=False, prometheus_port=0)
    return CacheEngine(ServerConfig(chunk_size=CHUNK, l1_size_gb=l1_size_gb,
                                    l1_pin_threads=pin_threads, observability=obs))  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, object]:
    device = torch.device("cuda", 0)
    per_token = LAYERS * 2 * HEADS * HEAD * 2
    tokens = (args.mb << 20) // per_token // CHUNK * CHUNK
    kv, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=tokens // BLOCK + 1,
                            block_size=BLOCK, num_layers=LAYERS, num_heads=HEADS,
                            head_size=HEAD, device=device, dtype=torch.bfloat16)  # fmt: skip
    blocks = list(range(tokens // BLOCK))
    with _engine(2 * args.mb / 1024, 1) as warm_up:  # CUDA start-up and the kernels' build
        warm_up.register_kv_caches("bench", kv, model_name="cold", **kw)
        _store_times(warm_up, blocks, tokens, 1, seed=4)
    built = time.perf_counter()
    engine = _engine(args.l1_size_gb, args.pin_threads)
    registering = time.perf_counter()
    engine.register_kv_caches("bench", kv, model_name="cold", **kw)
    register_s = time.perf_counter() - registering
    while not (engine.status()["l1_pinning"] or {}).get("pinned_bytes"):
        time.sleep(0.001)
    first_segment_s = time.perf_counter() - built
    pinned_before_cold = engine.status()["l1_pinning"]
    cold = _store_times(engine, blocks, tokens, args.stores, seed=1)
    pinned_after_cold = engine.status()["l1_pinning"]
    while engine.status()["l1_pinning"]["pinning"]:
        time.sleep(0.01)
    state = engine.status()["l1_pinning"]
    _store_times(engine, blocks, tokens, 2, seed=3)  # untimed: the warm path's first touch
    warm = _store_times(engine, blocks, tokens, args.stores, seed=2)
    engine.close()
    nbytes = tokens * per_token
    out: dict[str, object] = {
        "l1_gib": args.l1_size_gb,
        "store_mib": nbytes / (1 << 20),
        "register_s": register_s,
        "first_segment_s": first_segment_s,
        "pinned_gib_before_cold_stores": pinned_before_cold["pinned_bytes"] / (1 << 30),
        "pinned_gib_after_cold_stores": pinned_after_cold["pinned_bytes"] / (1 << 30),
        "pinning_after_cold_stores": pinned_after_cold["pinning"],
        "pin_total_s": state["seconds"],
        "cold_gbps": nbytes / statistics.median(cold) / 1e9,
        "cold_min_gbps": nbytes / max(cold) / 1e9,
        "cold_overall_gbps": len(cold) * nbytes / sum(cold) / 1e9,
        "warm_gbps": nbytes / statistics.median(warm) / 1e9,
        "pin_threads": args.pin_threads,
        "cold_store_ms": [round(1e3 * t, 2) for t in cold],
    }
    out["cold_over_warm"] = float(out["cold_gbps"]) / float(out["warm_gbps"])  # type: ignore[arg-type]
    out["overall_cold_over_warm"] = float(out["cold_overall_gbps"]) / float(out["warm_gbps"])  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--l1-size-gb", type=float, default=8.0)
    parser.add_argument("--mb", type=int, default=512, help="MiB per store")
    parser.add_argument("--stores", type=int, default=16, help="timed stores per phase")
    parser.add_argument("--pin-threads", type=int, default=4, help="--l1-pin-threads (>= 1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.mb < 32 or args.stores < 1 or args.l1_size_gb <= 0 or args.pin_threads < 1:
        parser.error("--mb >= 32, --stores >= 1, --l1-size-gb > 0, --pin-threads >= 1")
    if not cuda_available():
        print("bench_cold_l1: needs a CUDA GPU and pycuda")
        return 1
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    print(f"L1 {args.l1_size_gb:g} GiB, {args.pin_threads} pin threads: registration took "
          f"{out['register_s']:.2f} s; first segment pinned after {out['first_segment_s']:.2f} s, "
          f"all after {out['pin_total_s']:.2f} s; the cold stores ran while "
          f"{out['pinned_gib_before_cold_stores']:.1f} to {out['pinned_gib_after_cold_stores']:.1f}"
          " GiB were pinned")  # fmt: skip
    if not out["pinning_after_cold_stores"]:
        print("warning: L1 finished pinning before the cold stores ended; a larger"
              " --l1-size-gb makes more of them run while it grows")  # fmt: skip
    print(f"{'phase':<6} {'median GB/s':>12} {'slowest GB/s':>13} {'all stores GB/s':>16}")
    print(f"{'cold':<6} {out['cold_gbps']:>12.2f} {out['cold_min_gbps']:>13.2f}"
          f" {out['cold_overall_gbps']:>16.2f}")  # fmt: skip
    print(f"{'warm':<6} {out['warm_gbps']:>12.2f}")
    print(f"cold/warm {out['cold_over_warm']:.3f} of the medians (target >= 0.9),"
          f" {out['overall_cold_over_warm']:.3f} of all the stores' bytes over their time")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
