"""Two ranks through one server: aggregate store/retrieve GB/s against one rank alone.

A world_size=2 model (an 8B-like shape split by tensor parallelism: each rank
holds half the KV heads) registers one instance per GPU (rank 0 on cuda:0, rank 1
on cuda:1) with one `kvflow server` subprocess. In the same run it times:
  one rank   rank 0 alone stores, then retrieves, --tokens fresh tokens
  two ranks  both ranks at once (one thread and client each, started together)
and reports GB/s per phase and the two-rank/one-rank ratio (target >= 1.8). It
also checks SPEC section 3: a lookup finds a prefix only once every rank stored
it, and every retrieved block equals the stored one. `--device cpu` runs the
same flow over shared memory (two "ranks" in host memory), for CI. `--same-gpu`
puts both ranks on cuda:0: the two-rank CUDA IPC flow and its checks on a one-GPU
machine, where the ranks share one GPU's host link (two/one near 1.0 is expected).

    python benchmarks/bench_two_gpus.py                 # needs two GPUs
    python benchmarks/bench_two_gpus.py --same-gpu      # one GPU: the flow, not the scaling
    python benchmarks/bench_two_gpus.py --device cpu --tokens 4096 --repeat 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_ttft import kvflow_server  # this folder is on sys.path when run as a script

CHUNK = 256
BLOCK = 16
LAYERS, KV_HEADS_PER_RANK, HEAD_DIM = 32, 4, 128  # 8B shape (8 KV heads) at TP=2
WORLD = 2
WARMUP = 3  # untimed two-rank store rounds that fill L1


class Rank:
    """One rank: its device, paged caches (vLLM flash-attention layout) and client."""

    def __init__(self, rank: int, device: torch.device, blocks: int, endpoint: str) -> None:
        from kvflow.core import KVFlowClient, empty_shared

        self.rank, self.device = rank, device
        shape = (2, blocks, BLOCK, KV_HEADS_PER_RANK, HEAD_DIM)
        gen = torch.Generator(device=device).manual_seed(rank)
        if device.type == "cpu":
            self.layers = [empty_shared(shape, torch.bfloat16) for _ in range(LAYERS)]
            for layer in self.layers:
                layer.copy_(torch.randn(shape, generator=gen))
        else:
            self.layers = [
                torch.randn(shape, generator=gen, device=device).bfloat16() for _ in range(LAYERS)
            ]
        self.client = KVFlowClient(endpoint, timeout_s=600)
        self.instance = f"tp{rank}"
        self.sessions: list[str] = []
        self.client.register_kv_caches(
            self.instance, self.layers, model_name="two-gpus", world_size=WORLD, rank=rank
        )

    def store(self, tokens: torch.Tensor, table: torch.Tensor, rid: str) -> None:
        assert self.client.store(self.instance, tokens, table, request_id=rid) == len(tokens)

    def retrieve(self, tokens: torch.Tensor, table: torch.Tensor, rid: str) -> None:
        """Retrieve into `table` and wait until the copies landed: a CUDA retrieve
        returns once they are queued, with this device's current stream waiting on them."""
        got = self.client.retrieve(self.instance, tokens, table, request_id=rid)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        assert got == len(tokens), f"rank {self.rank} retrieved {got} of {len(tokens)}"
        self.sessions.append(rid)

    def end_sessions(self) -> None:
        """End the finished retrieves' sessions (outside the timing, as an engine would
        when its requests finish)."""
        while self.sessions:
            self.client.end_session(self.sessions.pop())

    def same_blocks(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return all(
            torch.equal(v[:, a.to(self.device)], v[:, b.to(self.device)]) for v in self.layers
        )

    def close(self) -> None:
        self.client.unregister(self.instance)
        self.client.close()


def _together(jobs: list[Callable[[], None]]) -> float:
    """Run the jobs on one thread each, released at once; seconds until the last ends."""
    start = threading.Barrier(len(jobs) + 1)
    errors: list[BaseException] = []

    def body(job: Callable[[], None]) -> None:
        start.wait()
        try:
            job()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - began


def _round(ranks: list[Rank], op: str, toks: torch.Tensor, table: torch.Tensor, tag: str) -> float:
    """`op` ("store" or "retrieve") on every rank in `ranks` at once; seconds taken."""
    took = _together([partial(getattr(r, op), toks, table, f"{tag}-{r.rank}") for r in ranks])
    for r in ranks:
        r.end_sessions()
    return took


def run(args: argparse.Namespace) -> dict[str, float]:
    if args.device == "cuda":
        devices = [torch.device("cuda", 0 if args.same_gpu else r) for r in range(WORLD)]
    else:
        devices = [torch.device("cpu")] * WORLD
    per_token = LAYERS * 2 * KV_HEADS_PER_RANK * HEAD_DIM * 2  # bytes per token per rank
    n_blocks = args.tokens // BLOCK
    blocks = 2 * n_blocks + 16
    # L1 holds WARMUP rounds of both ranks: the warm-up fills (and pins) it, so the timed
    # stores evict like a steady server instead of timing the pinning of new segments
    l1_gib = WARMUP * WORLD * args.tokens * per_token / (1 << 30)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in ("one_store", "one_retrieve", "two_store",
                                                     "two_retrieve")}  # fmt: skip
    with (
        tempfile.TemporaryDirectory() as tmp,
        kvflow_server(max(1.0, l1_gib), Path(tmp) / "server.log") as endpoint,
    ):
        ranks = [Rank(r, devices[r], blocks, endpoint) for r in range(WORLD)]
        try:
            order = torch.randperm(blocks, generator=gen)
            src, dst = order[:n_blocks], order[n_blocks : 2 * n_blocks]

            def tokens() -> torch.Tensor:
                return torch.randint(0, 1 << 20, (args.tokens,), generator=gen)

            # SPEC 3: a prefix is a hit only once every rank stored it
            check = tokens()
            ranks[0].store(check, src, "check-0")
            assert ranks[0].client.lookup(check, model_name="two-gpus", world_size=WORLD) == 0
            ranks[1].store(check, src, "check-1")
            hit = ranks[0].client.lookup(check, model_name="two-gpus", world_size=WORLD)
            assert hit == args.tokens, f"lookup after both ranks stored: {hit}"
            _round(ranks, "retrieve", check, dst, "check-r")
            for r in ranks:
                assert r.same_blocks(src, dst), f"rank {r.rank}: retrieved blocks differ"
            for i in range(WARMUP):
                _round(ranks, "store", tokens(), src, f"warm{i}")
            for i in range(args.repeat):
                alone, both = tokens(), tokens()
                times["one_store"].append(_round(ranks[:1], "store", alone, src, f"1s{i}"))
                times["one_retrieve"].append(_round(ranks[:1], "retrieve", alone, dst, f"1r{i}"))
                times["two_store"].append(_round(ranks, "store", both, src, f"2s{i}"))
                times["two_retrieve"].append(_round(ranks, "retrieve", both, dst, f"2r{i}"))
        finally:
            for r in ranks:
                r.close()
    nbytes = args.tokens * per_token
    out = {
        "bytes_per_rank": float(nbytes),
        "one_store_gbps": nbytes / statistics.median(times["one_store"]) / 1e9,
        "one_retrieve_gbps": nbytes / statistics.median(times["one_retrieve"]) / 1e9,
        "two_store_gbps": WORLD * nbytes / statistics.median(times["two_store"]) / 1e9,
        "two_retrieve_gbps": WORLD * nbytes / statistics.median(times["two_retrieve"]) / 1e9,
    }
    out["store_scaling"] = out["two_store_gbps"] / out["one_store_gbps"]
    out["retrieve_scaling"] = out["two_retrieve_gbps"] / out["one_retrieve_gbps"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank per op")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--same-gpu", action="store_true",
                        help="both ranks on cuda:0 (checks the flow on a one-GPU machine)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.tokens < CHUNK or args.tokens % CHUNK or args.repeat < 1:
        parser.error(f"--tokens a positive multiple of {CHUNK}; --repeat >= 1")
    if args.same_gpu and args.device != "cuda":
        parser.error("--same-gpu needs --device cuda")
    need = 1 if args.same_gpu else WORLD
    if args.device == "cuda" and torch.cuda.device_count() < need:
        gpus = "a GPU" if need == 1 else f"{need} GPUs"
        print(f"bench_two_gpus: needs {gpus}, found {torch.cuda.device_count()}")
        return 1
    try:
        out: dict[str, Any] = run(args)
    except AssertionError as exc:
        print(f"bench_two_gpus: check failed: {exc}", file=sys.stderr)
        return 1
    gib = out["bytes_per_rank"] / (1 << 30)
    where = "both ranks on cuda:0 (one shared link)" if args.same_gpu else args.device
    print(f"{args.tokens} tokens = {gib:.3f} GiB per rank per op, {where}")
    print(f"{'op':<9} {'one rank GB/s':>13} {'two ranks GB/s':>14} {'two/one':>8}")
    for op in ("store", "retrieve"):
        print(f"{op:<9} {out[f'one_{op}_gbps']:>13.2f} {out[f'two_{op}_gbps']:>14.2f} "
              f"{out[f'{op}_scaling']:>8.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
