"""KV stored through a running `kvflow server` continues a real transformer exactly.

The engine side (a tiny Llama and its paged KV caches: CPU shared memory, or CUDA
memory shared by IPC on a GPU machine) talks to a `kvflow server` subprocess
through KVFlowClient, as a vLLM worker would. The steps and their checks are in
`tests.e2e.scenario.run_reuse`, which the GPU script runs too.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.core import KVFlowClient
from kvflow.kernels import cuda_available
from tests.e2e import paged_kv
from tests.e2e.scenario import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    RECOMPUTE_RTOL,
    EngineWorker,
    Requests,
    run_reuse,
)
from tests.e2e.tiny_llama import ModelFor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("layout", paged_kv.LAYOUTS)
def test_second_request_continues_from_kv_retrieved_into_other_blocks(
    layout: str,
    dtype_name: str,
    device: str,
    kvflow_client: KVFlowClient,
    model_for: ModelFor,
    requests: Requests,
) -> None:
    """After a wipe, lookup reports the stored prefix and retrieve brings it back into other
    blocks bit-identical: the model's continuation equals the one from the original KV
    exactly and a full recompute within tolerance; no other block is written."""
    dtype = DTYPES[dtype_name]
    with EngineWorker(kvflow_client, layout, dtype, torch.device(device)) as worker:
        result = run_reuse(worker, model_for(dtype, device), requests, seed=11)
    assert result.recompute_error <= RECOMPUTE_RTOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("layout", paged_kv.LAYOUTS)
def test_retrieve_leaves_the_skipped_first_blocks_untouched(
    layout: str,
    dtype_name: str,
    device: str,
    kvflow_client: KVFlowClient,
    model_for: ModelFor,
    requests: Requests,
) -> None:
    """skip_first_n_tokens of 3 blocks (chunk 0 and half of chunk 1): those blocks keep the
    engine's content, the rest of the prefix arrives, and the model continues exactly."""
    dtype = DTYPES[dtype_name]
    skip_blocks = 3
    assert skip_blocks * BLOCK_SIZE > CHUNK_SIZE  # a whole chunk and part of the next
    with EngineWorker(kvflow_client, layout, dtype, torch.device(device)) as worker:
        result = run_reuse(
            worker, model_for(dtype, device), requests, seed=12, skip_blocks=skip_blocks
        )
    assert result.recompute_error <= RECOMPUTE_RTOL[dtype]
