"""GPU end-to-end: a real transformer continues from KV that went through `kvflow server`.

The CPU e2e scenario (scenario.py beside this script) with CUDA tensors: the tiny Llama and
its paged caches live on the GPU, the caches are shared with a `kvflow server`
subprocess by CUDA IPC, and the server moves blocks with the PyCUDA kernels.
For every layout x dtype x skip it checks bit-identical KV, exactly equal logits
and a full recompute, and times the store and retrieve calls. With two GPUs it adds
the tensor-parallel case (rows tp2-<layout>, tp_scenario.py beside this script): the
KV heads split over two ranks on cuda:0 and cuda:1, stored by both through the one
server, retrieved by a fresh pair and merged. Prints a table; exits 1 if any case
failed. Run from the repository root:
    python -m tests.e2e.gpu_e2e [--repeat 20] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from kvflow.core import KVFlowClient
from kvflow.kernels import cuda_available
from tests.e2e import paged_kv
from tests.e2e.scenario import (
    BLOCK_SIZE,
    CHUNK_SIZE,
    NUM_BLOCKS,
    EngineWorker,
    Requests,
    make_requests,
    run_reuse,
)
from tests.e2e.server_proc import running_server
from tests.e2e.tiny_llama import build_model
from tests.e2e.tp_scenario import open_ranks, retrieve_merged, store_split, tp_model_name
from tests.support.gpus import make_context_current

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SKIPS = (0, 3)
#: Ranks of the tensor-parallel case (the tiny Llama's 2 KV heads: one per rank).
TP_WORLD = 2


def _median_retrieve_ms(
    workers: Sequence[EngineWorker], tokens: torch.Tensor, repeat: int
) -> float:
    """Median wall time of `repeat` more retrieves of the stored prefix into fresh tables
    (by every worker, one after the other: the ranks of a tensor-parallel world) until
    their copies landed (a CUDA retrieve returns once they are queued, with the current
    stream of the worker's device waiting on them)."""
    gen = torch.Generator().manual_seed(99)
    times = []
    for i in range(repeat):
        table = paged_kv.random_block_table(NUM_BLOCKS, len(tokens), BLOCK_SIZE, gen)
        started = time.perf_counter()
        for worker in workers:
            worker.client.retrieve(worker.instance_id, tokens, table, request_id=f"timing-{i}")
        for worker in workers:
            if worker.device.type == "cuda":
                torch.cuda.current_stream(worker.device).synchronize()
        times.append(time.perf_counter() - started)
        workers[0].client.end_session(f"timing-{i}")
    return 1e3 * statistics.median(times)


def tp_devices(device: torch.device) -> tuple[list[torch.device], str | None]:
    """The devices of the tensor-parallel ranks (rank r on cuda:r; both in shared memory
    with --device cpu), or none and why the case is skipped."""
    if device.type == "cpu":
        return [device] * TP_WORLD, None
    found = torch.cuda.device_count()
    if found < TP_WORLD:
        return [], f"tensor-parallel case skipped: needs two GPUs, found {found}"
    return [torch.device("cuda", rank) for rank in range(TP_WORLD)], None


def _tp_row(
    endpoint: str,
    layout: str,
    dtype_name: str,
    devices: Sequence[torch.device],
    model: LlamaForCausalLM,
    requests: Requests,
    repeat: int,
) -> dict[str, object]:
    """One tensor-parallel case: store by one world of ranks, retrieve by a fresh one.

    On CUDA, rank 0's context is made current on purpose: kvflow must not assume that
    the current context is rank 1's when it works for rank 1.
    """
    if devices[0].type == "cuda":
        make_context_current(devices[0].index or 0)
    dtype = DTYPES[dtype_name]
    model_name = tp_model_name(layout, dtype, len(devices))
    with open_ranks(endpoint, layout, dtype, devices, model_name) as writers:
        stored = store_split(writers, model, requests, seed=21)
    with open_ranks(endpoint, layout, dtype, devices, model_name) as readers:
        result = retrieve_merged(readers, model, requests, stored, seed=21)
        retrieve_ms = _median_retrieve_ms(readers, requests.second, repeat)
        instances = readers[0].client.status()["instances"]
        server_devices = [instances[r.instance_id]["device"] for r in readers]
    return {
        "server_device": ",".join(server_devices),
        "kv_format": instances[readers[0].instance_id]["kv_format"],
        "recompute_error": result.recompute_error,
        "store_ms": 1e3 * result.store_s,
        "retrieve_ms": 1e3 * result.retrieve_s,
        "retrieve_median_ms": retrieve_ms,
        "chunk_bytes": result.chunk_bytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20, help="extra retrieves timed per case")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu runs the same cases through shared memory (to check the script without a GPU)",
    )
    args = parser.parse_args()
    if args.device == "cpu":
        device = torch.device("cpu")
    elif cuda_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("gpu_e2e: needs a CUDA GPU and pycuda (kvflow.kernels.cuda_available() is False)")
        return 1
    # fp32 matmuls in full precision (no TF32), so a recompute is comparable at 1e-5.
    torch.set_float32_matmul_precision("highest")
    ranks_on, tp_skipped = tp_devices(device)
    if tp_skipped:
        print(tp_skipped)
    requests = make_requests()
    models = {name: build_model(dtype, device=device) for name, dtype in DTYPES.items()}
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with (
            running_server(CHUNK_SIZE, log_path) as endpoint,
            KVFlowClient(endpoint, timeout_s=60.0) as client,
        ):
            for layout in paged_kv.LAYOUTS:
                for dtype_name, dtype in DTYPES.items():
                    for skip in SKIPS:
                        row: dict[str, object] = {
                            "layout": layout,
                            "dtype": dtype_name,
                            "skip": skip,
                        }
                        try:
                            with EngineWorker(client, layout, dtype, device) as worker:
                                desc = client.status()["instances"][worker.instance_id]
                                result = run_reuse(
                                    worker,
                                    models[dtype_name],
                                    requests,
                                    seed=11 + skip,
                                    skip_blocks=skip,
                                )
                                retrieve_ms = _median_retrieve_ms(
                                    [worker], requests.second, args.repeat
                                )
                            row.update(
                                ok=True,
                                server_device=desc["device"],
                                kv_format=desc["kv_format"],
                                recompute_error=result.recompute_error,
                                store_ms=1e3 * result.store_s,
                                retrieve_ms=1e3 * result.retrieve_s,
                                retrieve_median_ms=retrieve_ms,
                                chunk_bytes=result.chunk_bytes,
                            )
                        except Exception as exc:  # report every case, then fail at the end
                            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                            traceback.print_exc()
                        rows.append(row)
            for layout in paged_kv.LAYOUTS if ranks_on else ():
                for dtype_name in DTYPES:
                    row = {"layout": f"tp{TP_WORLD}-{layout}", "dtype": dtype_name, "skip": 0}
                    try:
                        row.update(
                            _tp_row(
                                endpoint,
                                layout,
                                dtype_name,
                                ranks_on,
                                models[dtype_name],
                                requests,
                                args.repeat,
                            ),
                            ok=True,
                        )
                    except Exception as exc:  # report every case, then fail at the end
                        row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                        traceback.print_exc()
                    rows.append(row)
        if not all(r["ok"] for r in rows):
            print("---- server log ----\n" + log_path.read_text()[-8000:])

    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    _print_table(rows, device, tp_skipped)
    return 0 if all(r["ok"] for r in rows) else 1


