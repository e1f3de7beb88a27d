"""RPC cost of `lookup` through a real `kvflow server` process.

Starts a server subprocess, registers a small shared-memory KV cache, stores a
long prompt (default 128,000 tokens = 500 chunks of 256), then times lookups of
that prompt and of a short one: client round trip and the server's own handling
time (decode, engine lookup, reply) as reported in each reply. The same lookups
on an in-process CacheEngine (observability off) separate the engine's share
from the RPC layer's. The long prompt is looked up from a numpy array and from a
Python list (what vLLM holds), and the two ratios of issue 39's targets are printed:
server p50 without a request id over with one, and round trip from a list over
from an array (both <= 1.5). Run:
    python benchmarks/bench_rpc.py [--iterations N] [--tokens N] [--observability on|off]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from kvflow.core import CacheEngine, KVFlowClient, ObservabilityConfig, ServerConfig, empty_shared

BLOCK = 16


def start_server(observability: bool) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "kvflow.cli", "server", "--port", "0", "--prometheus-port", "0"]
    cmd += ["--l1-size-gb", "0.5", "--log-format", "console", "--disable-logging"]
    if not observability:
        cmd.append("--disable-observability")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    match = re.search(r"listening on (tcp://\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"server did not start: {line}{proc.stderr.read()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining its log
    return proc, match.group(1)


def percentiles(samples: list[float]) -> tuple[float, float]:
    arr = np.asarray(samples) * 1e6
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def time_lookups(
    client: KVFlowClient, tokens: np.ndarray | list[int], n: int, request_id: str | None
) -> tuple[list[float], list[float], int]:
    """Round-trip and server-side seconds of `n` lookups (after a few warm-up calls)."""
    for _ in range(5):
        hit = client.lookup(tokens, model_name="bench", request_id=request_id)
    rtt, server = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        hit = client.lookup(tokens, model_name="bench", request_id=request_id)
        rtt.append(time.perf_counter() - t0)
        server.append(client.last_server_time_s)
    return rtt, server, hit


def engine_lookup_us(
    prompts: list[tuple[np.ndarray | list[int], str | None]], n: int
) -> list[float]:
    """p50 microseconds of the same lookups on an in-process engine (no RPC, no events)."""
    config = ServerConfig(l1_size_gb=0.5, observability=ObservabilityConfig(enabled=False))
    engine = CacheEngine(config)
    long_prompt = np.asarray(prompts[0][0], dtype=np.int32)
    n_blocks = len(long_prompt) // BLOCK + 1
    kv = [torch.zeros(2, n_blocks, BLOCK, 1, 8, dtype=torch.float16)]
    engine.register_kv_caches("e", kv, model_name="bench")
    engine.store("e", long_prompt, np.arange(n_blocks - 1), request_id="warm")
    engine.end_session("warm")
    out = []
    for prompt, rid in prompts:
        for _ in range(5):
            engine.lookup(prompt, model_name="bench", request_id=rid)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            engine.lookup(prompt, model_name="bench", request_id=rid)
            times.append(time.perf_counter() - t0)
        out.append(percentiles(times)[0])
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=128_000)
    parser.add_argument("--short-tokens", type=int, default=512)
    parser.add_argument("--observability", choices=("on", "off"), default="on")
    args = parser.parse_args()

    proc, endpoint = start_server(args.observability == "on")
    try:
        client = KVFlowClient(endpoint, timeout_s=60)
        n_blocks = args.tokens // BLOCK + 1
        kv = [empty_shared((2, n_blocks, BLOCK, 1, 8), torch.float16)]
        kv[0].zero_()
        client.register_kv_caches("bench", kv, model_name="bench")
        rng = np.random.default_rng(0)
        long_prompt = rng.integers(0, 128_000, args.tokens, dtype=np.int32)
        short_prompt = long_prompt[: args.short_tokens].copy()
        stored = client.store("bench", long_prompt, np.arange(n_blocks - 1), request_id="warm")
        client.end_session("warm")

        rows = []
        cases: tuple[tuple[str, np.ndarray | list[int], str | None], ...] = (
            (f"{args.tokens} tokens, no request_id", long_prompt, None),
            (f"{args.tokens} tokens, same request_id", long_prompt, "session"),
            (f"{args.tokens} tokens as a list, no req_id", long_prompt.tolist(), None),
            (f"{args.short_tokens} tokens, no request_id", short_prompt, None),
        )
        for label, prompt, rid in cases:
            rtt, server, hit = time_lookups(client, prompt, args.iterations, rid)
            rows.append((label, hit, *percentiles(rtt), *percentiles(server)))
        client.unregister("bench")
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
    in_process = engine_lookup_us([(p, rid) for _, p, rid in cases], args.iterations)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs;")
    print(f"observability {args.observability}; stored {stored} tokens; {args.iterations} calls")
    head = f"{'lookup':<36} {'hit':>7} {'rtt p50':>9} {'rtt p99':>9} {'srv p50':>9} {'srv p99':>9}"
    print(f"{head} {'engine p50':>10}")
    for (label, hit, r50, r99, s50, s99), e50 in zip(rows, in_process, strict=True):
        print(
            f"{label:<36} {hit:>7} {r50:>7.0f}us {r99:>7.0f}us {s50:>7.0f}us {s99:>7.0f}us"
            f" {e50:>8.0f}us"
        )
    no_rid, with_rid, from_list = rows[0], rows[1], rows[2]
    print(
        f"server p50 without / with a request id: {no_rid[4] / with_rid[4]:.2f} (target <= 1.5);"
        f" round trip p50 from a list / from an array: {from_list[2] / no_rid[2]:.2f}"
        " (target <= 1.5)"
    )


if __name__ == "__main__":
    main()
