"""N ranks through one server: aggregate store/retrieve GB/s against one rank alone and
against plain pinned copies on the same GPUs.

A world_size=N model (an 8B-like shape split by tensor parallelism: each rank holds
8/N of the KV heads... for N=2, 4 heads) registers one instance per GPU (rank r on
cuda:r) with one `kvflow server` subprocess. Each rank runs in a process of its own,
as a tensor-parallel engine's workers do (`--rank-threads`: a thread each in this
process, their clients then share its interpreter). In the same run it times:
  rank r alone  each rank by itself stores, then retrieves, --tokens fresh tokens
  all ranks     every rank at once (started together; from the first call to the last
                return, as the ranks timed them)
  ceilings      plain pinned copies (torch, the same bytes, one thread and stream per
                GPU) device-to-host and host-to-device, each GPU alone and all at once;
                and all at once in L1's pattern (chunk-sized copies, registered memory)
and reports GB/s per phase, all/one (targets: >= 1.8 for two ranks), all ranks against
the all-GPU ceiling and each rank against its own GPU's ceiling (targets >= 0.9). It
also checks SPEC section 3: a lookup finds a prefix only once every rank stored it,
and every retrieved block equals the stored one. `--device cpu` runs the same flow
over shared memory (the "ranks" in host memory), for CI. `--same-gpu` puts every rank
on cuda:0: the multi-rank CUDA IPC flow on a one-GPU machine, where the ranks share
one GPU's host link (all/one near 1.0 is expected). `--in-process` drives one
`CacheEngine` in the benchmark's process instead of a server (same calls, no RPC, no
server loop): its scaling against the server's, in the same kind of run, says how much
of a shortfall is the server's and how much the engine's and the copies'.
`--shards N` starts the one server with N rank shards (`kvflow server --shards N`: a
process per GPU behind one endpoint; SPEC section 3's lookup is asked of it as of any
server). `--server-per-rank` starts one server per rank (each with its share of L1) and gives
rank r its own: a tensor-parallel rank only ever reads its own shard of the KV, so
separate servers lose no hits between the ranks of one engine (SPEC section 3's
all-ranks lookup then has no single server to ask, and is not checked); against one
server it says what a process per GPU would buy.

    python benchmarks/bench_two_gpus.py                 # needs two GPUs
    python benchmarks/bench_two_gpus.py --ranks 4       # needs four
    python benchmarks/bench_two_gpus.py --same-gpu      # one GPU: the flow, not the scaling
    python benchmarks/bench_two_gpus.py --in-process    # the engine without a server
    python benchmarks/bench_two_gpus.py --shards 2      # one server, a shard per GPU
    python benchmarks/bench_two_gpus.py --server-per-rank  # a server process per GPU
    python benchmarks/bench_two_gpus.py --rank-threads  # the ranks as threads of this one
    python benchmarks/bench_two_gpus.py --device cpu --tokens 4096 --repeat 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from bench_ttft import kvflow_server  # this folder is on sys.path when run as a script

if TYPE_CHECKING:
    from kvflow.core.engine.cache_engine import CacheEngine

CHUNK = 256
BLOCK = 16
LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # 8B shape: 8 KV heads, split over the ranks
WARMUP = 3  # untimed all-rank store rounds that fill L1
CEILING_REPS = 5

#: a call's (began, ended) on the host's monotonic clock (perf_counter: one clock for
#: every process of the host)
Span = tuple[float, float]


class Rank:
    """One rank: its device, paged caches (vLLM flash-attention layout) and its client, or
    the benchmark's in-process engine, which takes the same calls."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: torch.device,
        blocks: int,
        endpoint: str | CacheEngine,
    ) -> None:
        from kvflow.core import KVFlowClient, empty_shared

        self.rank, self.device = rank, device
        self.pid = os.getpid()
        shape = (2, blocks, BLOCK, KV_HEADS // world, HEAD_DIM)
        gen = torch.Generator(device=device).manual_seed(rank)
        if device.type == "cpu":
            self.layers = [empty_shared(shape, torch.bfloat16) for _ in range(LAYERS)]
            for layer in self.layers:
                layer.copy_(torch.randn(shape, generator=gen))
        else:
            self.layers = [
                torch.randn(shape, generator=gen, device=device).bfloat16() for _ in range(LAYERS)
            ]
        self._own_client = isinstance(endpoint, str)
        self.client = KVFlowClient(endpoint, timeout_s=600) if self._own_client else endpoint
        self.instance = f"tp{rank}"
        self.sessions: list[str] = []
        #: (request id, the call's round trip, the server's own time of it) per call
        #: through a server: what the request's trip adds to the engine's work
        self.calls: list[tuple[str, float, float]] = []
        self.client.register_kv_caches(
            self.instance, self.layers, model_name="two-gpus", world_size=world, rank=rank
        )

    def store(self, tokens: torch.Tensor, table: torch.Tensor, rid: str) -> Span:
        """Store `tokens` from `table`; (began, ended) on the host's monotonic clock."""
        began = time.perf_counter()
        stored = self.client.store(self.instance, tokens, table, request_id=rid)
        self._timed(rid, began)
        assert stored == len(tokens)
        return began, time.perf_counter()

    def retrieve(self, tokens: torch.Tensor, table: torch.Tensor, rid: str) -> Span:
        """Retrieve into `table` and wait until the copies landed (a CUDA retrieve returns
        once they landed, or with this device's current stream waiting on them)."""
        began = time.perf_counter()
        got = self.client.retrieve(self.instance, tokens, table, request_id=rid)
        self._timed(rid, began)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        assert got == len(tokens), f"rank {self.rank} retrieved {got} of {len(tokens)}"
        self.sessions.append(rid)
        return began, time.perf_counter()

    def _timed(self, rid: str, began: float) -> None:
        """Keep a call's round trip next to the server's own time of it (through a server)."""
        if self._own_client:
            self.calls.append((rid, time.perf_counter() - began, self.client.last_server_time_s))

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
        if self._own_client:  # not the benchmark's shared engine
            self.client.close()


def _serve_rank(
    conn: Connection, rank: int, world: int, device: str, blocks: int, endpoint: str
) -> None:
    """A rank process's loop: build the rank, then run the parent's calls one by one,
    answering (True, result) or (False, the traceback) over `conn`."""
    try:
        me = Rank(rank, world, torch.device(device), blocks, endpoint)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, me.pid))
    while True:
        op, args = conn.recv()
        try:
            if op in ("store", "retrieve"):
                tokens, table, rid = args
                result: Any = getattr(me, op)(
                    torch.from_numpy(tokens), torch.from_numpy(table), rid
                )
            elif op == "same_blocks":
                result = me.same_blocks(*(torch.from_numpy(a) for a in args))
            elif op == "end_sessions":
                result = me.end_sessions()
            else:  # close
                me.close()
                conn.send((True, me.calls))
                return
        except BaseException:
            conn.send((False, traceback.format_exc()))
            continue
        conn.send((True, result))


