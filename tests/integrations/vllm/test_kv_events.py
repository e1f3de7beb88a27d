"""The connector's KV events without vLLM: kvflow's chunk records become vLLM block events
(hashes, parent, tokens, medium), ranks are counted before a block is announced, and a
server restart withdraws what was announced."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvflow.core import KVFlowClient, KVFlowServer, empty_shared
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.keys import chain_hashes
from kvflow.integrations.vllm.kv_events import (
    BlockEvent,
    BlocksRemoved,
    BlocksStored,
    ChunkBlocks,
    RankVotes,
    WorkerKVEvents,
)
from kvflow.subscribers.kv_events import KVRecord
from tests.support.collectors import free_port
from tests.support.engine import BLOCK, CHUNK, caches, small_engine
from tests.support.ops import serving

PER = CHUNK // BLOCK  # blocks per chunk


def _block_hashes(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(n)]


def _record(kind: str, chunk_hashes: list[bytes], medium: str = "CPU") -> KVRecord:
    tier = "l1" if medium == "CPU" else "disk"
    return KVRecord(1, 0, kind, tier, medium, "m", 1, 0, None, chunk_hashes)  # type: ignore[arg-type]


def test_consecutive_chunks_become_one_event_and_other_chunks_are_skipped() -> None:
    """A record of a prompt's chunks is one BlockStored over all their blocks, parent None
    for the first block of the prompt, tokens in order; a chunk never remembered (another
    engine's) is left out; removals name the blocks too."""
    blocks = ChunkBlocks(CHUNK, BLOCK)
    tokens = np.arange(3 * CHUNK + 3, dtype=np.int32)
    hashes = _block_hashes("a", 3 * PER)
    blocks.remember(tokens, hashes, None)
    keys = chain_hashes(tokens[: 3 * CHUNK], CHUNK)
    stranger = chain_hashes(np.arange(1000, 1000 + CHUNK, dtype=np.int32), CHUNK)
    assert blocks.translate(_record("stored", [keys[0], *stranger, keys[1], keys[2]])) == [
        BlocksStored(tuple(hashes), None, tuple(range(3 * CHUNK)), "CPU")
    ]
    assert blocks.translate(_record("stored", keys[1:], "STORAGE")) == [
        BlocksStored(
            tuple(hashes[PER:]), hashes[PER - 1], tuple(range(CHUNK, 3 * CHUNK)), "STORAGE"
        )
    ]
    assert blocks.translate(_record("removed", [keys[2], keys[1]])) == [
        BlocksRemoved((*hashes[2 * PER :], *hashes[PER : 2 * PER]), "CPU")
    ]
    # what is still held: chunk 0 in CPU, chunks 1 and 2 in STORAGE
    withdrawn = {e.medium: set(e.block_hashes) for e in blocks.forget_held()}
    assert withdrawn == {"CPU": set(hashes[:PER]), "STORAGE": set(hashes[PER:])}
    assert blocks.forget_held() == []
    # the salt is part of a chunk's identity
    assert blocks.translate(KVRecord(2, 0, "stored", "l1", "CPU", "m", 1, 0, "s", keys)) == []


def test_a_block_is_announced_once_every_rank_reported_it() -> None:
    """With two ranks an event waits for the second report, even a step later; one rank's
    events pass at once."""
    votes = RankVotes(2)
    stored = BlocksStored((b"x",), None, (1, 2), "CPU")
    removed = BlocksRemoved((b"y",), "CPU")
    assert votes.add([stored, removed]) == []
    assert votes.add([removed]) == [removed]
    assert votes.add([stored]) == [stored]
    assert votes.add([stored]) == []  # a new round of reports
    assert RankVotes(1).add([stored, removed]) == [stored, removed]


@contextmanager
def _serving(engine: CacheEngine) -> Iterator[KVFlowServer]:
    try:
        with serving(KVFlowServer(engine.config, engine=engine)) as server:
            yield server
    finally:
        engine.bus.stop(5.0)


def _wait_for_events(follower: WorkerKVEvents, count: int) -> list[BlockEvent]:
    got: list[BlockEvent] = []
    deadline = time.monotonic() + 10
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {got} came"
        got += follower.take()
        time.sleep(0.01)
    return got


def test_the_follower_reports_stores_evictions_and_a_restart() -> None:
    """A worker's follower announces a stored prompt's blocks as CPU, the blocks L1
    evicts as removed, and after the server restarts withdraws every block it had
    announced as held."""
    port = free_port()
    # L1 holds 4 chunks of this instance: 2 layers x K/V x 8 tokens x 2 heads x 64 x bf16
    engine, _ = small_engine(port=port, l1_bytes=4 * 8192)
    endpoint = f"tcp://127.0.0.1:{port}"
    with KVFlowClient(endpoint, timeout_s=20) as client:
        with _serving(engine):
            kv, kwargs = caches("vllm_flash_attn", seed=1, num_heads=2, head_size=64)
            client.register_kv_caches(
                "w0", [empty_shared(t.shape, t.dtype) for t in kv], model_name="m", **kwargs
            )
            follower = WorkerKVEvents(
                lambda: KVFlowClient(endpoint, timeout_s=2),
                model_name="m", world_size=1, rank=0, block_size=BLOCK, poll_interval_s=0.01,
            )  # fmt: skip
            try:
                assert follower.subscribed.wait(10), "the follower never subscribed"
                a = np.arange(4 * CHUNK, dtype=np.int32)
                ha = _block_hashes("a", 4 * PER)
                follower.remember(a, ha, None)
                client.store("w0", a, list(range(8)), request_id="a")
                assert _wait_for_events(follower, 1) == [
                    BlocksStored(tuple(ha), None, tuple(range(4 * CHUNK)), "CPU")
                ]
                b = np.arange(500, 500 + 2 * CHUNK, dtype=np.int32)
                hb = _block_hashes("b", 2 * PER)
                follower.remember(b, hb, None)
                client.store("w0", b, [8, 9, 10, 11], request_id="b")
                # L1 evicts the tail of a (its chunk 3, then 2) to make room for b
                assert _wait_for_events(follower, 2) == [
                    BlocksRemoved((*ha[3 * PER :], *ha[2 * PER : 3 * PER]), "CPU"),
                    BlocksStored(tuple(hb), None, tuple(range(500, 500 + 2 * CHUNK)), "CPU"),
                ]
            except BaseException:
                follower.close()
                raise
        engine2, _ = small_engine(port=port)
        with _serving(engine2):
            try:
                (withdrawn,) = _wait_for_events(follower, 1)
                assert isinstance(withdrawn, BlocksRemoved) and withdrawn.medium == "CPU"
                assert set(withdrawn.block_hashes) == {*ha[: 2 * PER], *hb}
            finally:
                follower.close()
