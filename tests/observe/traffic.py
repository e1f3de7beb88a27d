"""A real `kvflow server` subprocess and a workload that moves every metric the dashboard reads.

Shared by the dashboard, `kvflow top` and `kvflow report` tests. The server has a
small L1 (L1_CHUNKS objects) and a small disk tier (DISK_CHUNKS objects), the
metrics endpoint on a free port and every GPU block sampled, so one `drive` call
gives stores, retrieves (from L1 and from disk), lookup hits per tier and misses,
a blend lookup and retrieve, a failed store, L1 and L2 evictions, prefetches and
write-backs, and L0 block lifetimes, idle times and reuse gaps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.errors import KVFlowError
from kvflow.events import BlockAllocation
from kvflow.kernels.rope_params import RopeParams
from tests.e2e.server_proc import running_server
from tests.support.collectors import free_port

CHUNK = 16  # tokens per chunk = one engine block
BLOCKS = 64
SHAPE = (2, BLOCKS, CHUNK, 2, 64)  # vLLM flash-attn layer: [K|V, blocks, block size, heads, dim]
LAYERS = 2
CHUNK_BYTES = LAYERS * 2 * CHUNK * 2 * 64 * 2  # bf16
L1_CHUNKS = 16
DISK_CHUNKS = 40
MODEL = "dash-model"
INSTANCE = "dash-worker"


@dataclass
class Server:
    """A running server: its request endpoint, metrics port and log."""

    endpoint: str
    metrics_port: int
    log: Path


@contextlib.contextmanager
def observed_server(tmp_path: Path) -> Iterator[Server]:
    """`kvflow server` with L2 on disk, a metrics endpoint and L0 sample rate 1."""
    metrics_port = free_port()
    args = [
        "--prometheus-port", str(metrics_port),
        "--l1-size-gb", str(L1_CHUNKS * CHUNK_BYTES / (1 << 30)),
        "--l2-disk", str(tmp_path / "disk"),
        "--l2-disk-size-gb", str(DISK_CHUNKS * CHUNK_BYTES / (1 << 30)),
        "--l0-sample-rate", "1.0",
        "--disable-logging",
    ]  # fmt: skip
    log = tmp_path / "server.log"
    with running_server(CHUNK, log, args) as endpoint:
        yield Server(endpoint, metrics_port, log)


def _tokens(start: int, chunks: int) -> np.ndarray:
    return np.arange(start, start + chunks * CHUNK, dtype=np.int32)


def _wait(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not settle in time")
        time.sleep(0.05)


class Workload:
    """One registered CPU KV instance on a client, and the rounds of traffic it sends."""

    def __init__(self, client: KVFlowClient) -> None:
        self.client = client
        self.caches = [empty_shared(SHAPE, torch.bfloat16) for _ in range(LAYERS)]
        for i, layer in enumerate(self.caches):
            layer.fill_(float(i + 1))
        ropes = RopeParams(rotary_dim=SHAPE[-1], theta=10000.0)  # so that blend retrieves turn K
        client.register_kv_caches(
            INSTANCE, self.caches, model_name=MODEL, layerwise=True, ropes=ropes
        )
        self.round = 0
        #: block allocation records reported, and the block lifetimes they end (every
        #: block is sampled): what the server's L0 totals reach once its events are in
        self.allocation_records = 0
        self.block_lifetimes = 0

    def settled(self) -> bool:
        """No write-through pending and no load running."""
        l2 = self.client.status()["l2"]
        return l2["in_flight"]["write_through"]["calls"] == 0 and l2["in_flight"]["loading"] == 0

    def drive(self) -> None:
        """One round: stores past L1 and disk capacity, hits in L1 and on disk, misses,
        retrieves, a blend, one failed store, and block reports that evict, release and
        reuse."""
        c, r = self.client, self.round
        self.round += 1
        base = 1_000_000 * (r + 1)
        prompts = [_tokens(base + 10_000 * i, 8) for i in range(8)]  # 64 chunks in all
        for i, tokens in enumerate(prompts):
            c.store(INSTANCE, tokens, list(range(8)), request_id=f"s{r}-{i}")
            _wait(self.settled)
        for i, tokens in reversed(list(enumerate(prompts))):
            # the last prompts hit in L1, the first ones only on disk (the loads evict more)
            c.lookup(tokens, model_name=MODEL, request_id=f"l{r}-{i}")
            if i == len(prompts) - 1:  # layer by layer, as an engine reports its waits
                load = c.retrieve_layerwise(
                    INSTANCE, tokens, list(range(8, 16)), request_id=f"r{r}-{i}"
                )
                load.wait()
                c.report_layer_waits(INSTANCE, f"r{r}-{i}", load.layer_waits())
            else:
                c.retrieve(INSTANCE, tokens, list(range(8, 16)), request_id=f"r{r}-{i}")
            _wait(self.settled)
        c.lookup(_tokens(base + 900_000, 4), model_name=MODEL)  # a miss
        self._blend(r, _tokens(base + 950_000, 1), prompts[-1][: 4 * CHUNK])
        bad_blocks = [BLOCKS + 5] * 8  # block ids past the cache: a failed store and retrieve
        with contextlib.suppress(KVFlowError):
            c.store(INSTANCE, prompts[0], bad_blocks, request_id=f"bad{r}")
        with contextlib.suppress(KVFlowError):
            c.retrieve(INSTANCE, prompts[-1], bad_blocks, request_id=f"bad{r}")
        self._blocks(r)

    def _blend(self, r: int, new: np.ndarray, stored: np.ndarray) -> None:
        """A blend lookup of a prompt whose first chunk is new (no prefix hit) and whose
        stored chunks follow it, and a blend retrieve of the segments it found."""
        prompt = np.concatenate([new, stored])
        hit = self.client.blend_lookup(prompt, model_name=MODEL, request_id=f"b{r}")
        blocks = list(range(32, 32 + len(prompt) // CHUNK))
        self.client.blend_retrieve(INSTANCE, prompt, blocks, hit.segments, request_id=f"b{r}")
        _wait(self.settled)

    def _blocks(self, r: int) -> None:
        """Allocate blocks, release them, reuse their contents, then evict them."""
        c = self.client
        ids = list(range(16, 24))
        first = [int(t) for t in _tokens(3_000_000 + r, 8)]
        c.report_block_allocations(INSTANCE, [BlockAllocation(f"a{r}", ids, first)])
        time.sleep(0.02)
        c.end_session(f"a{r}")
        time.sleep(0.02)
        c.report_block_allocations(INSTANCE, [BlockAllocation(f"b{r}", ids, first)])  # reuse
        time.sleep(0.02)
        c.end_session(f"b{r}")
        time.sleep(0.02)
        other = [int(t) for t in _tokens(4_000_000 + r, 8)]
        c.report_block_allocations(INSTANCE, [BlockAllocation(f"c{r}", ids, other)])  # evict
        c.end_session(f"c{r}")
        self.allocation_records += 3
        # c's blocks end the lifetimes of a's (reused by b); from the second round on,
        # a's own blocks end those of the round before's c
        self.block_lifetimes += len(ids) * (2 if r else 1)
