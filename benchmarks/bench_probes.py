"""Probe latency: /healthz and /readyz of a real `kvflow server`, timed with an HTTP client.

Starts `kvflow server --probe-port P` as a subprocess, waits until /readyz answers 200,
then times --requests GETs of each probe (alternating), each on a new TCP connection as
a kubelet or curl makes it: connect, request, whole response read. First with the server
idle, then while --busy-clients threads of this process store and retrieve through it
(shared-memory KV caches, prompts cycling through more bytes than L1 holds, so L1 also
evicts). Prints p50 / p99 / max in ms per probe and phase against the target of issue 42
(an answer in < 10 ms); --json writes every figure. Every answer must be 200 with the
probe's JSON body: anything else is reported and exits 1. Run:
    python benchmarks/bench_probes.py [--requests 500] [--busy-clients 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.core import KVFlowClient, empty_shared

PROBES = ("/healthz", "/readyz")
#: what a healthy, ready server answers (the loop age varies)
EXPECTED_STATUS = {"/healthz": "ok", "/readyz": "ready"}
TARGET_MS = 10.0
#: busy clients' caches: vllm_flash_attn layers [2, blocks, 16, 8, 64] bfloat16, 8 KiB a
#: token over 4 layers, so a 256-token chunk is 2 MiB and a 4-chunk prompt 8 MiB
LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 4, 128, 16, 8, 64
PROMPT_TOKENS = 4 * 256
PROMPTS_PER_CLIENT = 48  # 384 MiB of prompts per client: more than the default L1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(probe_port: int, l1_size_gb: float) -> tuple[subprocess.Popen[str], str]:
    """`kvflow server` with probes on `probe_port`; returns it and its endpoint."""
    cmd = [sys.executable, "-m", "kvflow.cli", "server", "--port", "0", "--prometheus-port", "0"]
    cmd += ["--log-format", "console", "--l1-size-gb", str(l1_size_gb)]
    cmd += ["--probe-port", str(probe_port)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    seen: list[str] = []
    for line in proc.stderr:
        seen.append(line)
        match = re.search(r"listening on (tcp://\S+)", line)
        if match:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining
            return proc, match.group(1)
    proc.wait(30)
    raise SystemExit("bench_probes: the server did not start:\n" + "".join(seen))


def get(port: int, path: str) -> tuple[float, int, dict[str, Any]]:
    """One probe on a fresh connection: (seconds, HTTP status, JSON body)."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    elapsed = time.perf_counter() - started
    return elapsed, response.status, json.loads(data)