class RankProcess:
    """A rank in a process of its own, as a tensor-parallel engine's workers are, so its
    client's host work shares no interpreter with the other ranks'; takes Rank's calls,
    each run in the child (spawned: CUDA does not survive a fork)."""

    def __init__(self, rank: int, world: int, device: torch.device, blocks: int, endpoint: str):
        self.rank = rank
        self.calls: list[tuple[str, float, float]] = []
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(
            target=_serve_rank,
            args=(theirs, rank, world, str(device), blocks, endpoint),
            daemon=True,  # a rank left behind by a failed run ends with the benchmark
        )
        self._process.start()
        theirs.close()
        self.pid: int = self._answer()

    def _answer(self) -> Any:
        ok, result = self._conn.recv()
        if not ok:
            raise AssertionError(f"rank {self.rank}'s process failed:\n{result}")
        return result

    def _call(self, op: str, *args: Any) -> Any:
        self._conn.send((op, args))
        return self._answer()

    def store(self, tokens: torch.Tensor, table: torch.Tensor, rid: str) -> Span:
        return self._call("store", tokens.numpy(), table.numpy(), rid)  # type: ignore[no-any-return]

    def retrieve(self, tokens: torch.Tensor, table: torch.Tensor, rid: str) -> Span:
        return self._call("retrieve", tokens.numpy(), table.numpy(), rid)  # type: ignore[no-any-return]

    def end_sessions(self) -> None:
        self._call("end_sessions")

    def same_blocks(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(self._call("same_blocks", a.numpy(), b.numpy()))

    def close(self) -> None:
        self.calls = self._call("close")
        self._process.join(timeout=60)


def _together(jobs: list[Callable[[], Any]]) -> tuple[float, list[Any]]:
    """Run the jobs on one thread each, released at once; (seconds until the last ends,
    each job's result)."""
    start = threading.Barrier(len(jobs) + 1)
    errors: list[BaseException] = []
    results: list[Any] = [None] * len(jobs)

    def body(i: int) -> None:
        start.wait()
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - began, results


def _round(
    ranks: Sequence[Rank | RankProcess], op: str, toks: torch.Tensor, table: torch.Tensor, tag: str
) -> float:
    """`op` ("store" or "retrieve") on every rank in `ranks` at once; seconds from the
    first rank's call to the last one's return, as the ranks timed them."""
    _, spans = _together([partial(getattr(r, op), toks, table, f"{tag}-{r.rank}") for r in ranks])
    for r in ranks:
        r.end_sessions()
    return float(max(end for _, end in spans) - min(begin for begin, _ in spans))


def _trip_figures(ranks: Sequence[Rank | RankProcess]) -> dict[str, float]:
    """Each rank alone and in the all-ranks rounds, per op: the median round trip of its
    timed calls and of the server's own time of them (ms); none without a server. A
    rank's calls that take longer with the others running than alone say the ranks
    slow each other down inside the calls, not only in starting them."""
    out = {}
    for r in ranks:
        for phase, prefix in ((f"rank{r.rank}", f"rank{r.rank}"), ("all", f"all_rank{r.rank}")):
            for op in ("store", "retrieve"):
                calls = [c for c in r.calls if c[0].startswith(f"{phase}{op[0]}")]
                if calls:
                    trips, server = [c[1] for c in calls], [c[2] for c in calls]
                    out[f"{prefix}_{op}_round_trip_ms"] = 1e3 * statistics.median(trips)
                    out[f"{prefix}_{op}_server_ms"] = 1e3 * statistics.median(server)
    return out


def pinned_copy_gbps(
    devices: list[torch.device], nbytes: int, piece: int | None = None
) -> dict[str, float]:
    """GB/s of plain pinned copies of `nbytes` per device, one thread and stream per
    device, all devices at once (aggregate), device-to-host and host-to-device; the
    median of CEILING_REPS rounds. With `piece`, the copies go as L1's do: in pieces of
    `piece` bytes, into and out of memory registered with cudaHostRegister as L1's
    segments are (one per device), rather than one copy of memory cudaHostAlloc made."""
    from kvflow.core.tiers.hostmem import HostPool

    pools = [HostPool(pinned=True) for _ in devices] if piece else []
    if pools:
        hosts = [pool.view(pool.add_segment(nbytes), 0, nbytes) for pool in pools]
    else:
        hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in devices]
    gpus = [torch.empty(nbytes, dtype=torch.uint8, device=d) for d in devices]
    streams = [torch.cuda.Stream(device=d) for d in devices]
    step = piece or nbytes
    out = {}
    for name in ("d2h", "h2d"):

        def copy(i: int, name: str = name) -> None:
            with torch.cuda.stream(streams[i]):
                for at in range(0, nbytes, step):
                    host, gpu = hosts[i][at : at + step], gpus[i][at : at + step]
                    if name == "d2h":
                        host.copy_(gpu, non_blocking=True)
                    else:
                        gpu.copy_(host, non_blocking=True)
            streams[i].synchronize()

        for i in range(len(devices)):
            copy(i)  # warm
        took = [_together([partial(copy, i) for i in range(len(devices))])[0]
                for _ in range(CEILING_REPS)]  # fmt: skip
        out[name] = len(devices) * nbytes / statistics.median(took) / 1e9
    for pool in pools:
        pool.release()
    return out


