"""The CPU mover's two-phase store: any subset of the begun table's rows lands exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.core.transfer import CpuMover, rows_of
from kvflow.kernels import KVLayout
from kvflow.kernels.testing import make_kv_caches

CHUNKS, PER_CHUNK, BLOCK = 4, 2, 4


def _stored(mover: CpuMover, table: np.ndarray, rows: list[int], nbytes: int) -> list[bytes]:
    dsts = [torch.zeros(nbytes, dtype=torch.uint8) for _ in rows]
    mover.begin_store(table)
    mover.store(rows, dsts)
    return [d.numpy().tobytes() for d in dsts]


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0, 2, 3], [2, 3], [1], []])
def test_store_writes_exactly_the_chosen_rows(rows: list[int]) -> None:
    kv, kw = make_kv_caches("vllm_flash_attn", num_blocks=16, block_size=BLOCK,
                            generator=torch.Generator().manual_seed(5))  # fmt: skip
    layout = KVLayout.from_kv_caches(kv, **kw)
    nbytes = layout.chunk_nbytes(PER_CHUNK * BLOCK)
    table = np.random.default_rng(1).permutation(16)[: CHUNKS * PER_CHUNK]
    table = table.astype(np.int32).reshape(CHUNKS, PER_CHUNK)
    mover = CpuMover(layout)
    full = _stored(mover, table, list(range(CHUNKS)), nbytes)
    assert len(set(full)) == CHUNKS  # distinct chunks, so a wrong row would show
    assert _stored(mover, table, rows, nbytes) == [full[r] for r in rows]


def test_rows_of_is_a_view_for_one_run_and_a_copy_otherwise() -> None:
    table = np.arange(12, dtype=np.int32).reshape(6, 2)
    run = rows_of(table, [2, 3, 4])
    assert np.shares_memory(run, table) and run.tolist() == [[4, 5], [6, 7], [8, 9]]
    assert rows_of(table, [0, 2, 5]).tolist() == [[0, 1], [4, 5], [10, 11]]
