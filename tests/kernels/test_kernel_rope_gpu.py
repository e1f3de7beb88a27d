"""The CUDA re-rotation kernel equals the CPU reference bit for bit (skipped without CUDA
+ pycuda).

Both read one float32 cos/sin table and round every float32 product and sum the same
way (the kernel's _rn intrinsics forbid FMA contraction), so the bytes must match; the
CPU reference itself is checked against exact rotations in test_kernel_rope.py. Every
format x dtype x pairing, HND and padded views, unaligned segments sharing a block,
several deltas, two ropes and a NoPE layer, a large launch, and both stream modes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.kernels import (
    KVFormat,
    KVLayout,
    LayerRopes,
    Llama3Scaling,
    Pairing,
    RerotateSegment,
    RopeParams,
    cuda_available,
    new_transfer_stream,
    rerotate,
)
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import flat_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]


def _segments(num_blocks: int, seed: int) -> list[RerotateSegment]:
    """Three segments over 16-token blocks: 70 tokens from offset 5, 40 block-aligned, and
    21 from offset 11 of the block where the first one ends; deltas of both signs."""
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [
        RerotateSegment(ids[0:5], 5, 70, 4093),
        RerotateSegment(ids[5:8], 0, 40, -117),
        RerotateSegment([ids[4], ids[8]], 11, 21, 250_001),
    ]


def _pair(
    fmt: KVFormat, ropes: LayerRopes, device: torch.device, seed: int, **kwargs: Any
) -> list[tuple[Any, KVLayout]]:
    """The same random caches on the CPU and on `device`, with finite rotary slices (NaN
    bits may differ between the two paths; every other byte stays random)."""
    out = []
    for where in ("cpu", device):
        gen = torch.Generator().manual_seed(seed)
        caches, kw = make_kv_caches(fmt, device=where, generator=gen, **kwargs)
        layout = KVLayout.from_kv_caches(caches, **kw)
        finite = torch.Generator().manual_seed(seed + 1)
        for layer in range(layout.num_layers):
            params = ropes.params(layer)
            if params is not None:
                k = layout.block_views[layer][0][
                    ..., params.offset : params.offset + params.rotary_dim
                ]
                k.copy_(torch.randn(k.shape, generator=finite).to(k.dtype))
        out.append((caches, layout))
    return out


def _same(gpu_caches: Any, cpu_caches: Any) -> None:
    for i, (g, c) in enumerate(
        zip(flat_tensors(gpu_caches), flat_tensors(cpu_caches), strict=True)
    ):
        assert torch.equal(g.cpu().view(torch.uint8), c.view(torch.uint8)), f"tensor {i} differs"


def _check(
    fmt: KVFormat, ropes: LayerRopes, device: torch.device, seed: int = 0, **kwargs: Any
) -> None:
    kwargs = {"num_blocks": 16, "block_size": 16, **kwargs}
    (cpu, cpu_layout), (gpu, gpu_layout) = _pair(fmt, ropes, device, seed, **kwargs)
    segments = _segments(kwargs["num_blocks"], seed)
    rerotate(gpu_layout, ropes, segments, backend="cuda")
    rerotate(cpu_layout, ropes, segments, backend="cpu")
    torch.cuda.synchronize(device)
    _same(gpu, cpu)


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("pairing", list(Pairing), ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_kernel_equals_reference(
    fmt: KVFormat,
    dtype: torch.dtype,
    pairing: Pairing,
    noncontiguous: bool,
    cuda_device: torch.device,
) -> None:
    """Every format, dtype and pairing: MHA partial rotary (32 of 64), MLA the rope slice
    [64, 80) of an 80-wide latent row."""
    if fmt.is_mla:
        params, head = RopeParams(16, offset=64, pairing=pairing), 80
    else:
        params, head = RopeParams(32, theta=1e6, pairing=pairing), 64
    ropes = LayerRopes.uniform(params, 2)
    _check(fmt, ropes, cuda_device, dtype=dtype, head_size=head, noncontiguous=noncontiguous)


def test_layer_groups_with_their_own_ropes(cuda_device: torch.device) -> None:
    """Two ropes on two layer groups (one launch per layer, each with its own table) and
    a NoPE layer left alone."""
    llama3 = RopeParams(64, theta=500000.0, scaling=Llama3Scaling(8.0, 1.0, 4.0, 8192))
    gptj = RopeParams(8, pairing=Pairing.GPTJ)
    specs = [(4, 64, torch.bfloat16), (4, 64, torch.bfloat16), (2, 16, torch.float32)]
    ropes = LayerRopes((((0,), llama3), ((1,), None), ((2,), gptj)))
    _check(KVFormat.VLLM_FLASHINFER, ropes, cuda_device, layer_specs=specs)


def test_large_launch(cuda_device: torch.device) -> None:
    """Many CTAs: 131 tokens x 8 heads x 64 pairs per layer over 4 layers."""
    ropes = LayerRopes.uniform(RopeParams(128, theta=500000.0), 4)
    _check(
        KVFormat.VLLM_FLASH_ATTN, ropes, cuda_device,
        num_layers=4, num_heads=8, head_size=128, num_blocks=64,
    )  # fmt: skip


def test_on_a_given_stream(cuda_device: torch.device) -> None:
    """With a stream the launches are asynchronous on it: after its synchronize the
    bytes equal the reference's."""
    ropes = LayerRopes.uniform(RopeParams(16), 2)
    (cpu, cpu_layout), (gpu, gpu_layout) = _pair(
        KVFormat.SGLANG_MHA, ropes, cuda_device, 7, num_blocks=16, block_size=16, head_size=16
    )
    segments = _segments(16, 7)
    stream = new_transfer_stream(cuda_device)
    stream.torch.wait_stream(torch.cuda.current_stream(cuda_device))
    rerotate(gpu_layout, ropes, segments, stream=stream)
    rerotate(cpu_layout, ropes, segments)
    stream.synchronize()
    _same(gpu, cpu)


def test_default_stream_is_ordered_with_torch(cuda_device: torch.device) -> None:
    """stream=None: the kernel runs after torch's queued writes and before its later reads."""
    ropes = LayerRopes.uniform(RopeParams(16), 2)
    (cpu, cpu_layout), (gpu, gpu_layout) = _pair(
        KVFormat.VLLM_FLASH_ATTN, ropes, cuda_device, 9, num_blocks=16, block_size=16,
        head_size=16,
    )  # fmt: skip
    segments = _segments(16, 9)
    held = [t.clone() for t in gpu]
    for t in gpu:
        t.zero_()
    with torch.cuda.device(cuda_device):
        torch.cuda._sleep(50_000_000)  # a long torch op ahead of the writes
    for t, h in zip(gpu, held, strict=True):  # queued writes the kernel must wait for
        t.copy_(h)
    rerotate(gpu_layout, ropes, segments)
    snapshot = [t.clone() for t in gpu]  # a torch read the kernel must precede
    rerotate(cpu_layout, ropes, segments)
    torch.cuda.synchronize(cuda_device)
    _same(snapshot, cpu)
