"""RPC cost of `lookup` through a real `kvflow server` process.

Starts a server subprocess, registers a small shared-memory KV cache, stores a
long prompt (default 128,000 tokens = 500 chunks of 256), then times lookups of
that prompt and of a short one: client round trip and the server's own handling
time (decode, engine lookup, reply) as reported in each reply. The same lookups
on an in-process CacheEngine (observability off) separate the engine's share
from the RPC layer's. The long prompt is looked up from a numpy array and from a
Python list (what vLLM holds), and once more with its first token changed on every
call, so that no cached chain shares a chunk with it and all its keys are hashed
cold. The cases take turns in rounds of ROUND calls, so a burst of load on the box
falls on all of them alike. Issue 39's two ratios are printed: server p50 without a
request id over with one, and round trip from a list over from an array (both
<= 1.5), and the p50 of converting the list to int32 alone, kvflow's way and others
(the client's share of the list's round trip), and the p50 of hashing the prompt's
keys cold next to as many bare blake3 calls (the chain's floor). Run:
    python benchmarks/bench_rpc.py [--iterations N] [--tokens N] [--observability on|off]
"""

from __future__ import annotations

import argparse
import array
import os
import platform
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import blake3
import numpy as np
import torch
from bench_ttft import kvflow_server  # this folder is on sys.path when run as a script

from kvflow.core import CacheEngine, KVFlowClient, ObservabilityConfig, ServerConfig, empty_shared
from kvflow.core.arrays import as_int32_array
from kvflow.core.engine.keys import chain_hashes

BLOCK = 16
#: the server's default chunk size (tokens per key)
CHUNK = 256
#: calls of one case before the next case's turn
ROUND = 10
WARMUP = 5


class Case(NamedTuple):
    """One timed lookup: its prompt, its request id, and whether its first token changes
    on every call (a prompt the key caches have never seen)."""

    label: str
    prompt: np.ndarray | list[int]
    request_id: str | None
    fresh: bool = False