@contextlib.contextmanager
def _backends(
    args: argparse.Namespace, l1_gib: float, log: Path
) -> Iterator[list[str | CacheEngine]]:
    """What each rank talks to: one `kvflow server` subprocess's endpoint, with
    --server-per-rank one server each (L1 split between them), or with --in-process an
    engine in this process (the server's defaults otherwise, its event lines in `log`)."""
    if args.server_per_rank:
        with contextlib.ExitStack() as stack:
            yield [
                stack.enter_context(
                    kvflow_server(l1_gib / args.ranks, log.with_suffix(f".{r}"), *args.server_flag)
                )
                for r in range(args.ranks)
            ]
        return
    if not args.in_process:
        shards = ["--shards", str(args.shards)] if args.shards > 1 else []
        with kvflow_server(l1_gib, log, *shards, *args.server_flag) as endpoint:
            yield [endpoint] * args.ranks
        return
    from kvflow.core.config import ObservabilityConfig, ServerConfig
    from kvflow.core.engine.cache_engine import CacheEngine

    # the server's observability as kvflow_server starts it; the engine's log handler
    # writes to the stderr it finds when built: the log file, as a server's would
    observe = ObservabilityConfig(prometheus_port=0, log_format="console")
    config = ServerConfig(chunk_size=CHUNK, l1_size_gb=l1_gib, observability=observe)
    with log.open("w") as out:
        with contextlib.redirect_stderr(out):
            engine = CacheEngine(config)
        try:
            yield [engine] * args.ranks
        finally:
            engine.close()


