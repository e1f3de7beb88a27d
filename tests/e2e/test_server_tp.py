"""A tensor-parallel engine's KV, split by heads over two ranks, reused through one server.

Each rank is its own instance (world_size=2, rank r) with its own client; the steps and
checks are in `tests.e2e.tp_scenario`, which the GPU script runs too. CPU ranks share
host memory; the CUDA variant puts rank r on cuda:r and needs two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import cuda_available
from tests.e2e import paged_kv
from tests.e2e.scenario import RECOMPUTE_RTOL, Requests
from tests.e2e.tiny_llama import ModelFor
from tests.e2e.tp_scenario import open_ranks, retrieve_merged, store_split, tp_model_name
from tests.support.gpus import make_context_current, require_gpus

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WORLD_SIZE = 2
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.gpu2,
            pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
        ],
    ),
]


def _rank_devices(device: str) -> list[torch.device]:
    """Rank r's device: cuda:r (with cuda:0's context current on the test thread, so
    nothing kvflow does for rank 1 may assume the current context is rank 1's), or host
    memory for every rank."""
    if device == "cpu":
        return [torch.device("cpu")] * WORLD_SIZE
    require_gpus(WORLD_SIZE)
    make_context_current(0)
    return [torch.device("cuda", rank) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("server", ["one process", "sharded"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("layout", paged_kv.LAYOUTS)
def test_a_fresh_pair_of_ranks_continues_from_the_heads_both_ranks_stored(
    layout: str,
    dtype_name: str,
    device: str,
    server: str,
    request: pytest.FixtureRequest,
    model_for: ModelFor,
    requests: Requests,
) -> None:
    """The prefix is a hit only once both ranks stored their heads; a new pair of ranks
    (new instances, caches and block table) retrieves it, and the merged heads are the
    prefill's bit for bit: the continuation equals the original KV's exactly. Sharded:
    through `--shards 2`, each rank on a shard process of its own behind one endpoint."""
    fixture = "kvflow_server" if server == "one process" else "kvflow_sharded_server"
    kvflow_server: str = request.getfixturevalue(fixture)
    dtype = DTYPES[dtype_name]
    devices = _rank_devices(device)
    model = model_for(dtype, "cpu" if device == "cpu" else "cuda:0")
    model_name = tp_model_name(layout, dtype, WORLD_SIZE)
    with open_ranks(kvflow_server, layout, dtype, devices, model_name) as writers:
        stored = store_split(writers, model, requests, seed=31)
    with open_ranks(kvflow_server, layout, dtype, devices, model_name) as readers:
        result = retrieve_merged(readers, model, requests, stored, seed=31)
    assert result.recompute_error <= RECOMPUTE_RTOL[dtype]
