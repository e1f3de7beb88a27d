"""CacheEngine on CUDA caches: the pipelined mover is bit-exact and its events pair up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvflow.core.engine import movers
from kvflow.core.tiers.hostmem import HostPool
from kvflow.events import EventType
from kvflow.events.stream import NativeStreamStamper
from kvflow.kernels import KVFormat, KVLayout, PreparedTransfer, cuda_available
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.engine import (
    TensorChunks,
    ToldSignal,
    block_bytes,
    events_of,
    pairs,
    small_engine,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]

BLOCK, CHUNK, CHUNKS = 16, 64, 11  # 11 chunks: several groups, both staging halves reused


@pytest.mark.parametrize("fmt", [f.value for f in KVFormat])
def test_cuda_round_trip_with_skip_is_bit_exact(
    fmt: str, monkeypatch: pytest.MonkeyPatch, cuda_device: torch.device
) -> None:
    """Store 11 chunks one per launch through 2 stages, retrieve them skipping 3 blocks."""
    monkeypatch.setattr(movers, "STAGING_BUDGET_BYTES", 1)  # one chunk per stage, 2 stages
    engine, recorder = small_engine(l1_bytes=64 << 20, chunk_size=CHUNK)
    n = CHUNKS * CHUNK // BLOCK
    gen = torch.Generator().manual_seed(3)
    src, kw = make_kv_caches(fmt, num_blocks=2 * n + 1, block_size=BLOCK, num_layers=3,
                             device=cuda_device, generator=gen, noncontiguous=True)  # fmt: skip
    dst, _ = make_kv_caches(fmt, num_blocks=2 * n + 1, block_size=BLOCK, num_layers=3,
                            device=cuda_device, generator=gen)  # fmt: skip
    engine.register_kv_caches("src", src, model_name="m", **kw)
    engine.register_kv_caches("dst", dst, model_name="m", **kw)
    perm = torch.randperm(2 * n + 1, generator=gen).tolist()
    a, b = perm[:n], perm[n : 2 * n]
    tokens = np.arange(CHUNKS * CHUNK + 5, dtype=np.int32)
    before = block_bytes(dst, kw, b)
    assert engine.store("src", tokens, [*a, perm[-1]], request_id="w") == CHUNKS * CHUNK
    got = engine.retrieve("dst", tokens, [*b, perm[-1]], request_id="r", skip_first_n_tokens=48)
    assert got == CHUNKS * CHUNK
    after = block_bytes(dst, kw, b)
    assert torch.equal(after[:3], before[:3])
    assert torch.equal(after[3:], block_bytes(src, kw, a)[3:])
    events = events_of(recorder, engine)
    done = [(s, e) for s, e in pairs(events)]
    assert [e.attrs["ok"] for _, e in done] == [True, True]
    assert all(e.ts_ns >= s.ts_ns for s, e in done)
    # each END, stamped on its stream, says how long the host took to queue the copies:
    # within the op's duration (give or take the GPU clock's conversion, 1 ms here)
    assert all(0 < e.attrs["queued_ns"] <= e.ts_ns - s.ts_ns + 1_000_000 for s, e in done)
    assert [e.type for e in events if e.type == EventType.L1_WRITE]
    engine.close()


def test_a_given_bus_gets_the_stream_stamper_with_the_first_cuda_cache(
    cuda_device: torch.device,
) -> None:
    """A bus handed to the engine without a stamper gets the native one when the engine
    makes its first CUDA mover, so GPU ops' END events carry the GPU's time."""
    engine, _ = small_engine(chunk_size=CHUNK)
    assert engine.bus.stamper is None
    kv, kw = make_kv_caches("vllm_flash_attn", block_size=BLOCK, device=cuda_device)
    engine.register_kv_caches("a", kv, model_name="m", **kw)
    assert isinstance(engine.bus.stamper, NativeStreamStamper)
    engine.close()


@pytest.mark.parametrize("max_group", [2, movers.MAX_GROUP])
def test_cuda_store_groups_chunks_around_the_staging_ring(
    max_group: int, monkeypatch: pytest.MonkeyPatch, cuda_device: torch.device
) -> None:
    """Several chunks per launch (6 groups of 2 wrap a ring of 4 stages), still exact."""
    monkeypatch.setattr(movers, "MAX_GROUP", max_group)
    engine, _ = small_engine(l1_bytes=64 << 20, chunk_size=CHUNK)
    n = CHUNKS * CHUNK // BLOCK
    src, kw = make_kv_caches("vllm_flash_attn", num_blocks=2 * n, block_size=BLOCK,
                             device=cuda_device)  # fmt: skip
    engine.register_kv_caches("a", src, model_name="m", **kw)
    mover = engine._instance("a").mover
    assert (mover.group, mover.stages) == (max_group, 4)  # type: ignore[attr-defined]
    tokens = np.arange(CHUNKS * CHUNK, dtype=np.int32)
    engine.store("a", tokens, list(range(n)), request_id="w")
    engine.retrieve("a", tokens, list(range(n, 2 * n)), request_id="r")
    assert torch.equal(
        block_bytes(src, kw, list(range(n, 2 * n))), block_bytes(src, kw, list(range(n)))
    )
    engine.close()


def test_one_op_enqueued_in_several_calls_continues_the_staging_ring(
    monkeypatch: pytest.MonkeyPatch, cuda_device: torch.device
) -> None:
    """Three store calls before one wait (1 + 3 + 3 chunks through 2 stages) gather exactly
    what one call would: each call's groups take the ring slots after the previous call's."""
    monkeypatch.setattr(movers, "STAGING_BUDGET_BYTES", 1)  # one chunk per stage, 2 stages
    caches, kw = make_kv_caches("vllm_flashinfer", num_blocks=64, block_size=BLOCK, num_layers=3,
                                device=cuda_device, generator=torch.Generator().manual_seed(8))  # fmt: skip
    layout = KVLayout.from_kv_caches(caches, **kw)
    per_chunk = CHUNK // BLOCK
    nbytes = layout.chunk_nbytes(CHUNK)
    mover = movers.CudaMover(layout, nbytes)
    assert (mover.group, mover.stages, mover.head_chunks) == (1, 2, 1)
    ids = np.random.default_rng(1).permutation(64)[: 7 * per_chunk].reshape(7, per_chunk)
    pool = HostPool()  # pinned like L1 (torch's pinned allocator must not outlive the streams)
    segment = pool.add_segment(7 * nbytes)
    dsts = [pool.view(segment, c * nbytes, nbytes) for c in range(7)]
    for a, b in ((0, 1), (1, 4), (4, 7)):
        mover.store(ids[a:b], TensorChunks(dsts[a:b]))
    mover.wait()
    want = torch.empty((7, nbytes), dtype=torch.uint8, device=cuda_device)
    PreparedTransfer(layout, ids, direction="gather", backend="cpu").launch(want)
    assert all(torch.equal(d, w) for d, w in zip(dsts, want.cpu(), strict=True))
    mover.close()
    pool.release()


def test_a_retrieve_failing_in_a_later_wave_writes_no_block(
    monkeypatch: pytest.MonkeyPatch, cuda_device: torch.device
) -> None:
    """The first wave's host copies are queued and its scatter held back; when the second
    wave fails, the held scatter is dropped: no block changes, END reports the failure,
    and the next retrieve (ring and id buffer reset) is bit-exact."""
    monkeypatch.setattr(movers, "HEAD_BYTES", 1)  # waves of 1, 1, 2 chunks
    engine, recorder = small_engine(l1_bytes=64 << 20, chunk_size=CHUNK)
    n = 4 * CHUNK // BLOCK
    gen = torch.Generator().manual_seed(5)
    src, kw = make_kv_caches("vllm_flash_attn", num_blocks=2 * n, block_size=BLOCK,
                             device=cuda_device, generator=gen)  # fmt: skip
    engine.register_kv_caches("a", src, model_name="m", **kw)
    tokens = np.arange(4 * CHUNK, dtype=np.int32)
    assert engine.store("a", tokens, list(range(n)), request_id="w") == 4 * CHUNK
    out = list(range(n, 2 * n))
    before = block_bytes(src, kw, out)
    real, calls = engine.l1.pin_prefix, [0]

    def failing(keys: list[object]) -> list[object]:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("lookup fault")
        return real(keys)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.l1, "pin_prefix", failing)
    with pytest.raises(Exception, match="lookup fault"):
        engine.retrieve("a", tokens, out, request_id="r")
    torch.cuda.synchronize(cuda_device)
    assert calls[0] == 2 and torch.equal(block_bytes(src, kw, out), before)
    monkeypatch.setattr(engine.l1, "pin_prefix", real)
    assert engine.retrieve("a", tokens, out, request_id="r2") == 4 * CHUNK
    assert torch.equal(block_bytes(src, kw, out), block_bytes(src, kw, list(range(n))))
    ends = [e.attrs for _, e in pairs(events_of(recorder, engine))]
    assert [e["ok"] for e in ends] == [True, False, True]
    engine.close()


def test_cuda_caches_round_trip_through_the_disk_tier(
    tmp_path: Path, cuda_device: torch.device
) -> None:
    """CUDA caches with L2 on disk: chunks evicted from L1 come back bit-exact, once loaded
    by the retrieve itself and once by a prefetch, for every format."""
    for fmt in [f.value for f in KVFormat]:
        gen = torch.Generator().manual_seed(5)
        n = CHUNKS * CHUNK // BLOCK
        src, kw = make_kv_caches(fmt, num_blocks=n, block_size=BLOCK, num_layers=3,
                                 device=cuda_device, generator=gen)  # fmt: skip
        dst, _ = make_kv_caches(fmt, num_blocks=2 * n, block_size=BLOCK, num_layers=3,
                                device=cuda_device, generator=gen)  # fmt: skip
        engine, recorder = small_engine(
            l1_bytes=64 << 20, chunk_size=CHUNK, l2_disk_paths=(str(tmp_path / fmt),)
        )
        engine.register_kv_caches("src", src, model_name="m", **kw)
        engine.register_kv_caches("dst", dst, model_name="m", **kw)
        tokens = np.arange(CHUNKS * CHUNK, dtype=np.int32)
        a = list(range(n))
        assert engine.store("src", tokens, a, request_id="w") == CHUNKS * CHUNK
        tiering = engine._tiering
        assert tiering is not None and tiering.writes.drain(10.0)
        for prefetch in (False, True):  # each round into blocks of its own
            b = list(range(n, 2 * n)) if prefetch else list(range(n))
            engine.l1.drop_where(lambda key: True)
            assert engine.lookup(tokens, model_name="m", prefetch=prefetch) == CHUNKS * CHUNK
            got = engine.retrieve("dst", tokens, b, request_id=f"r{prefetch}")
            assert got == CHUNKS * CHUNK
            assert torch.equal(block_bytes(dst, kw, b), block_bytes(src, kw, a)), fmt
        ends = [e for e in events_of(recorder, engine) if e.type == EventType.RETRIEVE_END]
        assert ends[0].attrs["l2_chunks"] == CHUNKS
        engine.close()


@pytest.mark.parametrize("order", ["in-order", "shuffled"])
def test_a_cuda_layerwise_retrieve_replies_once_layer_0_is_queued(
    order: str, cuda_device: torch.device
) -> None:
    """On CUDA the copies are queued, not run, by the thread serving the retrieve: layer
    0's go first and the reply (with the hit) right after them, so the server's work
    before layer 0's copy is no longer than it must be; the other layers follow."""
    engine, _ = small_engine(l1_bytes=64 << 20, chunk_size=CHUNK)
    n = CHUNKS * CHUNK // BLOCK
    gen = torch.Generator().manual_seed(5)
    src, kw = make_kv_caches("vllm_flash_attn", num_blocks=2 * n, block_size=BLOCK,
                             num_layers=3, device=cuda_device, generator=gen)  # fmt: skip
    dst, _ = make_kv_caches("vllm_flash_attn", num_blocks=2 * n, block_size=BLOCK,
                            num_layers=3, device=cuda_device, generator=gen)  # fmt: skip
    engine.register_kv_caches("src", src, model_name="m", **kw)
    engine.register_kv_caches("dst", dst, model_name="m", **kw)
    tokens = np.arange(CHUNKS * CHUNK, dtype=np.int32)
    assert engine.store("src", tokens, list(range(n)), request_id="w") == CHUNKS * CHUNK
    blocks = list(range(n, 2 * n)) if order == "in-order" else torch.randperm(
        2 * n, generator=gen
    )[:n].tolist()  # fmt: skip
    told = ToldSignal()
    got = engine.retrieve(
        "dst", tokens, blocks, request_id="r", layers=told, enqueued=told.enqueued
    )
    assert got == CHUNKS * CHUNK
    assert told.log == ["layer 0", f"reply {CHUNKS * CHUNK}", "layer 1", "layer 2"]
    assert torch.equal(block_bytes(dst, kw, blocks), block_bytes(src, kw, list(range(n))))
    engine.close()
