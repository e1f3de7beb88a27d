"""The CUDA kernel equals the torch reference bit for bit (skipped without CUDA + pycuda).

Every format x dtype x vector width, contiguous and permuted, random block ids, random
skips and fresh random data per check; plus large pages (many warp tiles per block) and
the stream semantics of ``transfer_blocks``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from kvflow.kernels import (
    SUPPORTED_DTYPES,
    KVFormat,
    KVLayout,
    LayoutKernels,
    PreparedTransfer,
    cuda_available,
    new_transfer_stream,
    transfer_blocks,
)
from kvflow.kernels.cuda_backend import DEFAULT_TUNING, KernelTuning, launch_transfer
from kvflow.kernels.plan import VECTOR_WIDTHS, build_plan
from kvflow.kernels.reference import transfer_reference
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import flat_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]
POISON = 0x5A
_seeds = itertools.count(1000)


def _caches(
    fmt: KVFormat, seed: int, device: torch.device | str = "cuda", **kwargs: Any
) -> tuple[Any, KVLayout]:
    gen = torch.Generator().manual_seed(seed)
    caches, kw = make_kv_caches(fmt, device=device, generator=gen, **kwargs)
    return caches, KVLayout.from_kv_caches(caches, **kw)


def _check(
    fmt: KVFormat,
    chunks: int,
    per_chunk: int,
    max_vec: int,
    tuning: KernelTuning = DEFAULT_TUNING,
    *,
    device: torch.device | str = "cuda",
    **kwargs: Any,
) -> int:
    """Kernel vs reference for gather and scatter; returns the vector width used."""
    seed = next(_seeds)
    _, layout = _caches(fmt, seed, device, **kwargs)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(layout.num_blocks, generator=g)[: chunks * per_chunk]
    ids = ids.view(chunks, per_chunk)
    skip = torch.randint(0, per_chunk + 1, (chunks,), generator=g)
    skip[0] = 0
    nbytes = layout.chunk_nbytes(per_chunk * layout.block_size)
    got = torch.full((chunks, nbytes), POISON, dtype=torch.uint8, device=device)
    want = got.clone()
    plan = launch_transfer(
        layout, got, ids, skip, gather=True, max_vector_bytes=max_vec, tuning=tuning
    )
    transfer_reference(layout, want, ids, skip, gather=True)
    torch.cuda.synchronize(device)
    assert torch.equal(got, want), f"gather differs ({fmt.value}, vec cap {max_vec})"

    staging = torch.randint(0, 256, (chunks, nbytes), dtype=torch.uint8, device=device)
    target, target_layout = _caches(fmt, seed + 1, device, **kwargs)
    expected, expected_layout = _caches(fmt, seed + 1, device, **kwargs)
    launch_transfer(
        target_layout, staging, ids, skip, gather=False, max_vector_bytes=max_vec, tuning=tuning
    )
    transfer_reference(expected_layout, staging, ids, skip, gather=False)
    torch.cuda.synchronize(device)
    for a, b in zip(flat_tensors(target), flat_tensors(expected), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
            f"scatter differs ({fmt.value})"
        )
    assert plan is not None
    return min(p.vec_bytes for p in plan.groups)


def _widths(fmt: KVFormat, **kwargs: Any) -> list[int]:
    _, layout = _caches(fmt, 0, **kwargs)
    natural = min(p.vec_bytes for p in build_plan(layout, layout.block_size).groups)
    return [w for w in VECTOR_WIDTHS if w <= natural]


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_kernel_equals_reference_every_format_dtype_and_width(
    fmt: KVFormat, dtype: torch.dtype, noncontiguous: bool
) -> None:
    """Bit-exact for every vector width the layout allows, with skips and several chunks."""
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "noncontiguous": noncontiguous,
        "num_blocks": 24,
        "num_heads": 2,
        "head_size": 16,
    }
    widths = _widths(fmt, **kwargs)
    assert widths[0] == 16
    for width in widths:
        assert _check(fmt, 3, 4, width, **kwargs) == width


@pytest.mark.parametrize(
    ("fmt", "kwargs", "natural"),
    [
        (
            KVFormat.VLLM_FLASHINFER,
            {"head_size": 132, "dtype": torch.int8, "noncontiguous": True},
            4,
        ),
        (KVFormat.SGLANG_MHA, {"head_size": 65, "noncontiguous": True}, 2),
        # staged (16-byte granules) both ways: HND heads of 129 bytes and of 65 bf16
        (
            KVFormat.VLLM_FLASHINFER,
            {"head_size": 129, "dtype": torch.uint8, "noncontiguous": True, "block_size": 16},
            1,
        ),
        (
            KVFormat.VLLM_FLASHINFER,
            {"head_size": 65, "noncontiguous": True, "block_size": 16},
            2,
        ),
        (
            KVFormat.VLLM_CROSS_LAYER,
            {"head_size": 7, "dtype": torch.uint8, "noncontiguous": True},
            1,
        ),
        (KVFormat.VLLM_MLA, {"head_size": 132, "dtype": torch.int8, "block_size": 1}, 4),
        (KVFormat.SGLANG_MLA, {"head_size": 132, "dtype": torch.int8, "noncontiguous": True}, 4),
        # a plain 16-byte group, then a tiled one starting on the next CTA
        (
            KVFormat.VLLM_FLASHINFER,
            {
                "layer_specs": [(1, 64, torch.bfloat16), (2, 132, torch.int8)],
                "noncontiguous": True,
                "block_size": 16,
            },
            4,
        ),
    ],
)
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
def test_kernel_on_naturally_narrow_vectors(
    fmt: KVFormat, kwargs: dict[str, Any], natural: int, tiled: bool
) -> None:
    """Odd head sizes pick 4-, 2- and 1-byte vectors by themselves and stay exact, staged
    groups moved through shared memory (tiled) or straight from global memory."""
    tuning = KernelTuning(tiled=tiled)
    assert _check(fmt, 3, 4, 16, tuning, num_blocks=24, **kwargs) == natural


@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [
        (KVFormat.VLLM_FLASH_ATTN, {"block_size": 16, "num_heads": 8, "head_size": 128}),
        (
            KVFormat.VLLM_FLASHINFER,
            {"block_size": 16, "num_heads": 8, "head_size": 128, "noncontiguous": True},
        ),
        (KVFormat.VLLM_MLA, {"block_size": 256, "head_size": 576, "num_layers": 3}),
        (
            KVFormat.SGLANG_MHA,
            {"block_size": 16, "head_size": 128, "num_heads": 4, "noncontiguous": True},
        ),
        (
            KVFormat.VLLM_FLASH_ATTN,
            {"block_size": 16, "layer_specs": [(8, 128, torch.bfloat16), (1, 132, torch.int8)] * 2},
        ),
    ],
)
@pytest.mark.parametrize("max_vec", [16, 4, 2])
def test_kernel_on_large_pages(fmt: KVFormat, kwargs: dict[str, Any], max_vec: int) -> None:
    """Blocks spanning many warp tiles (up to 295 KB) copy exactly at several widths."""
    _check(fmt, 4, 4, max_vec, num_blocks=40, **kwargs)


@pytest.mark.parametrize(
    "tuning",
    [
        KernelTuning(iters=1),
        KernelTuning(iters=3),
        KernelTuning(wide_iters=4),
        KernelTuning(lane_bytes=128),
        KernelTuning(stream_loads=True, stream_stores=True),
        KernelTuning(stream_loads=True),
        KernelTuning(linear_min_ctas=6),
        KernelTuning(stream_stores=True),
        KernelTuning(tiled_min_ctas=8),
    ],
    ids=["iters1", "iters3", "witers4", "lane128", "cs", "ld-cs", "occ6", "st-cs", "tiled8"],
)
@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [
        (KVFormat.VLLM_FLASH_ATTN, {"block_size": 16, "num_heads": 8, "head_size": 128}),
        (
            KVFormat.VLLM_CROSS_LAYER,
            {"block_size": 16, "num_heads": 4, "head_size": 66, "noncontiguous": True},
        ),
        (  # tiled: 129-byte heads in head-major blocks
            KVFormat.VLLM_FLASHINFER,
            {
                "block_size": 16,
                "num_heads": 4,
                "head_size": 129,
                "dtype": torch.uint8,
                "noncontiguous": True,
            },
        ),
    ],
)
def test_kernel_tuning_builds_stay_exact(
    fmt: KVFormat, kwargs: dict[str, Any], tuning: KernelTuning
) -> None:
    """The benchmark's alternative builds copy exactly too."""
    for width in (16, 4):
        _check(fmt, 3, 4, width, tuning, num_blocks=30, **kwargs)