def run(args: argparse.Namespace) -> dict[str, float]:
    world = args.ranks
    if args.device == "cuda":
        devices = [torch.device("cuda", 0 if args.same_gpu else r) for r in range(world)]
    else:
        devices = [torch.device("cpu")] * world
    per_token = LAYERS * 2 * (KV_HEADS // world) * HEAD_DIM * 2  # bytes per token per rank
    n_blocks = args.tokens // BLOCK
    blocks = 2 * n_blocks + 16
    # L1 holds WARMUP rounds of both ranks: the warm-up fills (and pins) it, so the timed
    # stores evict like a steady server instead of timing the pinning of new segments
    l1_gib = WARMUP * world * args.tokens * per_token / (1 << 30)
    gen = torch.Generator().manual_seed(0)
    phases = [*(f"rank{r}" for r in range(world)), "all"]
    times: dict[str, list[float]] = {
        f"{p}_{op}": [] for p in phases for op in ("store", "retrieve")
    }
    with (
        tempfile.TemporaryDirectory() as tmp,
        _backends(args, max(1.0, l1_gib), Path(tmp) / "server.log") as endpoints,
    ):
        ranks: list[Rank | RankProcess] = []
        if args.in_process or args.rank_threads:
            ranks += [Rank(r, world, devices[r], blocks, endpoints[r]) for r in range(world)]
        else:
            ranks += [RankProcess(r, world, devices[r], blocks, str(endpoints[r]))
                      for r in range(world)]  # fmt: skip
        # SPEC 3's all-ranks lookup: asked of the one server (or engine) every rank uses
        asker = contextlib.ExitStack()
        lookup = None
        if not args.server_per_rank:
            from kvflow.core import KVFlowClient

            engine = endpoints[0]
            if isinstance(engine, str):
                engine = asker.enter_context(contextlib.closing(KVFlowClient(engine)))
            lookup = partial(engine.lookup, model_name="two-gpus", world_size=world)
        try:
            order = torch.randperm(blocks, generator=gen)
            src, dst = order[:n_blocks], order[n_blocks : 2 * n_blocks]

            def tokens() -> torch.Tensor:
                return torch.randint(0, 1 << 20, (args.tokens,), generator=gen)

            # SPEC 3: a prefix is a hit only once every rank stored it (in one server)
            check = tokens()
            for r in ranks:
                if lookup is not None:
                    hit = lookup(check)
                    assert hit == 0, f"lookup before rank {r.rank} stored: {hit}"
                r.store(check, src, f"check-{r.rank}")
            if lookup is not None:
                hit = lookup(check)
                assert hit == args.tokens, f"lookup after every rank stored: {hit}"
            _round(ranks, "retrieve", check, dst, "check-r")
            for r in ranks:
                assert r.same_blocks(src, dst), f"rank {r.rank}: retrieved blocks differ"
            for i in range(WARMUP):
                _round(ranks, "store", tokens(), src, f"warm{i}")
            for i in range(args.repeat):
                for phase in phases:
                    group = ranks if phase == "all" else [ranks[int(phase[4:])]]
                    toks = tokens()
                    for op, table in (("store", src), ("retrieve", dst)):
                        tag = f"{phase}{op[0]}{i}"
                        times[f"{phase}_{op}"].append(_round(group, op, toks, table, tag))
        finally:
            for r in ranks:
                r.close()
            asker.close()
        trips = _trip_figures(ranks)
    nbytes = args.tokens * per_token
    out: dict[str, float] = {"bytes_per_rank": float(nbytes), "ranks": float(world), **trips}
    # the processes other than this one the ranks ran in (0: threads of this process)
    out["rank_processes"] = float(len({r.pid for r in ranks} - {os.getpid()}))
    for phase in phases:
        n = world if phase == "all" else 1
        for op in ("store", "retrieve"):
            out[f"{phase}_{op}_gbps"] = n * nbytes / statistics.median(times[f"{phase}_{op}"]) / 1e9
    for op in ("store", "retrieve"):
        out[f"{op}_scaling"] = out[f"all_{op}_gbps"] / out[f"rank0_{op}_gbps"]
    if args.device == "cuda" and not args.same_gpu:  # the copy ceilings, same run, same bytes
        for r, device in enumerate(devices):
            alone = pinned_copy_gbps([device], nbytes)
            out[f"rank{r}_store_ceiling_gbps"] = alone["d2h"]
            out[f"rank{r}_retrieve_ceiling_gbps"] = alone["h2d"]
        every = pinned_copy_gbps(devices, nbytes)
        out["all_store_ceiling_gbps"], out["all_retrieve_ceiling_gbps"] = every["d2h"], every["h2d"]
        # L1's copies: chunk-sized pieces, registered memory (is the pattern what scales less?)
        pieces = pinned_copy_gbps(devices, nbytes, piece=CHUNK * per_token)
        out["all_store_pieces_gbps"], out["all_retrieve_pieces_gbps"] = pieces["d2h"], pieces["h2d"]
        for phase in phases:
            for op in ("store", "retrieve"):
                ceiling = out[f"{phase}_{op}_ceiling_gbps"]
                out[f"{phase}_{op}_of_ceiling"] = out[f"{phase}_{op}_gbps"] / ceiling
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank per op")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (GPUs): 2, 4 or 8")
    parser.add_argument("--same-gpu", action="store_true",
                        help="every rank on cuda:0 (checks the flow on a one-GPU machine)")  # fmt: skip
    parser.add_argument("--in-process", action="store_true",
                        help="drive a CacheEngine in this process instead of a server")  # fmt: skip
    parser.add_argument("--rank-threads", action="store_true",
                        help="every rank a thread of this process (their clients share one"
                             " interpreter), not a process each as an engine's TP workers")  # fmt: skip
    parser.add_argument("--server-per-rank", action="store_true",
                        help="one server per rank, each with its share of L1")  # fmt: skip
    parser.add_argument("--shards", type=int, default=1,
                        help="the server's rank shards (kvflow server --shards)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--server-flag", action="append", default=[],
                        help="a further `kvflow server` flag (repeatable), e.g."
                             " --server-flag=--disable-observability")  # fmt: skip
    args = parser.parse_args(argv)
    if args.tokens < CHUNK or args.tokens % CHUNK or args.repeat < 1:
        parser.error(f"--tokens a positive multiple of {CHUNK}; --repeat >= 1")
    if args.ranks not in (2, 4, 8):
        parser.error("--ranks must be 2, 4 or 8 (the 8 KV heads split evenly)")
    if args.same_gpu and args.device != "cuda":
        parser.error("--same-gpu needs --device cuda")
    if args.in_process and args.server_per_rank:
        parser.error("--server-per-rank and --in-process exclude each other")
    if args.shards > 1 and (args.in_process or args.server_per_rank):
        parser.error("--shards needs the one server (not --in-process or --server-per-rank)")
    if args.in_process and args.rank_threads:
        parser.error("--in-process runs every rank as a thread already (no --rank-threads)")
    if args.in_process and args.server_flag:
        parser.error("--server-flag needs a server (not --in-process)")
    need = 1 if args.same_gpu else args.ranks
    if args.device == "cuda" and torch.cuda.device_count() < need:
        gpus = "a GPU" if need == 1 else f"{need} GPUs"
        print(f"bench_two_gpus: needs {gpus}, found {torch.cuda.device_count()}")
        return 1
    try:
        out: dict[str, Any] = run(args)
    except AssertionError as exc:
        print(f"bench_two_gpus: check failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    _print_table(out, args)
    return 0


def _print_table(out: dict[str, float], args: argparse.Namespace) -> None:
    gib = out["bytes_per_rank"] / (1 << 30)
    where = "every rank on cuda:0 (one shared link)" if args.same_gpu else args.device
    where += (
        ", one engine in this process" if args.in_process
        else ", a server per rank" if args.server_per_rank
        else f", through one server of {args.shards} shards" if args.shards > 1
        else ", through one server"
    )  # fmt: skip
    if not args.in_process:
        processes = int(out["rank_processes"])
        where += (
            f", a process per rank ({processes})"
            if processes
            else ", ranks as threads of one process"
        )
    print(f"{args.tokens} tokens = {gib:.3f} GiB per rank per op, {args.ranks} ranks, {where}")
    ceilings = "all_store_ceiling_gbps" in out
    head = f"{'phase':<7} {'op':<9} {'GB/s':>8}"
    print(head + (f" {'ceiling GB/s':>13} {'of ceiling':>11}" if ceilings else ""))
    for phase in [*(f"rank{r}" for r in range(args.ranks)), "all"]:
        for op in ("store", "retrieve"):
            line = f"{phase:<7} {op:<9} {out[f'{phase}_{op}_gbps']:>8.2f}"
            if ceilings:
                line += (f" {out[f'{phase}_{op}_ceiling_gbps']:>13.2f}"
                         f" {out[f'{phase}_{op}_of_ceiling']:>11.3f}")  # fmt: skip
            print(line)
    for op in ("store", "retrieve"):
        print(f"{op} all/rank0: {out[f'{op}_scaling']:.2f}")
    for r in range(args.ranks):
        for prefix, when in ((f"rank{r}", "alone"), (f"all_rank{r}", "with the others")):
            if f"{prefix}_store_round_trip_ms" in out:
                print(f"rank{r} {when}, medians: " + "; ".join(
                    f"{op} round trip {out[f'{prefix}_{op}_round_trip_ms']:.2f} ms, in the"
                    f" server {out[f'{prefix}_{op}_server_ms']:.2f}" for op in ("store", "retrieve")
                ))  # fmt: skip
    if ceilings:
        print("all GPUs, L1's copy pattern (chunk-sized pieces, registered memory):"
              f" {out['all_store_pieces_gbps']:.2f} GB/s device-to-host,"
              f" {out['all_retrieve_pieces_gbps']:.2f} host-to-device")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
