"""The fast CPU path (`chunk_copies`, which the engine's `CpuMover` runs) against the
torch reference (`transfer_reference`), byte for byte.

Every format of `make_kv_caches`, contiguous and permuted, one or two layer groups, word
widths of 8, 4, 2 and 1 bytes, and SGLang host-pool shapes whose layers are views of one
buffer (the path that copies every layer and K/V of a block at once); chunks are rows of
one buffer with poisoned gaps (gathers) or separate buffers (scatters), block ids give
chunks of one run, of two, and of more than `MAX_RUNS` (moved by index), retrieves skip
prefixes of 0 to all blocks of a chunk, and the mover runs alone and with helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.engine.movers import CpuMover
from kvflow.core.engine.strided_copy import CopyTo, strided_copyto
from kvflow.kernels import KVFormat, KVLayout, reference
from kvflow.kernels.reference import ChunkBuffers, _chunk_plan, chunk_copies, transfer_reference
from kvflow.kernels.synthetic import LayerSpec, make_kv_caches
from tests.support.engine import TensorChunks
from tests.support.kernel_reference import same_bytes

POISON = 0xA5
GAP = 64  # poisoned bytes before each chunk of a gather
CHUNKS, PER_CHUNK, NUM_BLOCKS = 8, 4, 40
#: skipped blocks per chunk on a retrieve: none, some, all (see _block_ids for the runs)
SKIPS = [0, 0, 1, 4, 2, 0, 3, 1]

BF16 = (2, 8, torch.bfloat16)
FP8 = (1, 12, torch.float8_e4m3fn)
SPECS: dict[str, list[LayerSpec]] = {
    "one_group": [BF16] * 3,
    "two_groups": [BF16, FP8, BF16, FP8],  # interleaved: groups (0, 2) and (1, 3)
    "words_of_1": [(2, 7, torch.uint8)] * 2,
    "words_of_2": [(2, 5, torch.float16)] * 2,
    "words_of_4": [(2, 3, torch.float32)] * 2,
}


def _block_ids(seed: int) -> np.ndarray:
    """Distinct ids, [CHUNKS, PER_CHUNK], by chunk c % 3: one run of consecutive ids
    (b, b+1, ...), two runs (b+3, b, b+1, b+2), or one run per block, more than
    `MAX_RUNS` (b+3, b+2, b+1, b): moved by index."""
    rng = np.random.default_rng(seed)
    starts = rng.permutation(NUM_BLOCKS // PER_CHUNK)[:CHUNKS] * PER_CHUNK
    rows = [np.arange(b, b + PER_CHUNK) for b in starts]
    shapes = (lambda r: r, lambda r: np.roll(r, 1), lambda r: r[::-1])
    return np.stack([shapes[c % 3](r) for c, r in enumerate(rows)])


def transfer_chunks(
    layout: KVLayout,
    chunks: ChunkBuffers,
    block_ids: np.ndarray,
    skip_blocks: np.ndarray,
    *,
    gather: bool,
    copyto: CopyTo,
) -> None:
    """Run every copy of `chunk_copies` on this thread, in order."""
    copies = chunk_copies(layout, chunks, block_ids, skip_blocks, gather=gather, copyto=copyto)
    for copy in copies:
        copy.run()


def _check(
    make: Callable[[], Any],
    layout_of: Callable[[Any], KVLayout],
    seed: int,
    copyto: CopyTo | None = None,
) -> None:
    """Gather (with and without skips) and scatter (with skips) through `transfer_chunks`
    with separate chunk buffers, against `transfer_reference` on staging rows. `make()`
    builds the caches, the same bytes in the same structure at every call. `copyto`:
    each run's copy (default: the C loop the mover uses)."""
    copyto = strided_copyto() if copyto is None else copyto
    caches = make()
    layout = layout_of(caches)
    ids = _block_ids(seed)
    nbytes = layout.chunk_nbytes(PER_CHUNK * layout.block_size)
    for skip in ([0] * CHUNKS, SKIPS):
        want = torch.full((CHUNKS, nbytes), POISON, dtype=torch.uint8)
        transfer_reference(layout, want, torch.from_numpy(ids), torch.tensor(skip), gather=True)
        # rows of one buffer with poisoned gaps: a write outside a chunk shows in a gap
        slab = torch.full((CHUNKS, nbytes + GAP), POISON, dtype=torch.uint8)
        got = TensorChunks([row[GAP:] for row in slab])
        transfer_chunks(layout, got, ids, np.array(skip), gather=True, copyto=copyto)
        for c in range(CHUNKS):
            assert torch.equal(got[c], want[c]), f"gather, skips {skip}: chunk {c} differs"
        assert bool((slab[:, :GAP] == POISON).all()), "a gather wrote outside its chunk"

    gen = torch.Generator().manual_seed(seed)
    staging = torch.randint(0, 256, (CHUNKS, nbytes), dtype=torch.uint8, generator=gen)
    expected, actual = make(), make()
    transfer_reference(
        layout_of(expected), staging, torch.from_numpy(ids), torch.tensor(SKIPS), gather=False
    )
    chunks = TensorChunks([row.clone() for row in staging])  # separate storages
    transfer_chunks(layout_of(actual), chunks, ids, np.array(SKIPS), gather=False, copyto=copyto)
    assert not same_bytes(expected, caches), "the reference scatter wrote nothing"
    assert same_bytes(actual, expected), "scatter differs (a block, a skip or an offset)"


