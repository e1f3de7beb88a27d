"""GPU: the layerwise CUDA mover's 2-D copies land every byte where the reference does,
whatever L1's layout: objects one after another, in runs with gaps, out of order, alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine.movers import CudaMover
from kvflow.kernels import KVLayout, cuda_available
from kvflow.kernels.reference import transfer_reference
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import same_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]

BLOCK, PER_CHUNK, NUM_BLOCKS = 16, 4, 48
#: each chunk's L1 slot: runs of 3, 2 and 2 (the last two spaced 5 and 3 slots), a
#: descending step, and one object alone at the end
SLOTS = [0, 1, 2, 4, 5, 3, 8, 7, 10, 6]
SKIPS = [0, 0, 1, 4, 2, 0, 3, 1, 0, 2]
SPECS = {"one-group": None, "two-groups": [(2, 64, torch.bfloat16), (4, 32, torch.float16)] * 2}


def _caches(
    device: torch.device, seed: int, specs: Any
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    kw: dict[str, Any] = {"layer_specs": specs} if specs else {}
    return make_kv_caches(
        "vllm_flash_attn", num_layers=4, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_heads=2,
        head_size=64, device=device, generator=torch.Generator().manual_seed(seed), **kw,
    )  # fmt: skip


class ScatteredChunks:
    """L1 objects at SLOTS of one pinned buffer, slots a little wider than an object (so a
    run's pitch is not its row width)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.slot = nbytes, nbytes + 512
        self.buffer = torch.zeros(self.slot * (max(SLOTS) + 1), dtype=torch.uint8).pin_memory()

    def __len__(self) -> int:
        return len(SLOTS)

    def __getitem__(self, index: int) -> torch.Tensor:
        start = SLOTS[index] * self.slot
        return self.buffer[start : start + self.nbytes]

    def address(self, index: int, nbytes: int) -> int:
        assert nbytes == self.nbytes
        return int(self.buffer.data_ptr()) + SLOTS[index] * self.slot

    def region(self, index: int) -> int:
        return 0  # one pinned buffer


@pytest.mark.parametrize("order", ["shuffled", "in-order"])
@pytest.mark.parametrize("specs", SPECS.values(), ids=SPECS.keys())
def test_layerwise_store_and_retrieve_through_scattered_objects(
    specs: Any, order: str, cuda_device: torch.device
) -> None:
    """Shuffled blocks go through the staging ring and the block kernel; blocks in
    order go straight from L1 into the cache by 2-D copies (kvflow.core.engine.direct)."""
    chunks = len(SLOTS)
    ids = (
        np.random.default_rng(3).permutation(NUM_BLOCKS)[: chunks * PER_CHUNK]
        if order == "shuffled"
        else np.arange(3, 3 + chunks * PER_CHUNK)
    )
    table = ids.reshape(chunks, PER_CHUNK).astype(np.int64)
    chunk_tokens = PER_CHUNK * BLOCK

    src, kw = _caches(cuda_device, 1, specs)
    layout = KVLayout.from_kv_caches(src, **kw)
    nbytes = layout.chunk_nbytes(chunk_tokens)
    want = torch.empty((chunks, nbytes), dtype=torch.uint8)
    cpu_src = [c.cpu() for c in src]
    transfer_reference(
        KVLayout.from_kv_caches(cpu_src, **kw), want, torch.from_numpy(table),
        torch.zeros(chunks, dtype=torch.int64), gather=True,
    )  # fmt: skip

    l1 = ScatteredChunks(nbytes)
    mover = CudaMover(layout, nbytes)
    written: list[int] = []
    mover.store_layers(table, l1, chunk_tokens, lambda layer, _stream: written.append(layer))
    mover.wait()
    assert written == list(range(layout.num_layers))
    assert all(torch.equal(l1[c], want[c]) for c in range(chunks)), "a stored object differs"

    target, _ = _caches(cuda_device, 2, specs)
    expected = [c.cpu() for c in target]
    transfer_reference(
        KVLayout.from_kv_caches(expected, **kw), want, torch.from_numpy(table),
        torch.tensor(SKIPS, dtype=torch.int64), gather=False,
    )  # fmt: skip
    ready: list[int] = []
    back = CudaMover(KVLayout.from_kv_caches(target, **kw), nbytes)
    back.retrieve_layers(l1, table, SKIPS, chunk_tokens, lambda layer, _s: ready.append(layer))
    back.wait()
    assert ready == list(range(layout.num_layers))
    assert same_bytes([c.cpu() for c in target], expected)


def test_the_block_kernels_run_at_the_devices_greatest_priority(cuda_device: torch.device) -> None:
    """A layer's scatter must not queue behind the engine's kernels: the mover's kernel
    stream has the greatest priority, its copy stream the default."""
    import ctypes

    from kvflow.cuda import libcuda

    caches, kw = _caches(cuda_device, 0, None)
    layout = KVLayout.from_kv_caches(caches, **kw)
    mover = CudaMover(layout, layout.chunk_nbytes(PER_CHUNK * BLOCK))
    lib = libcuda()
    least, greatest = ctypes.c_int(), ctypes.c_int()
    torch.cuda.set_device(cuda_device)
    assert lib.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)) == 0
    assert greatest.value < least.value, "this GPU has a single stream priority"

    def priority(handle: int) -> int:
        got = ctypes.c_int()
        assert lib.cuStreamGetPriority(handle, ctypes.byref(got)) == 0
        return got.value

    assert priority(mover.kernel_stream.handle) == greatest.value
    assert priority(mover.copy_stream.handle) == least.value


