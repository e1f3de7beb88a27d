"""KVFlowConnector's per-step stats through vLLM's own paths, in-process, on CPU.

The test's child process, for the official vLLM release (its wheel imports on CPU
with VLLM_TARGET_DEVICE=cpu, but runs no model without a GPU):

    python tests/integrations/vllm/vllm_stats_run.py MODEL_DIR ENDPOINT OUT_JSON

vLLM's real `Scheduler` (with its connector, the scheduler side) and a worker-side
KVFlowConnector registered on CPU caches; each step calls the worker's hooks in the
order vLLM's model runner does (kv_connector_model_runner_mixin: bind the metadata,
start_load_kv, wait_for_save, get_block_ids_with_load_errors, get_kv_connector_stats),
with no model run, and hands the worker's stats to `update_from_output`, which adds the
scheduler's and puts the step's payload in `SchedulerStats.kv_connector_stats`. Phases:

1. `a`: a prompt of two chunks, nothing stored: a miss, its chunks stored;
2. `b` (a's chunks and another suffix, a hit: loaded) and `c` (two new chunks: stored),
   two generated tokens each, so a decode step follows;
3. `d` (a's chunks again, a hit): the server's objects are cleared after the plan is
   made and before the worker loads, so the load fails and vLLM recomputes (and the
   chunks are stored again).

Each step's payload goes to OUT_JSON with the request ids it scheduled first, as do
the line vLLM's KV-transfer logger prints for every step's payload together and what
vLLM's worker-output aggregator makes of two ranks' stats.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tests.integrations.vllm.vllm_run import exit_now

BLOCK = 16
CHUNK = 32
NUM_BLOCKS = 64
LAYERS, HEADS, HEAD = 2, 1, 64


def main() -> None:
    model_dir, endpoint, out_path = sys.argv[1:]
    import torch
    import vllm
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from kvflow.core import KVFlowClient
    from kvflow.core.server.protocol import AdminClear
    from kvflow.integrations.vllm.connector import (
        KVFlowConnector,
        KVFlowConnectorStats,
        default_model_name,
    )
    from kvflow.integrations.vllm.shared_kv import SharedZeros

    seen: dict[str, Any] = {"vllm_version": vllm.__version__, "steps": []}
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=512,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVFlowConnector",
            kv_connector_module_path="kvflow.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"kvflow.endpoint": endpoint},
        ),
    )
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS

    # the worker: its connector, and CPU caches as vLLM's CPU worker allocates them (one
    # int8 buffer in shared memory, a [blocks, heads, block, 2 * head] view per layer)
    worker = KVFlowConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    per_layer = NUM_BLOCKS * HEADS * BLOCK * 2 * HEAD
    with SharedZeros():
        buf = torch.zeros(LAYERS * per_layer * 4, dtype=torch.int8)
    floats = buf.view(torch.float32)
    worker.register_kv_caches(
        {
            name: floats[i * per_layer : (i + 1) * per_layer].view(
                NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD
            )
            for i, name in enumerate(layers)
        }
    )
    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )
    seen["is_kvflow"] = isinstance(scheduler.connector, KVFlowConnector)
    model_name = default_model_name(vllm_config)
    admin = KVFlowClient(endpoint, timeout_s=30)

    def step(phase: str, clear_before_load: bool = False) -> dict[str, Any]:
        """One engine step: schedule, the worker's hooks, update_from_output."""
        out = scheduler.schedule()
        plan = out.kv_connector_metadata.plan
        if clear_before_load and plan.loads:  # the objects vanish before the worker loads
            admin.admin(AdminClear(model_name=model_name))
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.wait_for_save()
        invalid = worker.get_block_ids_with_load_errors()
        worker_stats = worker.get_kv_connector_stats()
        # vLLM adds the scheduler's stats into the worker's object: copy what it was
        worker_data = None if worker_stats is None else dict(worker_stats.data)
        worker.clear_connector_metadata()
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        outputs = scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[7] for _ in ids],
                kv_connector_output=KVConnectorOutput(
                    invalid_block_ids=invalid, kv_connector_stats=worker_stats
                ),
            ),
        )
        stats = next((o.scheduler_stats for o in outputs.values() if o.scheduler_stats), None)
        record = {
            "phase": phase,
            "new": [r.req_id for r in out.scheduled_new_reqs],
            "scheduled": ids,
            "worker_stats_type": type(worker_stats).__name__,
            "worker": worker_data,
            "stats": None if stats is None else stats.kv_connector_stats,
            "invalid": sorted(invalid),
        }
        seen["steps"].append(record)
        return record

    def run(phase: str, requests: list[Request], clear_before_load: bool = False) -> None:
        for req in requests:
            scheduler.add_request(req)
        deadline = time.monotonic() + 30
        while any(not r.is_finished() for r in requests):
            assert time.monotonic() < deadline, f"phase {phase} never finished"
            step(phase, clear_before_load)
            time.sleep(0.01)  # the lookups answer on the connector's threads
        step(f"{phase}-idle")  # nothing scheduled: nothing to report

    def request(req_id: str, tokens: list[int], max_tokens: int) -> Request:
        return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0), None)

    shared = list(range(1, 2 * CHUNK + 1))  # two chunks
    run("1", [request("a", [*shared, *range(400, 408)], 1)])
    run(
        "2",
        [
            request("b", [*shared, *range(410, 418)], 2),
            request("c", [*range(100, 100 + 2 * CHUNK), *range(420, 428)], 2),
        ],
    )
    run("3", [request("d", [*shared, *range(430, 438)], 1)], clear_before_load=True)

    # vLLM's KV-transfer logger over every step's payload
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    for record in seen["steps"]:
        if record["stats"] is not None:
            logging.observe(record["stats"])
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    seen["logged"] = lines
    # two ranks' worker stats of the step that loaded b, through vLLM's aggregator
    loaded = next(r for r in seen["steps"] if "b" in r["new"])
    ranks = [
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            kv_connector_output=KVConnectorOutput(
                kv_connector_stats=KVFlowConnector.build_kv_connector_stats(loaded["worker"])
            ),
        )
        for _ in range(2)
    ]
    together = KVOutputAggregator(expected_finished_count=2).aggregate(ranks)
    assert together is not None and together.kv_connector_output is not None
    summed = together.kv_connector_output.kv_connector_stats
    seen["two_ranks_type"] = type(summed).__name__
    seen["two_ranks"] = summed.reduce() if isinstance(summed, KVFlowConnectorStats) else None

    admin.close()
    worker.shutdown()
    scheduler.connector.shutdown()
    with open(out_path, "w") as f:
        json.dump(seen, f)
    exit_now()


if __name__ == "__main__":
    main()
