"""GPU: a CUDA mover's wait sleeps while its streams work, instead of spinning a core."""

from __future__ import annotations

import time

import pytest
import torch

from kvflow.core.engine.movers import CudaMover
from kvflow.kernels import KVLayout, cuda_available
from kvflow.kernels.synthetic import make_kv_caches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]


def test_a_wait_sleeps_until_the_streams_work_ran(cuda_device: torch.device) -> None:
    """~0.2 s of work on each of the mover's streams: `wait` returns only once both ran
    (it sees what they wrote), and its thread used a small part of that time on a CPU (a
    stream synchronize spins a core for all of it, beside the engine's forward pass)."""
    caches, kw = make_kv_caches(
        "vllm_flash_attn", num_layers=2, num_blocks=8, block_size=16, num_heads=2,
        head_size=64, device=cuda_device, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    layout = KVLayout.from_kv_caches(caches, **kw)
    mover = CudaMover(layout, layout.chunk_nbytes(16))
    marks = torch.zeros(2, dtype=torch.int32, device=cuda_device)
    torch.cuda.synchronize(cuda_device)
    for i, stream in enumerate((mover.copy_stream, mover.kernel_stream)):
        with torch.cuda.stream(stream.torch):
            torch.cuda._sleep(400_000_000)
            marks[i].fill_(i + 1)
    cpu, wall = time.process_time(), time.perf_counter()
    mover.wait()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert marks.tolist() == [1, 2]
    assert wall > 0.1 and cpu < 0.5 * wall, f"{cpu:.3f} s of CPU in a {wall:.3f} s wait"