@pytest.mark.parametrize(("slot_layers", "uses"), [(1, 4), (4, 3)])
def test_layers_staged_in_an_engine_ring_land_every_byte(
    cuda_device: torch.device, monkeypatch: pytest.MonkeyPatch, slot_layers: int, uses: int
) -> None:
    """A layerwise retrieve into shuffled blocks through a ring of two slots the engine
    owns (kvflow.core.server.staging), both sides in one process: the mover copies each
    layer into a slot (no kernel), or with slots of four layers spans of them (layers 0
    and 1 alone, then 2-3), a pump thread scatters each slot as the engine would (one
    launch a span), and the blocks end as the reference's; the first block stays as it
    was. This small a table would go straight into its blocks by 2-D copies, so that path
    is declined here."""
    import threading

    from kvflow.core.engine.direct import DirectLayers
    from kvflow.core.engine.transfers import written_chunks

    monkeypatch.setattr(DirectLayers, "copies", lambda _self, _layer: None)
    from kvflow.core.server.layers import ClientLayers, ServerLayers
    from kvflow.core.server.staging import ServerStaging

    chunks, chunk_tokens = len(SLOTS), PER_CHUNK * BLOCK
    ids = np.random.default_rng(4).permutation(NUM_BLOCKS)[: chunks * PER_CHUNK]
    rows, skips = written_chunks(0, chunks, 1, PER_CHUNK)  # the prompt's first block skipped
    table = ids.reshape(chunks, PER_CHUNK).astype(np.int64)[rows]
    target, kw = _caches(cuda_device, 5, None)
    layout = KVLayout.from_kv_caches(target, **kw)
    nbytes = layout.chunk_nbytes(chunk_tokens)
    data = torch.randint(0, 255, (chunks, nbytes), dtype=torch.uint8)
    l1 = ScatteredChunks(nbytes)
    for c in range(chunks):
        l1[c].copy_(data[c])
    expected = [c.cpu() for c in target]
    transfer_reference(
        KVLayout.from_kv_caches(expected, **kw), data, torch.from_numpy(table),
        torch.tensor(skips, dtype=torch.int64), gather=False,
    )  # fmt: skip

    widest = max(
        sum(n for _, n in layout.layer_parts(layer, chunk_tokens))
        for layer in range(layout.num_layers)
    )
    client = ClientLayers(
        layout.num_layers, cuda_device.index, layout, 2, slot_layers * chunks * widest
    )
    staging = client.staging
    assert staging is not None
    words = ServerLayers(layout.num_layers, None, client.raw, 2).staging_words
    ring = ServerStaging(staging.ring, words, staging.events)  # one process: the same events
    load = staging.add_load(1, ids.astype(np.int32), BLOCK)
    done = threading.Event()

    def pump() -> None:
        while not done.is_set():
            staging.pump()
            done.wait(0.001)

    pumper = threading.Thread(target=pump)
    pumper.start()
    ready: list[int] = []
    try:
        mover = CudaMover(layout, nbytes)
        mover.retrieve_layers(
            l1, table, skips, chunk_tokens, lambda layer, _s: ready.append(layer),
            ring.claims(1, lambda: False),
        )  # fmt: skip
        mover.wait()
    finally:
        done.set()
        pumper.join()
    staging.pump()
    torch.cuda.synchronize()
    assert ready == list(range(layout.num_layers))
    assert sorted(load.landed) == list(range(layout.num_layers))
    assert ring.stats()["staged_layers"] == layout.num_layers
    assert ring.stats()["slot_uses"] == uses
    assert same_bytes([c.cpu() for c in target], expected)
