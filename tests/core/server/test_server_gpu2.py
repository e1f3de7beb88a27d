"""One `kvflow server`, a tensor-parallel engine with a rank on each of two GPUs, through
CUDA IPC: correct on both devices, and a minute of both ranks storing and retrieving at
once with every byte checked (skipped with fewer than two GPUs)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kvflow.events import END_TO_START, START_TO_END
from kvflow.kernels import cuda_available
from kvflow.subscribers.eventlog_read import LogReader
from tests.core.server.test_server import ServerProcess
from tests.support.gpus import make_context_current, require_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu2,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]

BLOCK, CHUNK, WORLD = 16, 256, 2
TOKENS = 8 * CHUNK  # per request
BLOCKS = TOKENS // BLOCK
#: how long both ranks hammer the server (KVFLOW_GPU_STRESS_S overrides; default a minute)
STRESS_S = float(os.environ.get("KVFLOW_GPU_STRESS_S", "60"))


class Rank:
    """One TP rank: caches on cuda:rank (8 layers, 4 KV heads of 128), its own client."""

    def __init__(self, rank: int, endpoint: str) -> None:
        from kvflow.core import KVFlowClient

        self.rank = rank
        self.device = torch.device("cuda", rank)
        gen = torch.Generator(device=self.device).manual_seed(rank)
        shape = (2, 3 * BLOCKS, BLOCK, 4, 128)
        self.layers = [
            torch.randn(shape, generator=gen, device=self.device).bfloat16() for _ in range(8)
        ]
        self.client = KVFlowClient(endpoint, timeout_s=120)
        self.client.register_kv_caches(
            f"tp{rank}", self.layers, model_name="tp", world_size=WORLD, rank=rank
        )

    def blocks(self, ids: range) -> list[torch.Tensor]:
        return [layer[:, ids.start : ids.stop].clone() for layer in self.layers]

    def round(self, tokens: list[int], tag: str) -> None:
        """Store from blocks [0, B), retrieve into [B, 2B), check them equal."""
        src, dst = range(BLOCKS), range(BLOCKS, 2 * BLOCKS)
        for layer in self.layers:  # fresh bytes, so a stale retrieve cannot pass
            layer[:, src.start : src.stop].normal_()
        name = f"tp{self.rank}"
        assert self.client.store(name, tokens, list(src), request_id=f"s{tag}") == TOKENS
        got = self.client.retrieve(name, tokens, list(dst), request_id=f"r{tag}")
        torch.cuda.current_stream(self.device).synchronize()
        assert got == TOKENS, f"rank {self.rank} retrieved {got} of {TOKENS}"
        for a, b in zip(self.blocks(src), self.blocks(dst), strict=True):
            assert torch.equal(a, b), f"rank {self.rank} round {tag}: blocks differ"
        self.client.end_session(f"r{tag}")

    def close(self) -> None:
        self.client.unregister(f"tp{self.rank}")
        self.client.close()


def test_two_gpu_ranks_through_one_server_for_a_minute(tmp_path: Path) -> None:
    """Both ranks register from a process whose current context is cuda:0's, store and
    retrieve concurrently for STRESS_S seconds (fresh tokens and bytes each round): every
    round bit-exact, no hang, a lookup hits only what both ranks stored, and the server's
    event log pairs every START with exactly one END."""
    require_gpus(2)
    make_context_current(0)
    log_dir = tmp_path / "events"
    srv = ServerProcess("--disable-metrics", "--l1-size-gb", "1", "--event-log", str(log_dir))
    rounds = [0, 0]
    try:
        ranks = [Rank(r, srv.endpoint) for r in range(WORLD)]
        probe = list(range(7, 7 + TOKENS))
        ranks[0].round(probe, "p0")
        assert ranks[0].client.lookup(probe, model_name="tp", world_size=WORLD) == 0
        ranks[1].round(probe, "p1")
        assert ranks[1].client.lookup(probe, model_name="tp", world_size=WORLD) == TOKENS
        errors: list[BaseException] = []
        deadline = time.monotonic() + STRESS_S

        def hammer(rank: Rank) -> None:
            try:
                make_context_current(1 - rank.rank)  # the other GPU's context is current
                i = 0
                while time.monotonic() < deadline and not errors:
                    base = (2 * i + rank.rank + 1) * TOKENS  # fresh, and within int32
                    rank.round(list(range(base, base + TOKENS)), f"{rank.rank}-{i}")
                    i += 1
                rounds[rank.rank] = i
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=hammer, args=(r,)) for r in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(STRESS_S + 300)
            assert not thread.is_alive(), "a rank hung"
        assert errors == []
        assert min(rounds) > 0, rounds
        for rank in ranks:
            rank.close()
    finally:
        assert srv.stop() == 0, "".join(srv.lines)
    starts: dict[int, int] = {}
    ends: dict[int, int] = {}
    for event in LogReader.open(log_dir):
        if event.type in START_TO_END:
            starts[event.op_id or 0] = starts.get(event.op_id or 0, 0) + 1
        elif event.type in END_TO_START:
            ends[event.op_id or 0] = ends.get(event.op_id or 0, 0) + 1
    assert starts and starts == ends, "a START without its END (or the reverse)"
    assert set(starts.values()) == {1}
    print(f"rounds per rank in {STRESS_S:g} s: {rounds}")
