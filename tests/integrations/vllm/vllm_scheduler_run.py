"""Drive KVFlowConnector's scheduler side through vLLM's real `Scheduler`, in-process, on CPU.

The test's child process, for the official vLLM release (its wheel imports on CPU
with VLLM_TARGET_DEVICE=cpu, but runs no model without a GPU):

    python tests/integrations/vllm/vllm_scheduler_run.py MODEL_DIR ENDPOINT OUT_JSON

A kvflow client first stores a prompt's two chunks on the server, as a worker would.
Then a request for that prompt plus a suffix goes through the real scheduler, with
no model run: its first step must not schedule it (the lookup is in flight), a later
one schedules it with the two chunks computed and a synchronous load planned into
its first blocks; a worker's report that the second chunk's blocks failed to load
must make vLLM recompute from there (not fail the request); finishing it must
reach the connector. What was seen goes to OUT_JSON for the test to check.
"""

from __future__ import annotations

import json
import sys
import time

from tests.integrations.vllm.vllm_run import exit_now

BLOCK = 16
CHUNK = 32
NUM_BLOCKS = 64


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
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from kvflow.core import KVFlowClient, empty_shared
    from kvflow.integrations.vllm.connector import KVFlowConnector, default_model_name

    seen: dict = {"vllm_version": vllm.__version__}
    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True)
    vllm_config = VllmConfig(
        model_config=model_config,
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
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0", "layer.1"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS

    # a worker stores the prompt's two chunks first (KV in vllm_flash_attn layout)
    prompt = list(range(1, 2 * CHUNK + 1))
    request_tokens = [*prompt, 400, 401, 402, 403, 404, 405, 406, 407]
    model_name = default_model_name(vllm_config)
    with KVFlowClient(endpoint, timeout_s=30) as client:
        caches = [empty_shared((2, NUM_BLOCKS, BLOCK, 1, 64), torch.float32) for _ in range(2)]
        for cache in caches:
            cache.copy_(torch.randn_like(cache))
        client.register_kv_caches(
            "store-rank0",
            caches,
            model_name=model_name,
            block_size=BLOCK,
            kv_format="vllm_flash_attn",
        )
        seen["stored"] = client.store("store-rank0", prompt, [0, 1, 2, 3], request_id="warm")
        client.unregister("store-rank0")

    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=False,
    )
    connector = scheduler.connector
    seen["connector"] = type(connector).__name__
    seen["is_kvflow"] = isinstance(connector, KVFlowConnector)
    seen["recompute_policy"] = scheduler.recompute_kv_load_failures
    req = Request(
        "r1",
        request_tokens,
        SamplingParams(max_tokens=4, temperature=0.0),
        None,
    )
    scheduler.add_request(req)

    def empty_step(output: object) -> None:
        scheduler.update_from_output(output, ModelRunnerOutput(req_ids=[], req_id_to_index={}))

    out = scheduler.schedule()
    seen["first_step_scheduled"] = len(out.scheduled_new_reqs)
    empty_step(out)
    steps = 1
    deadline = time.monotonic() + 30
    while not out.scheduled_new_reqs and time.monotonic() < deadline:
        time.sleep(0.01)
        out = scheduler.schedule()
        steps += 1
        if not out.scheduled_new_reqs:
            empty_step(out)
    (new,) = out.scheduled_new_reqs
    blocks = list(new.block_ids[0])
    plan = out.kv_connector_metadata.plan
    seen.update(
        steps_until_scheduled=steps,
        num_computed_tokens=new.num_computed_tokens,
        num_scheduled_tokens=out.num_scheduled_tokens["r1"],
        has_sync_kv_loads=out.has_sync_kv_loads,
        loads=[
            {"tokens": len(x.token_ids), "blocks": x.block_ids, "skip": x.skip_tokens}
            for x in plan.loads
        ],
        stores=[len(x.token_ids) for x in plan.stores],
        allocations=[[r, len(b), len(t)] for r, b, t in plan.allocations],
        blocks=blocks,
    )

    # the worker reports the second chunk's blocks as not loaded
    failed = set(blocks[2:4])
    scheduler.update_from_output(
        out,
        ModelRunnerOutput(
            req_ids=["r1"],
            req_id_to_index={"r1": 0},
            sampled_token_ids=[[7]],
            kv_connector_output=KVConnectorOutput(invalid_block_ids=failed),
        ),
    )
    seen["after_failure"] = {
        "status": req.status.name,
        "num_computed_tokens": req.num_computed_tokens,
        "output_tokens": len(req.output_token_ids),
    }
    out = scheduler.schedule()
    seen["recompute_step_tokens"] = out.num_scheduled_tokens.get("r1")
    seen["recompute_step_stores"] = [
        len(x.token_ids) for x in out.kv_connector_metadata.plan.stores
    ]
    seen["tracked_before_finish"] = list(connector._scheduler.tracked())
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    seen["tracked_after_finish"] = list(connector._scheduler.tracked())
    connector.shutdown()
    with open(out_path, "w") as f:
        json.dump(seen, f)
    exit_now()


if __name__ == "__main__":
    main()