@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_kernel_equals_reference_on_the_device_under_test(
    fmt: KVFormat, cuda_device: torch.device
) -> None:
    """Every format, widest and narrowest vector, on cuda:0 and on cuda:1 with cuda:0's
    context current: the module, plan table and launch all belong to the cache's device."""
    for width in (16, 2):
        _check(fmt, 3, 4, width, device=cuda_device, num_blocks=30)


def test_default_stream_is_ordered_with_torch_current_stream(cuda_device: torch.device) -> None:
    """With stream=None the kernel sees prior torch work and torch sees the kernel's output."""
    caches, layout = _caches(KVFormat.VLLM_FLASH_ATTN, 1, cuda_device, num_blocks=64, block_size=16)
    ids = torch.arange(32).view(4, 8)
    staging = torch.empty(4, layout.chunk_nbytes(128), dtype=torch.uint8, device=cuda_device)
    for t in caches:
        t.fill_(3.0)  # queued on the current stream, not yet synchronised
    transfer_blocks(layout, staging, ids, direction="gather")
    assert bool((staging.view(torch.bfloat16) == 3.0).all())


def test_explicit_stream_is_shared_by_torch_and_the_kernel(cuda_device: torch.device) -> None:
    """Work queued through stream.torch and the kernel on the same stream runs in order."""
    caches, layout = _caches(
        KVFormat.VLLM_MLA, 2, cuda_device, num_blocks=16, block_size=16, head_size=64
    )
    stream = new_transfer_stream(layout.device)
    staging = torch.empty(2, layout.chunk_nbytes(32), dtype=torch.uint8, device=cuda_device)
    torch.cuda.synchronize(cuda_device)
    with torch.cuda.stream(stream.torch):
        staging.fill_(7)
    ids = torch.tensor([[1, 2], [3, 4]])
    transfer_blocks(layout, staging, ids, direction="scatter", stream=stream)
    stream.synchronize()
    assert all(bool((t[1:5].view(torch.uint8) == 7).all()) for t in caches)
    assert all(bool((t[5:].view(torch.uint8) != 7).any()) for t in caches)