def _print_table(
    rows: list[dict[str, object]], device: torch.device, tp_skipped: str | None
) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (shared memory)"
    print(f"\nkvflow e2e on {name}, torch {torch.__version__}")
    print(f"chunk {CHUNK_SIZE} tokens, block {BLOCK_SIZE}; checks: KV bit-identical, logits ==")
    print("original-KV logits, |continuation - recompute| / max|recompute| <= 1e-5 fp32, 3e-2 bf16")
    head = f"{'layout':<20} {'dtype':<5} {'skip':>4} {'result':<6} {'server':<13} {'rel err':>9}"
    print(head + f" {'store ms':>9} {'retr ms':>8} {'retr p50':>9}")
    for r in rows:
        line = f"{r['layout']:<20} {r['dtype']:<5} {r['skip']:>4} "
        if r["ok"]:
            line += (
                f"{'PASS':<6} {r['server_device']:<13} {r['recompute_error']:>9.2e} "
                f"{r['store_ms']:>9.2f} {r['retrieve_ms']:>8.2f} {r['retrieve_median_ms']:>9.2f}"
            )
        else:
            line += f"FAIL   {r['error']}"
        print(line)
    passed = sum(bool(r["ok"]) for r in rows)
    print(f"{passed}/{len(rows)} cases passed")
    if tp_skipped:
        print(tp_skipped)


if __name__ == "__main__":
    sys.exit(main())