def _registered(kw: dict[str, Any]) -> Callable[[Any], KVLayout]:
    return lambda caches: KVLayout.from_kv_caches(caches, **kw)


@pytest.mark.parametrize("copy", ["native", "numpy"])
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("specs", list(SPECS), ids=str)
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_every_format_matches_the_reference(
    fmt: KVFormat, specs: str, noncontiguous: bool, copy: str
) -> None:
    """Every format x layer specs x (contiguous, permuted): bytes, skips and group offsets,
    each run copied by the mover's C loop and by numpy (its fallback)."""
    layer_specs = SPECS[specs]
    if fmt is KVFormat.VLLM_CROSS_LAYER and len(set(layer_specs)) > 1:
        pytest.skip("vllm_cross_layer holds one (num_heads, head_size, dtype) only")

    def make() -> tuple[Any, dict[str, Any]]:
        return make_kv_caches(
            fmt, num_blocks=NUM_BLOCKS, block_size=4, layer_specs=layer_specs,
            noncontiguous=noncontiguous, generator=torch.Generator().manual_seed(5),
        )  # fmt: skip

    copyto = strided_copyto() if copy == "native" else np.copyto
    _check(lambda: make()[0], _registered(make()[1]), seed=len(specs), copyto=copyto)


def _host_pool_layers(
    layout: str, slots: int, heads: int, dim: int, seed: int = 0
) -> list[torch.Tensor]:
    """`[2, pages, page, heads, dim]` layer views of one SGLang-shaped MHA host buffer of
    `slots` layers (bfloat16 random bytes from `seed`, 4-token pages, NUM_BLOCKS pages),
    as kvflow registers them."""
    pages, page = NUM_BLOCKS, 4
    tokens = pages * page
    gen = torch.Generator().manual_seed(seed)

    def buffer(*shape: int) -> torch.Tensor:
        raw = torch.randint(0, 256, (int(np.prod(shape)) * 2,), dtype=torch.uint8, generator=gen)
        return raw.view(torch.bfloat16).view(shape)

    if layout == "layer_first":
        kv = buffer(2, slots, tokens, heads, dim)
        return [kv[:, i].unflatten(1, (pages, page)) for i in range(slots)]
    if layout == "page_first":
        kv = buffer(2, tokens, slots, heads, dim)
        return [kv[:, :, i].unflatten(1, (pages, page)) for i in range(slots)]
    if layout == "page_first_direct":
        kv = buffer(2, pages, slots, page, heads, dim)
        return [kv[:, :, i] for i in range(slots)]
    kv = buffer(2, pages, heads, page, slots, dim)  # page_head
    return [kv[:, :, :, :, i].transpose(2, 3) for i in range(slots)]


POOL_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


@pytest.mark.parametrize("pool", POOL_LAYOUTS)
def test_one_buffer_host_pools_copy_every_layer_at_once(pool: str) -> None:
    """SGLang host-pool shapes: the layers of one buffer form one family moved in 8-byte
    words, and match the reference."""
    layout_of = _registered({"kv_format": "vllm_flash_attn"})
    _check(lambda: _host_pool_layers(pool, 4, 2, 8), layout_of, seed=1)
    (family,) = _chunk_plan(layout_of(_host_pool_layers(pool, 4, 2, 8)), PER_CHUNK)
    assert family.word.itemsize == 8


@pytest.mark.parametrize("pool", POOL_LAYOUTS)
def test_layers_at_uneven_distances_split_into_families(pool: str) -> None:
    """Layers in slots 0, 1 and 3 of one buffer: slot 3 breaks the layers' stride, so two
    families; bytes still match the reference."""

    def make() -> list[torch.Tensor]:
        slots = _host_pool_layers(pool, 4, 2, 8)
        return [slots[0], slots[1], slots[3]]

    layout_of = _registered({"kv_format": "vllm_flash_attn"})
    _check(make, layout_of, seed=2)
    plan = _chunk_plan(layout_of(make()), PER_CHUNK)
    assert [(f.layers.start, f.layers.stop) for f in plan] == [(0, 2), (2, 3)]


