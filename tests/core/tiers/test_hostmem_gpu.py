"""L1 host memory on a CUDA machine: segments are page-locked outside torch's pinned
allocator, so async copies use them directly, and release unpins them."""

from __future__ import annotations

import pytest
import torch

from kvflow.core.tiers.hostmem import HostPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_segments_are_pinned_and_copy_asynchronously_both_ways(cuda_device: torch.device) -> None:
    pool = HostPool()
    assert pool.pinned
    view = pool.view(pool.add_segment(1 << 24), 4096, 1 << 20)
    assert view.is_pinned()
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=cuda_device)
    stream = torch.cuda.Stream(cuda_device)  # pinned for every GPU: the pool is portable
    with torch.cuda.stream(stream):
        view.copy_(src, non_blocking=True)
        back = torch.empty_like(src)
        back.copy_(view, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, src) and torch.equal(view, src.cpu())
    pool.release()
    assert not view.is_pinned()  # the held view keeps its bytes, unpinned
    assert torch.equal(view, src.cpu())


def test_a_pool_dropped_without_release_unpins_its_segments() -> None:
    pool = HostPool()
    view = pool.view(pool.add_segment(1 << 20), 0, 4096)
    assert view.is_pinned()
    del pool
    assert not view.is_pinned()
