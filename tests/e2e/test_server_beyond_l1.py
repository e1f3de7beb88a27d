"""Prompts larger than L1 through real `kvflow server` subprocesses (issue 37's scenario).

L1 is 16 MiB, chunks are 1 MiB, and one request is 1.5x, 4x or 20x L1. With L2 on a
1 GiB disk of two paths, the store holds every chunk, the retrieve reads it all back
bit-exact, and a restarted server (cold L1) serves it whole from disk. With L2 on a
real redis-server, what one server stored a second server serves whole. No write is
dropped on the way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient, empty_shared
from tests.e2e.server_proc import running_server
from tests.e2e.test_server_l2 import Log, _wait
from tests.support.redis_servers import RedisServer

CHUNK = 64  # tokens per chunk = one block
LAYERS, HEADS, HEAD_SIZE = 4, 8, 128
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD_SIZE * 2  # bf16: 1 MiB
L1_BYTES = 16 << 20
L1_CHUNKS = L1_BYTES // CHUNK_BYTES
SIZES = [1.5, 4, 20]  # the request, in multiples of L1


def _caches(blocks: int, seed: int) -> list[torch.Tensor]:
    """vLLM flash-attn layers [K|V, blocks, block size, heads, head size] in shared memory,
    filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, blocks, CHUNK, HEADS, HEAD_SIZE)
    layers = [empty_shared(shape, torch.bfloat16) for _ in range(LAYERS)]
    for layer in layers:
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return layers


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


@contextlib.contextmanager
def _server(tmp_path: Path, name: str, l2: Sequence[str]) -> Iterator[tuple[KVFlowClient, Log]]:
    log_path = tmp_path / f"{name}.log"
    args = [
        "--l1-size-gb", str(L1_BYTES / (1 << 30)), *l2,
        "--log-level", "debug", "--log-format", "json",
    ]  # fmt: skip
    with (
        running_server(CHUNK, log_path, args) as endpoint,
        KVFlowClient(endpoint, timeout_s=120.0) as client,
    ):
        yield client, Log(log_path)


def _settled(client: KVFlowClient) -> bool:
    l2 = client.status()["l2"]
    return l2["in_flight"]["write_through"]["calls"] == 0 and l2["in_flight"]["loading"] == 0


class Request:
    """One request of `times_l1` x L1: its tokens, block ids and the source caches."""

    def __init__(self, times_l1: float) -> None:
        self.chunks = int(L1_CHUNKS * times_l1)
        self.tokens = np.arange(7, 7 + self.chunks * CHUNK, dtype=np.int32)
        self.ids = list(range(self.chunks))
        self.src = _caches(self.chunks, seed=1)

    def store(self, client: KVFlowClient, log: Log) -> dict[str, Any]:
        """Store it from a fresh instance; returns STORE_END once L2 has settled."""
        client.register_kv_caches("src", self.src, model_name="m")
        assert client.store("src", self.tokens, self.ids, request_id="big") == len(self.tokens)
        _wait(lambda: _settled(client), timeout=120)
        _wait(lambda: bool(log.events("store_end")))
        (end,) = log.events("store_end")
        return end

    def retrieve(self, client: KVFlowClient, log: Log) -> dict[str, Any]:
        """Retrieve it whole into fresh caches, bit-exact; returns RETRIEVE_END."""
        dst = _caches(self.chunks, seed=2)
        client.register_kv_caches("dst", dst, model_name="m")
        assert client.retrieve("dst", self.tokens, self.ids, request_id="back") == len(self.tokens)
        assert _same(dst, self.src)
        _wait(lambda: bool(log.events("retrieve_end")))
        end: dict[str, Any] = log.events("retrieve_end")[-1]
        return end


def _no_drops(client: KVFlowClient, tier: str) -> None:
    l2 = client.status()["l2"]
    assert l2["write_through"]["dropped_chunks"] == 0
    assert l2["tiers"][tier]["store_failures"] == 0


@pytest.mark.parametrize("times_l1", SIZES)
def test_a_prompt_larger_than_l1_is_stored_whole_on_disk_and_warm_after_restart(
    tmp_path: Path, times_l1: float
) -> None:
    """1 GiB of disk on two paths: stored whole, read back bit-exact, and found whole by
    a restarted server."""
    req = Request(times_l1)
    disk = ["--l2-disk", f"{tmp_path / 'd0'},{tmp_path / 'd1'}", "--l2-disk-size-gb", "1"]
    with _server(tmp_path, "first", disk) as (client, log):
        end = req.store(client, log)
        assert end["held_tokens"] == len(req.tokens) and end["streamed"]
        assert end["tokens_by_tier"]["l1"] <= L1_CHUNKS * CHUNK
        _no_drops(client, "disk")
        assert client.status()["l2"]["tiers"]["disk"]["objects"] == req.chunks
        assert req.retrieve(client, log)["hit_tokens"] == len(req.tokens)
    with _server(tmp_path, "restarted", disk) as (client, log):
        assert client.lookup(req.tokens, model_name="m", prefetch=False) == len(req.tokens)
        got = req.retrieve(client, log)
        assert got["l2_chunks"] == req.chunks  # a cold L1: every chunk came from disk


@pytest.mark.parametrize("times_l1", SIZES)
def test_a_prompt_larger_than_l1_is_stored_whole_in_redis_and_served_by_a_second_server(
    tmp_path: Path, times_l1: float
) -> None:
    """A real redis-server: one server stores the prompt whole, a second one (empty L1)
    serves it whole and bit-exact."""
    req = Request(times_l1)
    with RedisServer(tmp_path / "redis") as rs:
        redis = ["--l2-redis", rs.url(), "--l2-redis-key-prefix", "kvflow-big:"]
        with _server(tmp_path, "writer", redis) as (client, log):
            end = req.store(client, log)
            assert end["held_tokens"] == len(req.tokens) and end["streamed"]
            _no_drops(client, "redis")
            assert client.status()["l2"]["tiers"]["redis"]["stored"] == req.chunks
        with _server(tmp_path, "reader", redis) as (client, log):
            assert client.lookup(req.tokens, model_name="m", prefetch=False) == len(req.tokens)
            assert req.retrieve(client, log)["l2_chunks"] == req.chunks
