"""One CacheEngine, ranks on two GPUs: every path works for either device whatever
context the calling thread has current (skipped with fewer than two GPUs)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow.kernels import cuda_available
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.engine import block_bytes, events_of, pairs, small_engine
from tests.support.gpus import make_context_current, require_gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.gpu2,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]

BLOCK, CHUNK, CHUNKS, WORLD = 16, 64, 6, 2
N = CHUNKS * CHUNK // BLOCK  # blocks a request fills


def _rank_caches(rank: int) -> tuple[list[torch.Tensor], dict[str, object]]:
    """Rank `rank`'s caches on cuda:rank (half the KV heads of a world_size=2 model)."""
    gen = torch.Generator().manual_seed(rank)
    caches, kw = make_kv_caches("vllm_flash_attn", num_blocks=3 * N, block_size=BLOCK,
                                num_layers=3, device=f"cuda:{rank}", generator=gen)  # fmt: skip
    return caches, kw


def test_ranks_on_both_gpus_store_retrieve_and_round_trip_through_disk(tmp_path: Path) -> None:
    """A world_size=2 model with rank r on cuda:r, driven first from one thread with
    cuda:0's context current, then from two threads at once that each hold the *other*
    GPU's context, then back from the disk tier: every block bit-exact, every START with
    its END, and a prefix is a hit only once both ranks stored it."""
    require_gpus(2)
    make_context_current(0)
    engine, recorder = small_engine(
        l1_bytes=64 << 20,
        chunk_size=CHUNK,
        l2_disk_paths=(str(tmp_path / "d0"), str(tmp_path / "d1")),
    )
    caches = [_rank_caches(r) for r in range(WORLD)]
    for r, (kv, kw) in enumerate(caches):
        engine.register_kv_caches(f"tp{r}", kv, model_name="m", world_size=WORLD, rank=r, **kw)
    src, dst = list(range(N)), list(range(N, 2 * N))
    tokens = np.arange(CHUNKS * CHUNK, dtype=np.int32)

    assert engine.store("tp0", tokens, src, request_id="w0") == CHUNKS * CHUNK
    assert engine.lookup(tokens, model_name="m", world_size=WORLD) == 0  # rank 1 missing
    assert engine.store("tp1", tokens, src, request_id="w1") == CHUNKS * CHUNK
    assert engine.lookup(tokens, model_name="m", world_size=WORLD) == CHUNKS * CHUNK
    for r in range(WORLD):
        assert engine.retrieve(f"tp{r}", tokens, dst, request_id=f"r{r}") == CHUNKS * CHUNK
        torch.cuda.synchronize(r)
        kv, kw = caches[r]
        assert torch.equal(block_bytes(kv, kw, dst), block_bytes(kv, kw, src)), f"rank {r}"

    errors: list[BaseException] = []

    def rank_loop(r: int) -> None:
        try:
            make_context_current(1 - r)  # the other GPU's context, as a server thread may have
            kv, kw = caches[r]
            for i in range(4):
                toks = np.arange(CHUNKS * CHUNK, dtype=np.int32) + 10_000 * (i + 1)
                out = list(range(2 * N, 3 * N))
                assert engine.store(f"tp{r}", toks, src, request_id=f"s{r}{i}") == len(toks)
                assert engine.retrieve(f"tp{r}", toks, out, request_id=f"g{r}{i}") == len(toks)
                torch.cuda.synchronize(r)
                assert torch.equal(block_bytes(kv, kw, out), block_bytes(kv, kw, src))
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []

    tiering = engine._tiering
    assert tiering is not None and tiering.writes.drain(30.0)
    engine.l1.drop_where(lambda key: True)
    for r in range(WORLD):  # L2 round trip: loaded from disk into L1, copied to cuda:r
        kv, kw = caches[r]
        out = list(range(2 * N, 3 * N))
        assert engine.retrieve(f"tp{r}", tokens, out, request_id=f"l2{r}") == CHUNKS * CHUNK
        torch.cuda.synchronize(r)
        assert torch.equal(block_bytes(kv, kw, out), block_bytes(kv, kw, src)), f"L2 rank {r}"
    ends = [end.attrs for _, end in pairs(events_of(recorder, engine))]
    assert ends and all(e["ok"] for e in ends)
    engine.close()
