"""GPU KV sharing through CUDA IPC: a client process and a `kvflow server` process.

This process plays the engine: it allocates paged KV caches on the GPU (three
layouts, including layers carved out of one allocation so offsets matter),
registers them with a server subprocess through CUDA IPC handles, writes KV with
a deliberately slow kernel and stores without synchronizing (the server must
wait on the interprocess event), retrieves into other blocks and checks every
byte on the current stream without synchronizing (the retrieve orders that work after
the server's copies). Then it times store/retrieve/lookup. Prints a table; exits 1 on any
failure. `--device cpu` runs the same flow over shared memory (no GPU needed).
    python benchmarks/gpu_ipc_roundtrip.py [--device cuda|cpu] [--repeat 10]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvflow.core import KVFlowClient, empty_shared

NL, NB, BS, NH, HS = 8, 512, 16, 8, 128
CHUNK = 256


def start_server() -> tuple[subprocess.Popen[str], str, list[str]]:
    cmd = [sys.executable, "-m", "kvflow.cli", "server", "--port", "0", "--prometheus-port", "0"]
    cmd += ["--l1-size-gb", "2", "--log-format", "console", "--disable-observability"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    match = None
    while match is None and len(lines) < 50:  # start-up lines (L1 pinning) come first
        lines.append(proc.stderr.readline())
        match = re.search(r"listening on (tcp://\S+)", lines[-1])
        if not lines[-1]:
            break
    if not match:
        proc.kill()
        raise SystemExit("server did not start:\n" + "".join(lines) + proc.stderr.read())
    threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True).start()
    return proc, match.group(1), lines


def alloc(device: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if device == "cpu":
        return empty_shared((numel,), dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def layouts(device: str) -> dict[str, tuple[Any, Callable[[Any], list[torch.Tensor]]]]:
    """name -> (kv_caches, function giving each tensor's block-major views [NB, ...])."""
    per_layer = 2 * NB * BS * NH * HS
    one = alloc(device, NL * per_layer, torch.bfloat16)  # every layer carved from one allocation
    flash = [one[i * per_layer : (i + 1) * per_layer].view(2, NB, BS, NH, HS) for i in range(NL)]
    k = [alloc(device, NB * BS * NH * HS, torch.float16).view(NB * BS, NH, HS) for _ in range(NL)]
    v = [alloc(device, NB * BS * NH * HS, torch.float16).view(NB * BS, NH, HS) for _ in range(NL)]
    cross = alloc(device, NB * NL * 2 * BS * NH * HS, torch.bfloat16).view(NB, NL, 2, BS, NH, HS)
    return {
        "vllm_flash_attn (one alloc)": (flash, lambda kv: [t.transpose(0, 1) for t in kv]),
        "sglang_mha": ((k, v), lambda kv: [t.view(NB, BS, NH, HS) for t in kv[0] + kv[1]]),
        "vllm_cross_layer": (cross, lambda kv: [kv]),
    }


def check_layout(
    client: KVFlowClient,
    name: str,
    kv: Any,
    blocks_of: Callable[[Any], list[torch.Tensor]],
    device: str,
    repeat: int,
) -> dict[str, Any]:
    """Round trip with an unsynchronized slow write before the store; returns the row."""
    iid = f"ipc-{name.split()[0]}"
    client.register_kv_caches(iid, kv, model_name=iid, block_size=BS)
    views = blocks_of(kv)
    for t in views:
        t.zero_()
    n_tokens = 32 * CHUNK  # 512 blocks: blocks 0..255 in, 256..511 out
    n_blk = n_tokens // BS // 2
    n_tokens //= 2
    src = torch.arange(n_blk)
    dst = torch.arange(n_blk, 2 * n_blk)
    tokens = torch.randint(0, 32000, (n_tokens,), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator(device=device).manual_seed(7)
    if device != "cpu":
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the writes
    for t in views:  # the "engine" writes its KV on the current stream, asynchronously
        t[src] = torch.randn(t[src].shape, generator=gen, device=device).to(t.dtype)
    stored = client.store(iid, tokens, src, request_id="w")  # no synchronize: the event orders it
    got = client.retrieve(iid, tokens, dst, request_id="r")
    # no synchronize: the comparison, queued on the current stream, is ordered after the
    # server's copies by the retrieve (the server replied as soon as they were queued)
    exact = all(torch.equal(t[dst], t[src]) for t in views)
    nonzero = all(bool(t[src].abs().sum() > 0) for t in views)
    nbytes = sum(t[src].numel() * t.element_size() for t in views)

    def landed(hit: int) -> int:
        """The retrieve's hit, once its copies landed (a CUDA retrieve returns when queued)."""
        if device != "cpu":
            torch.cuda.current_stream().synchronize()
        return hit

    def timed(fn: Callable[[], int]) -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    fresh = [torch.randint(0, 32000, (n_tokens,)) for _ in range(repeat)]
    it = iter(fresh)
    t_store = timed(lambda: client.store(iid, next(it), src, request_id="t"))
    t_retr = timed(lambda: landed(client.retrieve(iid, tokens, dst, request_id="t")))
    t_look = timed(lambda: client.lookup(tokens, model_name=iid))
    client.unregister(iid)
    ok = stored == n_tokens and got == n_tokens and exact and nonzero
    return {
        "layout": name,
        "ok": ok,
        "detail": f"stored={stored} got={got} exact={exact} written={nonzero}",
        "MB": nbytes / 1e6,
        "store_ms": t_store * 1e3,
        "store_GBps": nbytes / t_store / 1e9,
        "retrieve_ms": t_retr * 1e3,
        "retrieve_GBps": nbytes / t_retr / 1e9,
        "lookup_us": t_look * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for the shared-memory flow)")
        return 1
    device = "cuda:0" if args.device == "cuda" else "cpu"
    proc, endpoint, log = start_server()
    rows = []
    try:
        with KVFlowClient(endpoint, timeout_s=120) as client:
            for name, (kv, blocks_of) in layouts(device).items():
                try:
                    rows.append(check_layout(client, name, kv, blocks_of, device, args.repeat))
                except Exception as exc:
                    rows.append({"layout": name, "ok": False, "detail": repr(exc)})
    finally:
        proc.terminate()
        code = proc.wait(60)
    print(f"device: {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}")
    print(f"{'layout':<28} {'ok':<5} {'MB':>7} {'store':>15} {'retrieve':>15} {'lookup':>9}")
    for r in rows:
        if "MB" in r:
            print(
                f"{r['layout']:<28} {r['ok']!s:<5} {r['MB']:>7.1f}"
                f" {r['store_ms']:>6.2f}ms {r['store_GBps']:>5.1f}GB/s"
                f" {r['retrieve_ms']:>6.2f}ms {r['retrieve_GBps']:>5.1f}GB/s {r['lookup_us']:>7.0f}us"
            )
        if not r["ok"]:
            print(f"  FAILED {r['layout']}: {r['detail']}")
    failed = [r for r in rows if not r["ok"]] or code != 0
    if code != 0:
        print(f"server exited with {code}:\n{''.join(log)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