def test_cuda_backend_needs_staging_on_the_cache_device(cuda_device: torch.device) -> None:
    """Pinned host staging must be copied by the caller: the kernel refuses it clearly."""
    _, layout = _caches(KVFormat.VLLM_FLASH_ATTN, 3, cuda_device)
    staging = torch.empty(1, layout.chunk_nbytes(8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="both on one device"):
        transfer_blocks(layout, staging, torch.tensor([[0, 1]]), direction="gather")


@pytest.mark.parametrize(
    "fmt", [KVFormat.VLLM_FLASH_ATTN, KVFormat.SGLANG_MHA], ids=lambda f: f.value
)
def test_prepared_transfer_launches_groups_on_a_stream_exactly(
    fmt: KVFormat, cuda_device: torch.device
) -> None:
    """Ids uploaded once, groups launched at offsets: same bytes as the reference, both ways."""
    seed = next(_seeds)
    _, layout = _caches(fmt, seed, cuda_device, num_blocks=64)
    stream = new_transfer_stream(layout.device)
    chunks, per_chunk = 7, 3
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(layout.num_blocks, generator=g)[: chunks * per_chunk].view(
        chunks, per_chunk
    )
    skip = [c % (per_chunk + 1) for c in range(chunks)]
    nbytes = layout.chunk_nbytes(per_chunk * layout.block_size)
    got = torch.full((chunks, nbytes), POISON, dtype=torch.uint8, device=cuda_device)
    want = got.clone()
    torch.cuda.synchronize(cuda_device)
    moves = PreparedTransfer(layout, ids, direction="gather", skip_blocks=skip, stream=stream)
    for first, count in ((0, 3), (3, 1), (4, 3)):
        moves.launch(got[first : first + count], first, count)
    transfer_reference(layout, want, ids, torch.tensor(skip), gather=True)
    stream.synchronize()
    assert torch.equal(got, want)

    target, target_layout = _caches(fmt, seed + 1, cuda_device, num_blocks=64)
    expected, expected_layout = _caches(fmt, seed + 1, cuda_device, num_blocks=64)
    torch.cuda.synchronize(cuda_device)
    scatter = PreparedTransfer(
        target_layout, ids, direction="scatter", skip_blocks=skip, stream=stream
    )
    scatter.launch(got[:5], 0, 5)
    scatter.launch(got[5:], 5)
    transfer_reference(expected_layout, got, ids, torch.tensor(skip), gather=False)
    stream.synchronize()
    for a, b in zip(flat_tensors(target), flat_tensors(expected), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_layout_kernels_scatter_from_buffers_of_any_alignment(cuda_device: torch.device) -> None:
    """`LayoutKernels.launch` scatters the uploaded ids of two transfers through a span of
    layers from rows at a 16-byte and at an 8-byte aligned address (a kernel resolved
    per alignment) exactly as the reference does."""
    seed = next(_seeds)
    caches, layout = _caches(KVFormat.VLLM_FLASH_ATTN, seed, cuda_device, num_blocks=64)
    want, want_layout = _caches(KVFormat.VLLM_FLASH_ATTN, seed, cuda_device, num_blocks=64)
    stream = new_transfer_stream(layout.device)
    chunks, per_chunk = 5, 3
    tokens = per_chunk * layout.block_size
    count = min(2, layout.num_layers)
    kernels = LayoutKernels(layout.span_layout(0, count), tokens, gather=False)
    nbytes = kernels.chunk_nbytes
    g = torch.Generator().manual_seed(seed)
    flat = torch.full((chunks * nbytes + 64,), POISON, dtype=torch.uint8, device=cuda_device)
    for offset, first in ((0, 0), (8, 2)):
        ids = torch.randperm(layout.num_blocks, generator=g)[: chunks * per_chunk]
        ids = ids.view(chunks, per_chunk)
        rows = torch.randint(0, 256, (chunks - first, nbytes), dtype=torch.uint8, generator=g)
        staging = flat[offset : offset + rows.numel()]
        staging.copy_(rows.view(-1).to(cuda_device))
        torch.cuda.synchronize(cuda_device)
        moves = PreparedTransfer(layout.layer_layout(0), ids, direction="scatter", stream=stream)
        kernels.launch(moves, staging, first, chunks - first)
        stream.synchronize()
        transfer_reference(
            want_layout.span_layout(0, count), rows.to(cuda_device), ids[first:],
            torch.zeros(chunks - first, dtype=torch.long), gather=False,
        )  # fmt: skip
        for a, b in zip(flat_tensors(caches), flat_tensors(want), strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), offset


def test_a_new_plan_does_not_wait_for_the_work_queued_on_the_current_stream(
    cuda_device: torch.device,
) -> None:
    """The first launch through a layout uploads its plan without waiting for the kernels
    queued on torch's current stream (an engine's forward pass, while its ring scatters
    a span of layers for the first time)."""
    seed = next(_seeds)
    _, layout = _caches(KVFormat.VLLM_FLASH_ATTN, seed, cuda_device, num_blocks=64)
    stream = new_transfer_stream(layout.device)
    chunks, per_chunk = 2, 3
    ids = torch.randperm(layout.num_blocks)[: chunks * per_chunk].view(chunks, per_chunk)
    moves = PreparedTransfer(layout.layer_layout(0), ids, direction="scatter", stream=stream)
    warm = LayoutKernels(layout.layer_layout(0), per_chunk * layout.block_size, gather=False)
    staging = torch.zeros(chunks * warm.chunk_nbytes, dtype=torch.uint8, device=cuda_device)
    warm.launch(moves, staging, 0, chunks)  # the kernel module loaded, its plan cached
    torch.cuda.synchronize(cuda_device)
    fresh = LayoutKernels(layout.layer_layout(1), per_chunk * layout.block_size, gather=False)
    with torch.cuda.device(cuda_device):
        torch.cuda._sleep(2_000_000_000)  # about a second of the GPU on the current stream
        busy = torch.cuda.Event()
        busy.record()
    fresh.launch(moves, staging, 0, chunks)
    assert not busy.query(), "the plan's upload waited for the current stream's kernels"
    stream.synchronize()
    torch.cuda.synchronize(cuda_device)


def test_a_transfer_for_another_layer_reuses_its_uploaded_ids(cuda_device: torch.device) -> None:
    """Ids uploaded with layer 0's transfer gather the last layer through `for_layout`
    exactly as the reference does (the layerwise paths upload once per request)."""
    seed = next(_seeds)
    _, layout = _caches(KVFormat.VLLM_FLASH_ATTN, seed, cuda_device, num_blocks=64)
    stream = new_transfer_stream(layout.device)
    chunks, per_chunk = 5, 3
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(layout.num_blocks, generator=g)[: chunks * per_chunk].view(
        chunks, per_chunk
    )
    last = layout.layer_layout(layout.num_layers - 1)
    nbytes = last.chunk_nbytes(per_chunk * layout.block_size)
    got = torch.full((chunks, nbytes), POISON, dtype=torch.uint8, device=cuda_device)
    want = got.clone()
    torch.cuda.synchronize(cuda_device)
    first = PreparedTransfer(layout.layer_layout(0), ids, direction="gather", stream=stream)
    first.for_layout(last).launch(got)
    transfer_reference(last, want, ids, torch.zeros(chunks, dtype=torch.long), gather=True)
    stream.synchronize()
    assert torch.equal(got, want)