#: one lookup of a prompt with a request id: (hit tokens, server seconds or 0.0)
LookupFn = Callable[[np.ndarray | list[int], str | None], tuple[int, float]]


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples` (seconds) in microseconds."""
    arr = np.asarray(samples) * 1e6
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def time_cases(
    cases: list[Case], n: int, lookup: LookupFn
) -> list[tuple[list[float], list[float], int]]:
    """Per case: wall seconds and server seconds of `n` lookups, and the last hit; the
    cases take turns in rounds of ROUND calls, after WARMUP calls each."""
    calls = [0] * len(cases)
    walls: list[list[float]] = [[] for _ in cases]
    servers: list[list[float]] = [[] for _ in cases]
    hits = [0] * len(cases)

    def one(i: int) -> tuple[float, float]:
        case = cases[i]
        if case.fresh:
            assert isinstance(case.prompt, np.ndarray)
            case.prompt[0] = -1 - calls[i]  # no cached chain shares its first chunk
        calls[i] += 1
        t0 = time.perf_counter()
        hits[i], server = lookup(case.prompt, case.request_id)
        return time.perf_counter() - t0, server

    for i in range(len(cases)):
        for _ in range(WARMUP):
            one(i)
    for start in range(0, n, ROUND):
        for i in range(len(cases)):
            for _ in range(min(ROUND, n - start)):
                wall, server = one(i)
                walls[i].append(wall)
                servers[i].append(server)
    return list(zip(walls, servers, hits, strict=True))


def engine_lookup_us(cases: list[Case], n: int) -> list[float]:
    """p50 microseconds of the same lookups on an in-process engine (no RPC, no events)."""
    config = ServerConfig(l1_size_gb=0.5, observability=ObservabilityConfig(enabled=False))
    engine = CacheEngine(config)
    long_prompt = np.asarray(cases[0].prompt, dtype=np.int32)
    n_blocks = len(long_prompt) // BLOCK + 1
    kv = [torch.zeros(2, n_blocks, BLOCK, 1, 8, dtype=torch.float16)]
    engine.register_kv_caches("e", kv, model_name="bench")
    engine.store("e", long_prompt, np.arange(n_blocks - 1), request_id="warm")
    engine.end_session("warm")

    def lookup(prompt: np.ndarray | list[int], rid: str | None) -> tuple[int, float]:
        return engine.lookup(prompt, model_name="bench", request_id=rid), 0.0

    out = [percentiles(wall)[0] for wall, _, _ in time_cases(cases, n, lookup)]
    engine.close()
    return out


#: ways to turn a list of ints into int32: kvflow's, and the others it was measured against
CONVERSIONS: dict[str, Callable[[list[int]], object]] = {
    "kvflow as_int32_array (its C loop)": lambda v: as_int32_array(v, "token_ids"),
    "array.array('I') (kvflow before)": lambda v: array.array("I", v),
    "array.array('i')": lambda v: array.array("i", v),
    "struct.pack": lambda v: struct.pack(f"<{len(v)}i", *v),
    "np.array(dtype=int32)": lambda v: np.array(v, dtype=np.int32),
    "np.fromiter (takes floats)": lambda v: np.fromiter(v, np.int32, len(v)),
}


def conversion_us(values: list[int], n: int) -> dict[str, float]:
    """p50 microseconds of each of CONVERSIONS on `values`, taking turns in rounds."""
    times: dict[str, list[float]] = {name: [] for name in CONVERSIONS}
    for start in range(0, n, ROUND):
        for name, convert in CONVERSIONS.items():
            for _ in range(min(ROUND, n - start)):
                t0 = time.perf_counter()
                convert(values)
                times[name].append(time.perf_counter() - t0)
    return {name: percentiles(t)[0] for name, t in times.items()}


def hashing_us(tokens: np.ndarray, n: int) -> tuple[float, float]:
    """p50 microseconds of `tokens`' chained keys (`chain_hashes`), and of as many bare
    blake3 calls on messages of one key's size (previous key + a chunk): the chain's
    floor, as it is sequential by definition."""
    message = bytes(32 + CHUNK * 4)
    n_chunks = len(tokens) // CHUNK
    chain, bare = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        chain_hashes(tokens, CHUNK)
        t1 = time.perf_counter()
        for _ in range(n_chunks):
            blake3.blake3(message).digest()
        bare.append(time.perf_counter() - t1)
        chain.append(t1 - t0)
    return percentiles(chain)[0], percentiles(bare)[0]


def main() -> None:
    """Run the cases through a server and in process, and print the table and ratios."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=128_000)
    parser.add_argument("--short-tokens", type=int, default=512)
    parser.add_argument("--observability", choices=("on", "off"), default="on")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    long_prompt = rng.integers(0, 128_000, args.tokens, dtype=np.int32)
    cases = [
        Case(f"{args.tokens} tokens, no request_id", long_prompt, None),
        Case(f"{args.tokens} tokens, same request_id", long_prompt, "session"),
        Case(f"{args.tokens} tokens as a list, no req_id", long_prompt.tolist(), None),
        Case(f"{args.tokens} tokens, new prompt per call", long_prompt.copy(), None, fresh=True),
        Case(f"{args.short_tokens} tokens, no request_id", long_prompt[: args.short_tokens], None),
    ]
    flags = ["--disable-logging"]
    if args.observability == "off":
        flags.append("--disable-observability")
    with tempfile.TemporaryDirectory() as tmp, kvflow_server(
        0.5, Path(tmp) / "server.log", *flags
    ) as endpoint:  # fmt: skip
        client = KVFlowClient(endpoint, timeout_s=60)
        n_blocks = args.tokens // BLOCK + 1
        kv = [empty_shared((2, n_blocks, BLOCK, 1, 8), torch.float16)]
        kv[0].zero_()
        client.register_kv_caches("bench", kv, model_name="bench")
        stored = client.store("bench", long_prompt, np.arange(n_blocks - 1), request_id="warm")
        client.end_session("warm")

        def lookup(prompt: np.ndarray | list[int], rid: str | None) -> tuple[int, float]:
            hit = client.lookup(prompt, model_name="bench", request_id=rid)
            return hit, client.last_server_time_s

        rows = [
            (case.label, hit, *percentiles(rtt), *percentiles(server))
            for case, (rtt, server, hit) in zip(
                cases, time_cases(cases, args.iterations, lookup), strict=True
            )
        ]
        client.unregister("bench")
        client.close()
    in_process = engine_lookup_us(cases, args.iterations)
    convert = conversion_us(long_prompt.tolist(), args.iterations)
    chain_us, bare_us = hashing_us(long_prompt, args.iterations)

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
    print(f"a list of {args.tokens} ints to int32 alone, p50 (and / the array round trip):")
    for name, us in convert.items():
        print(f"  {name:<34} {us:>7.0f}us {us / no_rid[2]:>5.2f}")
    print(
        f"keys of {args.tokens} tokens, p50: chain_hashes {chain_us:.0f}us;"
        f" as many bare blake3 calls of a key's message {bare_us:.0f}us"
    )


if __name__ == "__main__":
    main()
