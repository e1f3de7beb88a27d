"""IdBuffer: block ids go up through one reusable pinned buffer, in pieces, until reset.

The device checks need CUDA and pycuda; the argument check runs anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.cuda.context import pycuda_context
from kvflow.kernels import IdBuffer, KVLayout, PreparedTransfer, cuda_available, new_transfer_stream
from kvflow.kernels.synthetic import make_kv_caches


def _read(address: int, n: int, device: torch.device) -> list[int]:
    """n int32 from an address on `device` (a driver copy in that device's context)."""
    import pycuda.driver as drv

    out = np.empty(n, dtype=np.int32)
    with pycuda_context(device.index or 0):
        drv.memcpy_dtoh(out, address)
    return out.tolist()


def test_an_id_buffer_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="indexed CUDA device"):
        IdBuffer(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_uploads_land_end_to_end_and_survive_growth_until_reset(cuda_device: torch.device) -> None:
    """Parts of any integer dtype become int32; a request too big for the buffer gets a
    larger one while earlier uploads stay readable; reset starts over at its beginning."""
    stream = new_transfer_stream(cuda_device)
    buf = IdBuffer(cuda_device, slots=8)
    a = buf.upload((np.array([[1, 2], [3, 4]], dtype=np.int64), np.array([7])), stream)
    b = buf.upload((np.arange(20, dtype=np.int32),), stream)  # does not fit: grows
    stream.synchronize()
    assert _read(a, 5, cuda_device) == [1, 2, 3, 4, 7]
    assert _read(b, 20, cuda_device) == list(range(20))
    buf.reset()
    c = buf.upload((np.array([9, 8], dtype=np.int32),), stream)
    stream.synchronize()
    assert c == b and _read(c, 2, cuda_device) == [9, 8]


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_transfers_through_one_buffer_match_fresh_uploads(cuda_device: torch.device) -> None:
    """Two prepared gathers sharing a buffer move the same bytes as with their own uploads."""
    caches, kw = make_kv_caches("vllm_flash_attn", num_blocks=32, block_size=16, device=cuda_device,
                                generator=torch.Generator().manual_seed(5))  # fmt: skip
    layout = KVLayout.from_kv_caches(caches, **kw)
    stream = new_transfer_stream(cuda_device)
    buf = IdBuffer(layout.device)
    ids = np.random.default_rng(0).permutation(32)[:24].reshape(3, 8)
    nbytes = layout.chunk_nbytes(8 * 16)
    shared = torch.zeros((3, nbytes), dtype=torch.uint8, device=cuda_device)
    own = torch.zeros_like(shared)
    first = PreparedTransfer(layout, ids[:1], direction="gather", stream=stream, id_buffer=buf)
    rest = PreparedTransfer(layout, ids[1:], direction="gather", stream=stream, id_buffer=buf)
    first.launch(shared[:1])
    rest.launch(shared[1:])
    PreparedTransfer(layout, ids, direction="gather", stream=stream).launch(own)
    stream.synchronize()
    buf.reset()
    assert torch.equal(shared, own) and bool(own.any())