def wait_ready(port: int, timeout_s: float = 120.0) -> None:
    """Poll /readyz until it answers 200."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            if get(port, "/readyz")[1] == 200:
                return
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        time.sleep(0.05)
    raise SystemExit(f"bench_probes: /readyz did not answer 200 within {timeout_s:g} s")


class BusyClient(threading.Thread):
    """Stores prompts (each 8 MiB of KV) and retrieves them into other blocks, in a loop."""

    def __init__(self, endpoint: str, n: int, stop: threading.Event) -> None:
        super().__init__(daemon=True, name=f"busy-{n}")
        self.endpoint, self.n, self.stop = endpoint, n, stop
        self.ops: Counter[str] = Counter()
        self.errors: list[str] = []
        self.started_work = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # reported by the main thread
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.started_work.set()

    def _run(self) -> None:
        kv = [empty_shared((2, BLOCKS, BLOCK, HEADS, HEAD), torch.bfloat16) for _ in range(LAYERS)]
        for layer in kv:
            layer.normal_()
        src = list(range(PROMPT_TOKENS // BLOCK))
        dst = list(range(BLOCKS - len(src), BLOCKS))
        rng = np.random.default_rng(self.n)
        prompts = [
            rng.integers(0, 32000, PROMPT_TOKENS, dtype=np.int32) for _ in range(PROMPTS_PER_CLIENT)
        ]
        iid = f"bench-probes-{self.n}"
        with KVFlowClient(self.endpoint, timeout_s=60) as client:
            client.register_kv_caches(iid, kv, model_name="bench-probes")
            i = 0
            while not self.stop.is_set():
                prompt = prompts[i % len(prompts)]
                client.store(iid, prompt, src, request_id=f"s{i}")
                self.ops["stores"] += 1
                self.started_work.set()
                client.retrieve(iid, prompt, dst, request_id=f"r{i}")
                self.ops["retrieves"] += 1
                client.end_session(f"s{i}")
                client.end_session(f"r{i}")
                i += 1
            client.unregister(iid)


def percentile_ms(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples) * 1e3, q))


def time_probes(port: int, requests: int, warmup: int) -> dict[str, dict[str, Any]]:
    """`requests` timed GETs of each probe, alternating, after `warmup` untimed ones each."""
    for _ in range(warmup):
        for path in PROBES:
            get(port, path)
    times: dict[str, list[float]] = {path: [] for path in PROBES}
    codes: dict[str, Counter[str]] = {path: Counter() for path in PROBES}
    wrong: dict[str, list[str]] = {path: [] for path in PROBES}
    for _ in range(requests):
        for path in PROBES:
            elapsed, status, body = get(port, path)
            times[path].append(elapsed)
            codes[path][str(status)] += 1
            if status != 200 or body.get("status") != EXPECTED_STATUS[path]:
                wrong[path].append(f"{status} {body}")
    return {
        path: {
            "requests": len(times[path]),
            "p50_ms": percentile_ms(times[path], 50),
            "p99_ms": percentile_ms(times[path], 99),
            "max_ms": max(times[path]) * 1e3,
            "codes": dict(codes[path]),
            "unexpected": wrong[path][:5],
        }
        for path in PROBES
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    started = time.monotonic()
    proc, endpoint = start_server(port, args.l1_size_gb)
    out: dict[str, Any] = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "requests": args.requests,
        "busy_clients": args.busy_clients,
        "l1_size_gb": args.l1_size_gb,
        "phases": {},
    }
    try:
        wait_ready(port)
        out["ready_after_s"] = time.monotonic() - started
        out["phases"]["idle"] = time_probes(port, args.requests, args.warmup)
        if args.busy_clients:
            stop = threading.Event()
            clients = [BusyClient(endpoint, n, stop) for n in range(args.busy_clients)]
            for client in clients:
                client.start()
            for client in clients:
                client.started_work.wait(120)
            before = sum((c.ops for c in clients), Counter())
            #: clients that had stored before the timing began (the load was on)
            out["busy_clients_working"] = sum(c.ops["stores"] > 0 for c in clients)
            try:
                out["phases"]["busy"] = time_probes(port, args.requests, args.warmup)
            finally:
                during = sum((c.ops for c in clients), Counter())
                stop.set()
                for client in clients:
                    client.join(120)
            out["busy_ops"] = {op: during[op] - before[op] for op in ("stores", "retrieves")}
            out["busy_errors"] = [e for c in clients for e in c.errors]
    finally:
        proc.terminate()
        out["server_exit"] = proc.wait(60)
    return out


def report(out: dict[str, Any]) -> bool:
    """Print the table; False when some answer was not the expected 200."""
    machine = out["machine"]
    print(f"machine: {machine['cpu']}, {machine['cpu_count']} CPUs; python {machine['python']};"
          f" L1 {out['l1_size_gb']:g} GiB; ready {out['ready_after_s']:.2f} s after start")  # fmt: skip
    if "busy_ops" in out:
        ops = out["busy_ops"]
        print(f"busy phase: {out['busy_clients']} clients, {ops['stores']} stores and"
              f" {ops['retrieves']} retrieves of 8 MiB while the probes were timed")  # fmt: skip
    print(f"{'probe':<9} {'phase':<5} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
          f"  target p99 < {TARGET_MS:g} ms")  # fmt: skip
    ok = True
    for phase, probes in out["phases"].items():
        for path, row in probes.items():
            verdict = "pass" if row["p99_ms"] < TARGET_MS else "FAIL"
            print(f"{path:<9} {phase:<5} {row['requests']:>8} {row['p50_ms']:>8.2f}"
                  f" {row['p99_ms']:>8.2f} {row['max_ms']:>8.2f}  {verdict}")  # fmt: skip
            if row["unexpected"]:
                ok = False
                print(f"  {path} ({phase}) answered otherwise than 200/{EXPECTED_STATUS[path]}:"
                      f" {row['unexpected']}")  # fmt: skip
    for error in out.get("busy_errors", []):
        ok = False
        print(f"  busy client failed: {error}")
    if out["server_exit"] != 0:
        ok = False
        print(f"  the server exited {out['server_exit']}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="timed GETs per probe and phase")
    parser.add_argument("--warmup", type=int, default=5, help="untimed GETs per probe and phase")
    parser.add_argument("--busy-clients", type=int, default=2,
                        help="threads storing and retrieving in the busy phase (0: idle only)")  # fmt: skip
    parser.add_argument("--l1-size-gb", type=float, default=0.25, help="the server's L1 (GiB)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.warmup < 0 or args.busy_clients < 0 or not args.l1_size_gb > 0:
        parser.error("--requests >= 1, --warmup >= 0, --busy-clients >= 0, --l1-size-gb > 0")
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0 if report(out) else 1


if __name__ == "__main__":
    sys.exit(main())