def test_two_groups_each_in_one_buffer() -> None:
    """Groups interleaved by layer, each group's layers views of a buffer of its own."""

    def make() -> list[torch.Tensor]:
        wide = _host_pool_layers("page_first", 2, 2, 8, seed=1)
        narrow = _host_pool_layers("page_first", 2, 1, 6, seed=2)
        return [wide[0], narrow[0], wide[1], narrow[1]]

    layout_of = _registered({"kv_format": "vllm_flash_attn"})
    _check(make, layout_of, seed=3)
    plan = _chunk_plan(layout_of(make()), PER_CHUNK)
    assert [(f.group, f.word.itemsize) for f in plan] == [(0, 8), (1, 4)]


def test_mla_rows_of_132_bytes_in_one_buffer() -> None:
    """An MLA page_first pool of 132-byte int8 rows: 4-byte words, one family."""

    def make() -> list[torch.Tensor]:
        pages, page, slots, gen = NUM_BLOCKS, 4, 3, torch.Generator().manual_seed(0)
        kv = torch.randint(
            -128, 128, (pages * page, slots, 1, 132), dtype=torch.int8, generator=gen
        )
        return [kv[:, i, 0].unflatten(0, (pages, page)) for i in range(slots)]

    layout_of = _registered({"kv_format": "vllm_mla"})
    _check(make, layout_of, seed=4)
    (family,) = _chunk_plan(layout_of(make()), PER_CHUNK)
    assert family.word.itemsize == 4


