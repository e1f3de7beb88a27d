"""The CUDA mover's two-phase store: the first group is gathered at `begin_store`, and
any subset of rows (one run at an offset, or scattered) still lands bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.core import transfer
from kvflow.core.transfer import CpuMover, CudaMover
from kvflow.kernels import KVLayout, cuda_available
from kvflow.kernels.testing import make_kv_caches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]

CHUNKS, PER_CHUNK, BLOCK, NUM_BLOCKS = 7, 2, 16, 32


def _caches(device: str) -> tuple[KVLayout, int]:
    kv, kw = make_kv_caches("vllm_flashinfer", num_blocks=NUM_BLOCKS, block_size=BLOCK,
                            num_layers=3, noncontiguous=True, device=device,
                            generator=torch.Generator().manual_seed(9))  # fmt: skip
    layout = KVLayout.from_kv_caches(kv, **kw)
    return layout, layout.chunk_nbytes(PER_CHUNK * BLOCK)


def _stored(mover: CpuMover | CudaMover, table: np.ndarray, rows: list[int], nbytes: int
            ) -> list[bytes]:  # fmt: skip
    dsts = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True) for _ in rows]
    mover.begin_store(table)
    mover.store(rows, dsts)
    mover.wait()
    return [d.numpy().tobytes() for d in dsts]


@pytest.mark.parametrize("rows", [list(range(CHUNKS)), [0, 1], [0, 2, 3, 6], [3, 4, 5, 6], []])
def test_cuda_store_matches_the_cpu_mover_for_any_rows(
    rows: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transfer, "MAX_GROUP", 2)  # 4 groups over a ring of 4 stages
    table = np.random.default_rng(2).permutation(NUM_BLOCKS)[: CHUNKS * PER_CHUNK]
    table = table.astype(np.int32).reshape(CHUNKS, PER_CHUNK)
    cpu_layout, nbytes = _caches("cpu")
    gpu_layout, _ = _caches("cuda")
    expected = _stored(CpuMover(cpu_layout), table, list(range(CHUNKS)), nbytes)
    mover = CudaMover(gpu_layout, nbytes)
    assert mover.group == 2
    assert _stored(mover, table, rows, nbytes) == [expected[r] for r in rows]
    # the next store reuses stage 0: nothing of the previous request leaks into it
    assert _stored(mover, table[::-1].copy(), [0], nbytes) == [expected[CHUNKS - 1]]
    mover.close()