@pytest.mark.parametrize("threads", [1, 3], ids=["one_thread", "helpers"])
def test_cpu_mover_stores_and_retrieves_like_the_reference(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`CpuMover.store` / `retrieve` (block ids through the callable, skips as a list),
    on the calling thread alone and (every move counted big) with helper threads."""
    if threads > 1:
        monkeypatch.setattr(CpuMover, "PARALLEL_BYTES", 1)

    def mover(layers: list[torch.Tensor]) -> CpuMover:
        made = CpuMover(KVLayout.from_kv_caches(layers, kv_format="vllm_flash_attn"))
        made.threads = threads
        return made

    layers = _host_pool_layers("page_first", 3, 2, 8)
    layout = KVLayout.from_kv_caches(layers, kv_format="vllm_flash_attn")
    ids = _block_ids(6)
    nbytes = layout.chunk_nbytes(PER_CHUNK * layout.block_size)
    want = torch.empty((CHUNKS, nbytes), dtype=torch.uint8)
    transfer_reference(
        layout, want, torch.from_numpy(ids), torch.zeros(CHUNKS, dtype=torch.int64), gather=True
    )
    chunks = TensorChunks([torch.empty(nbytes, dtype=torch.uint8) for _ in range(CHUNKS)])
    mover(layers).store(ids, chunks)
    assert all(torch.equal(chunks[c], want[c]) for c in range(CHUNKS))

    target = _host_pool_layers("page_first", 3, 2, 8, seed=1)
    expected = _host_pool_layers("page_first", 3, 2, 8, seed=1)
    transfer_reference(
        KVLayout.from_kv_caches(expected, kv_format="vllm_flash_attn"), want,
        torch.from_numpy(ids), torch.tensor(SKIPS), gather=False,
    )  # fmt: skip
    mover(target).retrieve(chunks, lambda: ids, SKIPS)
    assert same_bytes(target, expected)
    assert (CpuMover._helpers is not None) or threads == 1


def _moved(layers: list[torch.Tensor], ids: np.ndarray, order: list[int]) -> int:
    """Gather then scatter `ids` ([chunks, PER_CHUNK]) through chunks that are rows of
    one buffer taken in `order` (row order[c] for chunk c), checking both against the
    reference; returns how many copies the gather was."""
    layout = KVLayout.from_kv_caches(layers, kv_format="vllm_flash_attn")
    n, nbytes = len(ids), layout.chunk_nbytes(PER_CHUNK * layout.block_size)
    want = torch.empty((n, nbytes), dtype=torch.uint8)
    no_skips = torch.zeros(n, dtype=torch.int64)
    transfer_reference(layout, want, torch.from_numpy(ids), no_skips, gather=True)
    slab = torch.full((n, nbytes), POISON, dtype=torch.uint8)
    chunks = TensorChunks([slab[r] for r in order])
    copies = chunk_copies(layout, chunks, ids, None, gather=True, copyto=strided_copyto())
    for copy in copies:
        copy.run()
    assert all(torch.equal(chunks[c], want[c]) for c in range(n))
    expected = [torch.zeros_like(t) for t in layers]
    transfer_reference(
        KVLayout.from_kv_caches(expected, kv_format="vllm_flash_attn"), want,
        torch.from_numpy(ids), no_skips, gather=False,
    )  # fmt: skip
    target = [torch.zeros_like(t) for t in layers]
    scatter = chunk_copies(
        KVLayout.from_kv_caches(target, kv_format="vllm_flash_attn"), chunks, ids,
        np.zeros(n, dtype=np.int64), gather=False, copyto=strided_copyto(),
    )  # fmt: skip
    for copy in scatter:
        copy.run()
    assert same_bytes(target, expected)
    return len(copies)


@pytest.mark.parametrize("pool", ["page_first", "layer_first"])
def test_evenly_spaced_whole_chunks_move_in_one_copy(pool: str) -> None:
    """Chunks one row apart in L1 holding blocks one step apart in the cache (ascending,
    descending, or a block step larger than a chunk) move as one copy; an uneven step,
    or chunks in separate storages, start a new one."""
    layers = _host_pool_layers(pool, 3, 2, 8)
    runs = [np.arange(b, b + PER_CHUNK) for b in (0, 4, 8, 12, 16)]
    forward, rows = np.stack(runs), list(range(5))
    assert _moved(layers, forward, rows) == 1
    assert _moved(layers, forward[::-1].copy(), rows[::-1]) == 1  # both steps negative
    assert _moved(layers, np.stack(runs[::2]), rows[:3]) == 1  # a block step of 8
    uneven = np.stack([runs[0], runs[1], runs[3], runs[4]])  # steps 4, 8, 4
    assert _moved(layers, uneven, rows[:4]) == 2  # blocks (0, 4) then (12, 16)
    assert _moved(layers, forward, [0, 1, 2, 4, 3]) == 2  # rows (0, 1, 2) then (4, 3)
    layout = KVLayout.from_kv_caches(layers, kv_format="vllm_flash_attn")
    nbytes = layout.chunk_nbytes(PER_CHUNK * layout.block_size)
    # chunk c at byte c * nbytes of a storage of its own: evenly spaced offsets, 5 storages
    own = [torch.empty(5 * nbytes, dtype=torch.uint8)[c * nbytes :][:nbytes] for c in range(5)]
    assert len(chunk_copies(layout, TensorChunks(own), forward, None, gather=True)) == 5


def test_no_span_is_larger_than_merge_bytes_nor_overlaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A merged copy holds at most MERGE_BYTES of chunks (here two): five even chunks make
    three copies; chunks whose blocks would overlap (a block step of 2 with 4 blocks per
    chunk, or rows closer than a chunk) never merge."""
    layers = _host_pool_layers("page_first", 3, 2, 8)
    layout = KVLayout.from_kv_caches(layers, kv_format="vllm_flash_attn")
    nbytes = layout.chunk_nbytes(PER_CHUNK * layout.block_size)
    monkeypatch.setattr(reference, "MERGE_BYTES", 2 * nbytes + 1)
    forward = np.stack([np.arange(b, b + PER_CHUNK) for b in (0, 4, 8, 12, 16)])
    assert _moved(layers, forward, list(range(5))) == 3
    overlapping = np.stack([np.arange(b, b + PER_CHUNK) for b in (0, 2)])
    slab = torch.empty(2 * nbytes, dtype=torch.uint8)
    chunks = TensorChunks([slab[:nbytes], slab[nbytes:]])
    assert len(chunk_copies(layout, chunks, overlapping, None, gather=True)) == 2
    close = _AnySize([slab[: nbytes // 2], slab[nbytes // 2 :]])  # half a chunk apart
    assert len(chunk_copies(layout, close, forward[:2], None, gather=True)) == 2


class _AnySize(TensorChunks):
    """Chunks whose `address` answers for any size, whatever they hold: lets a test lay
    chunks closer than their size (never done by L1) to check such chunks are not merged."""

    def address(self, index: int, nbytes: int) -> int:
        return int(self[index].data_ptr())


def test_a_block_outside_the_cache_is_refused_before_any_copy() -> None:
    """Block ids past the cache's end (the engine checks them first; the copy list does
    too): IndexError naming them, whether the chunk stands alone or ends a span."""
    layers = _host_pool_layers("page_first", 3, 2, 8)
    layout = KVLayout.from_kv_caches(layers, kv_format="vllm_flash_attn")
    nbytes = layout.chunk_nbytes(PER_CHUNK * layout.block_size)
    slab = torch.empty(2 * nbytes, dtype=torch.uint8)
    chunks = TensorChunks([slab[:nbytes], slab[nbytes:]])
    past = np.stack([np.arange(b, b + PER_CHUNK) for b in (NUM_BLOCKS - 4, NUM_BLOCKS)])
    with pytest.raises(IndexError, match=f"blocks 36..40 \\+ 4 outside a cache of {NUM_BLOCKS}"):
        chunk_copies(layout, chunks, past, None, gather=True)
    with pytest.raises(IndexError, match=f"blocks 40..40 \\+ 4 outside a cache of {NUM_BLOCKS}"):
        chunk_copies(layout, chunks, past[1:], None, gather=True)
