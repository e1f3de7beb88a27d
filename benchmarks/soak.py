"""Soak test of a real `kvflow server` process under churning, hostile clients (issue 18).

Not a pytest test and not run in CI. The driver starts `kvflow server` (CPU only,
a 64 MiB L1 so eviction runs, `--heartbeat-timeout-s 8`: dead clients are reaped
within seconds, yet a restart, 3-6 s of imports on a busy 2-core box, usually
comes before the reap and meets its old registration) and keeps `--clients`
worker processes busy for `--duration-s` seconds. Each worker:

- registers a shared-memory CPU KV cache (`empty_shared`) under its slot's instance
  id, stores random token sequences drawn from a shared prefix pool (so clients hit
  each other's chunks), looks them up, retrieves them into other blocks (sometimes
  skipping the first blocks) and checks every retrieved byte: block contents are a
  pure function of (token id, position, layer, K/V, head, dim), so the checker knows
  the expected bytes without asking kvflow; blocks it did not ask for, and the
  target blocks beyond the hit, must keep their previous bytes;
- sends random invalid requests on a raw ZMQ DEALER socket (garbage, truncated and
  wrongly typed headers, unknown ops and versions, wrong payload frames, out-of-range
  and negative block ids, unaligned skips, other slots' instances, huge world sizes,
  registrations outside their memory or naming foreign paths) and checks that each
  gets a `failed` reply with the expected code, not silence;
- now and then SIGKILLs itself while a store is in flight.

The driver SIGKILLs workers (mid-transfer or not) or asks them to stop with SIGTERM
(most then unregister, some just close and are reaped) at random, and restarts
each slot after a short pause, with a fresh client id, the dead one's client id
(instant re-registration) or `takeover=True`; a fresh id without takeover gets
`already_exists` until the old registration is reaped (an expected error).

At the end all workers stop, the driver waits until the server has reaped every
instance and client and its event bus is idle, then checks (exit 1 on any failure):

- server threads: end <= warm-up + 0 (a fixed worker pool; registrations add none);
- open fds: end <= warm-up + 8 (the warm-up sample holds the clients' TCP
  connections, which are gone at the end; 8 leaves room for a lazily opened file);
- /dev/shm and memfd mappings in /proc/PID/maps: 0 mappings, 0 bytes at the end
  (every instance is unregistered or reaped, and that unmaps its segments);
- RSS minus L1 usage (the chunks L1 holds are live data, not a leak; L1 is only
  64 MiB and fills during the run): end - warm-up <= max(15% of warm-up RSS,
  64 MiB), room for allocator fragmentation and caches that settle after warm-up
  while a leak of even 1 KiB per request (tens of thousands of requests) shows;
- every START has its END: for each START/END event pair published START ==
  published END, no event dropped, every `kvflow_inflight_*` gauge 0 and
  `kvflow_inflight_expired_total` 0 (Prometheus endpoint); the status's
  `activity.inflight` all 0;
- zero byte mismatches, zero timeouts on valid requests, zero unexpected replies
  or exceptions, every invalid request answered;
- the server still alive, answering status, and exiting 0 on SIGTERM.

Workers write their counters to a temporary directory after every cycle (printed
with the results, with each worker's and the server's log). The warm-up sample is
taken after min(60 s, max(10% of the duration, 20 s)).

Run (takes --duration-s plus 20-60 s):
    python benchmarks/soak.py [--duration-s 600] [--clients 6] [--seed 0]
        [--mean-life-s 15] [--die-rate 0.005]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import zmq

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.errors import AlreadyRegisteredError, RequestTimeoutError
from kvflow.core.server.protocol import (
    PROTOCOL_VERSION,
    Failed,
    KVCachesDesc,
    Lookup,
    Register,
    Retrieve,
    ShmMemory,
    Store,
    TensorDesc,
    Unregister,
    decode_reply,
    encode_request,
)
from kvflow.core.server.shm import shared_memory_of

MODEL = "soak"
BLOCK = 16  # tokens per engine block
CHUNK = 64  # tokens per stored chunk (--chunk-size)
LAYERS, HEADS, HEAD_DIM = 2, 2, 16
NUM_BLOCKS = 64  # per layer; a store and its retrieve use at most 2 * 22 of them
DTYPE = torch.float32  # values < 2**24 are exact integers: bytes are reproducible
PREFIXES = 48  # shared prompt prefixes (clients hit each other's chunks)
SENTINEL = -7.0  # never produced by expected_values
HEARTBEAT_TIMEOUT_S = 8.0  # longer than a restart (3-6 s of imports): restarts meet held ids
L1_SIZE_GB = 0.0625
CALL_TIMEOUT_S = 30.0  # a valid request's budget; exceeding it is a failure
RAW_TIMEOUT_S = 10.0  # an invalid request's budget; silence is a failure
MIB = 1 << 20

# Bounds (see the docstring).
THREADS_GROWTH = 0
FDS_GROWTH = 8
RSS_GROWTH_FRACTION = 0.15
RSS_GROWTH_MIN_BYTES = 64 * MIB


# -- expected KV bytes ---------------------------------------------------------------------


def expected_values(tokens: np.ndarray, start: int) -> torch.Tensor:
    """KV of `tokens` at positions start.. as (LAYERS, 2, n, HEADS, HEAD_DIM) float32.

    Integers below 2**24 (exact in float32) mixed from token id, position, layer and
    K/V, plus head and dim: equal tokens at equal positions always get equal bytes, so
    different clients storing the same prefix write the same chunk content.
    """
    tok = torch.as_tensor(tokens.astype(np.int64))
    pos = torch.arange(start, start + len(tokens), dtype=torch.int64)
    layer = torch.arange(LAYERS, dtype=torch.int64).view(LAYERS, 1, 1)
    kv = torch.arange(2, dtype=torch.int64).view(1, 2, 1)
    base = (tok * 7919 + pos * 104729 + layer * 31337 + kv * 4099) % 65521
    inner = torch.arange(HEADS * HEAD_DIM, dtype=torch.int64).view(HEADS, HEAD_DIM)
    values = base.view(LAYERS, 2, len(tokens), 1, 1) * 256 + inner
    return values.to(DTYPE)


def block_values(tokens: np.ndarray, first_block: int, count: int) -> torch.Tensor:
    """Expected content of blocks first_block..first_block+count-1 of `tokens`.

    Shape (LAYERS, 2, count, BLOCK, HEADS, HEAD_DIM); positions past the end of
    `tokens` (a partial last block) hold SENTINEL.
    """
    start = first_block * BLOCK
    part = tokens[start : (first_block + count) * BLOCK]
    out = torch.full((LAYERS, 2, count * BLOCK, HEADS, HEAD_DIM), SENTINEL, dtype=DTYPE)
    out[:, :, : len(part)] = expected_values(part, start)
    return out.view(LAYERS, 2, count, BLOCK, HEADS, HEAD_DIM)


def prefix_tokens(index: int, length: int) -> np.ndarray:
    """The first `length` tokens of shared prefix `index` (the same in every process)."""
    return np.random.default_rng(1000 + index).integers(0, 32000, length, dtype=np.int32)


# -- the worker (one client process) ---------------------------------------------------------


@dataclass
class WorkerStats:
    """What one worker life did; written to its stats file after every cycle."""

    counts: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def problem(self, kind: str, text: str, amount: int = 1) -> None:
        """Count `amount` failures of kind `kind`; keep the first messages for the report."""
        self.counts[kind] += amount
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {text}"[:300])

    def dump(self, path: Path) -> None:
        """Write atomically, so a SIGKILL leaves the previous complete snapshot."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"counts": self.counts, "problems": self.problems}))
        os.replace(tmp, path)


class Worker:
    """One client process: a KV cache, valid traffic with byte checks, invalid traffic."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.endpoint: str = spec["endpoint"]
        self.slot: int = spec["slot"]
        self.slots: int = spec["slots"]
        self.instance_id = f"soak-slot{self.slot}"
        self.rng = random.Random(spec["seed"])
        self.stats_path = Path(spec["stats"])
        self.takeover: bool = spec["takeover"]
        self.stats = WorkerStats()
        self.stop = threading.Event()
        self.client = KVFlowClient(
            self.endpoint, timeout_s=CALL_TIMEOUT_S, client_id=spec["client_id"]
        )
        shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
        self.kv = [empty_shared(shape, DTYPE) for _ in range(LAYERS)]
        for layer in self.kv:
            layer.fill_(SENTINEL)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.raw: zmq.Socket[Any] = self._raw_socket()
        self.raw_id = 1 << 40
        self.seq = 0

    # -- valid traffic ---------------------------------------------------------------

    def register(self) -> None:
        """Register the slot's instance; wait out (or take over) a dead owner's hold."""
        deadline = time.monotonic() + 4 * HEARTBEAT_TIMEOUT_S
        takeover = self.takeover
        while True:
            try:
                self.client.register_kv_caches(
                    self.instance_id, self.kv, model_name=MODEL, takeover=takeover
                )
                self.stats.counts["ok"] += 1
                self.stats.counts["takeover_registrations" if takeover else "registrations"] += 1
                return
            except AlreadyRegisteredError:
                # A dead life of this slot under another client id: reaped after the
                # heartbeat timeout; taken over at once with takeover=True.
                self.stats.counts["expected_already_exists"] += 1
                self.stats.counts["errors_as_expected"] += 1
                takeover = time.monotonic() > deadline or self.rng.random() < 0.05
                time.sleep(0.25)

    def _sequence(self) -> np.ndarray:
        prefix = prefix_tokens(self.rng.randrange(PREFIXES), CHUNK * self.rng.randint(1, 3))
        tail = self.rng.randrange(0, 2 * CHUNK + BLOCK)
        rand = np.random.default_rng(self.rng.getrandbits(32)).integers(0, 32000, tail)
        return np.concatenate([prefix, rand.astype(np.int32)])

    def _fill(self, tokens: np.ndarray, blocks: list[int]) -> None:
        values = block_values(tokens, 0, len(blocks))
        index = torch.as_tensor(blocks)
        for layer, tensor in enumerate(self.kv):
            tensor[:, index] = values[layer]

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """A valid request: count it; a timeout or any error is a failure (None)."""
        try:
            result = fn()
        except RequestTimeoutError as exc:
            self.stats.problem("valid_timeouts", f"{what}: {exc}")
            return None
        except Exception as exc:
            self.stats.problem("unexpected_errors", f"{what}: {type(exc).__name__}: {exc}")
            return None
        self.stats.counts["ok"] += 1
        self.stats.counts[what] += 1
        return result

    def cycle(self) -> None:
        """Store a sequence, look it up, retrieve it into other blocks, check the bytes."""
        self.seq += 1
        tokens = self._sequence()
        n_blocks = -(-len(tokens) // BLOCK)
        perm = self.rng.sample(range(NUM_BLOCKS), 2 * n_blocks)
        src, dst = perm[:n_blocks], perm[n_blocks:]
        rid = f"{self.instance_id}-{os.getpid()}-{self.seq}"
        self._fill(tokens, src)
        stored = self._call(
            "stores", lambda: self.client.store(self.instance_id, tokens, src, request_id=rid)
        )
        if stored is not None and not (0 <= stored <= len(tokens) and stored % CHUNK == 0):
            self.stats.problem("wrong_results", f"store returned {stored} for {len(tokens)}")
        full = len(tokens) // CHUNK * CHUNK
        hit = self._call(
            "lookups", lambda: self.client.lookup(tokens, model_name=MODEL, request_id=rid)
        )
        if hit is not None:
            if not (0 <= hit <= len(tokens) and hit % CHUNK == 0):
                self.stats.problem("wrong_results", f"lookup returned {hit} for {len(tokens)}")
            elif stored is not None and hit < full:
                self.stats.counts["lookup_short_after_eviction"] += 1
        skip = self.rng.choice([0, 0, 0, BLOCK, CHUNK, CHUNK + 2 * BLOCK])
        index = torch.as_tensor(dst)
        for tensor in self.kv:
            tensor[:, index] = SENTINEL
        before = [t.clone() for t in self.kv]
        rid2 = rid + "-r"
        got = self._call(
            "retrieves",
            lambda: self.client.retrieve(
                self.instance_id, tokens, dst, request_id=rid2, skip_first_n_tokens=skip
            ),
        )
        if got is not None:
            self._check_retrieve(tokens, dst, skip, got, before)
        for r in (rid, rid2):
            self._call("end_sessions", functools.partial(self.client.end_session, r))

    def _check_retrieve(
        self, tokens: np.ndarray, dst: list[int], skip: int, got: int, before: list[torch.Tensor]
    ) -> None:
        """Blocks [skip, got) of `dst` hold the expected bytes; every other byte is unchanged."""
        if not (0 <= got <= len(tokens) and got % CHUNK == 0):
            self.stats.problem("wrong_results", f"retrieve returned {got} for {len(tokens)}")
            return
        lo, hi = skip // BLOCK, max(skip, got) // BLOCK
        expect = [t.clone() for t in before]
        if hi > lo:
            values = block_values(tokens, lo, hi - lo)
            index = torch.as_tensor(dst[lo:hi])
            for layer, tensor in enumerate(expect):
                tensor[:, index] = values[layer]
        bad = 0
        for actual, wanted in zip(self.kv, expect, strict=True):
            a = actual.view(torch.uint8)
            w = wanted.view(torch.uint8)
            bad += int((a != w).sum())
        self.stats.counts["checked_bytes"] += sum(t.numel() * t.element_size() for t in expect)
        if bad:
            self.stats.problem(
                "mismatched_bytes",
                f"{bad} bytes differ (tokens {len(tokens)}, skip {skip}, hit {got})",
                amount=bad,
            )

    def die_mid_store(self) -> None:
        """SIGKILL this process while a store is in flight (the server must cope)."""
        tokens = self._sequence()
        blocks = self.rng.sample(range(NUM_BLOCKS), -(-len(tokens) // BLOCK))
        self._fill(tokens, blocks)
        threading.Thread(
            target=self.client.store,
            args=(self.instance_id, tokens, blocks),
            kwargs={"request_id": f"doomed-{os.getpid()}"},
            daemon=True,
        ).start()
        time.sleep(self.rng.random() * 0.004)
        os.kill(os.getpid(), signal.SIGKILL)

    # -- invalid traffic ---------------------------------------------------------------

    def _raw_socket(self) -> zmq.Socket[Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        return sock

    def _header(self, op: str, **fields: Any) -> bytes:
        self.raw_id += 1
        body = {"op": op, "v": PROTOCOL_VERSION, "id": self.raw_id, "client": self.client.client_id}
        body.update(fields)
        return msgspec.msgpack.encode(body)

    def _encoded(self, request: Any, *payloads: np.ndarray) -> list[Any]:
        """Frames of a well-formed request (the client's schema check passes)."""
        self.raw_id += 1
        request.id = self.raw_id
        request.client = self.client.client_id
        return encode_request(request, payloads)

    def _desc(self, **memory: Any) -> KVCachesDesc:
        """A description of layer 0 with `memory` fields overridden."""
        t = self.kv[0]
        shm = shared_memory_of(t)
        assert shm is not None
        mem = {"name": shm.name, "size": shm.size, "offset": shm.offset, **memory}
        desc = TensorDesc(str(t.dtype), tuple(t.shape), tuple(t.stride()), ShmMemory(**mem))
        return KVCachesDesc("list", [desc])

    def invalid_cases(self) -> dict[str, Callable[[], tuple[list[Any], set[str]]]]:
        """Builders of invalid requests: name -> (frames, acceptable failure codes)."""
        i32 = np.int32
        tokens = prefix_tokens(0, CHUNK)
        blocks = np.arange(CHUNK // BLOCK, dtype=i32)
        n = max(self.slots, 2)
        other = f"soak-slot{(self.slot + self.rng.randrange(1, n)) % n}"  # another slot's id
        proto, invalid = {"protocol"}, {"invalid_argument"}
        lookup = self._encoded(Lookup(model_name=MODEL), tokens)[0]
        return {
            "garbage": lambda: ([self.rng.randbytes(self.rng.randint(1, 64))], proto),
            "empty_header": lambda: ([b""], proto),
            "truncated_header": lambda: ([lookup[: self.rng.randrange(1, len(lookup))]], proto),
            "not_a_map": lambda: ([msgspec.msgpack.encode([1, 2, 3])], proto),
            "wrong_type": lambda: ([self._header("lookup", model_name=123), tokens.data], proto),
            "unknown_op": lambda: ([self._header("explode")], proto),
            "wrong_version": lambda: (
                [self._header("status", v=PROTOCOL_VERSION + 98)],
                proto,
            ),
            "missing_payload": lambda: ([self._header("lookup", model_name=MODEL)], proto),
            "odd_payload": lambda: (
                [self._header("lookup", model_name=MODEL), b"\x01\x02\x03"],
                proto,
            ),
            "too_many_frames": lambda: ([self._header("status")] + [b"x"] * 10, proto),
            "bad_utf8": lambda: (
                [self._header("lookup", model_name=MODEL)[:-4] + b"\xff\xfe\xfd\xfc"],
                proto,
            ),
            "block_out_of_range": lambda: (
                self._encoded(
                    Store(instance_id=self.instance_id, request_id="bad"),
                    tokens,
                    blocks + NUM_BLOCKS,
                ),
                invalid,
            ),
            "negative_block": lambda: (
                self._encoded(
                    Store(instance_id=self.instance_id, request_id="bad"), tokens, blocks - 2
                ),
                invalid,
            ),
            "too_few_blocks": lambda: (
                self._encoded(
                    Retrieve(instance_id=self.instance_id, request_id="bad"), tokens, blocks[:1]
                ),
                invalid,
            ),
            "unaligned_skip": lambda: (
                self._encoded(
                    Retrieve(
                        instance_id=self.instance_id,
                        request_id="bad",
                        skip_first_n_tokens=BLOCK // 2,
                    ),
                    tokens,
                    blocks,
                ),
                invalid,
            ),
            "others_store": lambda: (
                self._encoded(Store(instance_id=other, request_id="bad"), tokens, blocks),
                {"permission_denied", "not_found"},
            ),
            "others_unregister": lambda: (
                self._encoded(Unregister(instance_id=other)),
                {"permission_denied", "not_found"},
            ),
            "unknown_instance": lambda: (
                self._encoded(
                    Retrieve(instance_id="soak-nobody", request_id="bad"), tokens, blocks
                ),
                {"not_found"},
            ),
            "huge_world_size": lambda: (
                self._encoded(Lookup(model_name=MODEL, world_size=1 << 40), tokens),
                invalid,
            ),
            "register_huge_world": lambda: (
                self._encoded(
                    Register(
                        instance_id=f"soak-bad-{self.slot}",
                        kv_caches=self._desc(),
                        model_name=MODEL,
                        world_size=1 << 40,
                    )
                ),
                invalid,
            ),
            "register_past_memory": lambda: (
                self._encoded(
                    Register(
                        instance_id=f"soak-bad-{self.slot}",
                        kv_caches=self._desc(offset=4096),
                        model_name=MODEL,
                    )
                ),
                invalid,
            ),
            "register_foreign_path": lambda: (
                self._encoded(
                    Register(
                        instance_id=f"soak-bad-{self.slot}",
                        kv_caches=self._desc(name="../../etc/passwd"),
                        model_name=MODEL,
                    )
                ),
                invalid,
            ),
        }

    def invalid_request(self) -> None:
        """Send one random invalid request; it must get a `failed` reply with an expected code."""
        cases = self.invalid_cases()
        name = self.rng.choice(sorted(cases))
        frames, codes = cases[name]()
        self.raw.send_multipart(frames, copy=True)
        if not self.raw.poll(int(RAW_TIMEOUT_S * 1000)):
            self.stats.problem("invalid_timeouts", f"{name}: no reply in {RAW_TIMEOUT_S} s")
            self.raw.close(0)
            self.raw = self._raw_socket()
            return
        reply = decode_reply(self.raw.recv_multipart()[0])
        if isinstance(reply, Failed) and reply.code in codes:
            self.stats.counts["errors_as_expected"] += 1
            self.stats.counts[f"invalid_{name}"] += 1
        else:
            got = f"{reply.code}: {reply.message}" if isinstance(reply, Failed) else repr(reply)
            self.stats.problem("unexpected_replies", f"{name}: expected {sorted(codes)}, got {got}")

    # -- life ---------------------------------------------------------------------------

    def run(self, die_rate: float) -> int:
        """Cycle until SIGTERM; then unregister (usually) and exit 0."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop.set())
        self.register()
        self.stats.dump(self.stats_path)
        while not self.stop.is_set():
            self.cycle()
            for _ in range(self.rng.randint(0, 3)):
                self.invalid_request()
            self.stats.counts["cycles"] += 1
            self.stats.dump(self.stats_path)
            if self.rng.random() < die_rate:
                self.die_mid_store()
        if self.rng.random() < 0.8:
            self._call("unregisters", lambda: self.client.unregister(self.instance_id))
            self.stats.counts["clean_unregisters"] += 1
        else:
            self.stats.counts["closed_without_unregister"] += 1  # the server reaps it
        self.client.close()
        self.raw.close(0)
        self.ctx.term()
        self.stats.dump(self.stats_path)
        return 0


# -- the driver ----------------------------------------------------------------------------


@dataclass
class Resources:
    """One sample of the server process's resources."""

    threads: int
    fds: int
    shm_maps: int
    shm_bytes: int
    rss: int
    l1_usage: int
    thread_names: Counter[str]


def sample(pid: int, client: KVFlowClient) -> Resources:
    """Threads, fds, /dev/shm + memfd mappings (count, bytes), RSS and L1 usage of `pid`."""
    maps, mapped = 0, 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/dev/shm/" in line or "memfd:" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                maps += 1
                mapped += hi - lo
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    names: Counter[str] = Counter()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/comm") as f:
            names[f.read().strip()] += 1
    return Resources(
        threads=sum(names.values()),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        shm_maps=maps,
        shm_bytes=mapped,
        rss=rss,
        l1_usage=int(client.status()["l1"]["usage_bytes"]),
        thread_names=names,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(log: Path, metrics_port: int) -> tuple[subprocess.Popen[bytes], str]:
    """`kvflow server` on a free port; returns the process and its endpoint."""
    kvflow = Path(sys.executable).with_name("kvflow")
    cmd = [str(kvflow), "server", "--port", "0", "--chunk-size", str(CHUNK)]
    cmd += ["--l1-size-gb", str(L1_SIZE_GB), "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)]
    cmd += ["--prometheus-port", str(metrics_port), "--disable-logging", "--log-format", "json"]
    print("server:", " ".join(cmd[1:]), flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        match = re.search(r"listening on (tcp://\S+)", log.read_text())
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server did not start:\n{log.read_text()}")


@dataclass
class Slot:
    """One client slot: its current process, its lives, and the client ids it used."""

    index: int
    proc: subprocess.Popen[bytes] | None = None
    killed_by_driver: bool = False
    terminating: bool = False  # sent its one SIGTERM (a second could land after exit began)
    lives: int = 0
    client_id: str = ""
    restart_at: float = 0.0
    stats: Path | None = None


class Driver:
    """Starts, kills and restarts worker processes; collects their stats files."""

    def __init__(self, args: argparse.Namespace, endpoint: str, workdir: Path) -> None:
        self.args = args
        self.endpoint = endpoint
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.slots = [Slot(i) for i in range(args.clients)]
        self.events: Counter[str] = Counter()
        self.failures: list[str] = []
        self.worker_pids: list[int] = []

    def spawn(self, slot: Slot) -> None:
        """Start a new life of `slot`: fresh id, the previous id, or takeover."""
        mode = (
            self.rng.choice(["fresh", "same_id", "same_id", "takeover"]) if slot.lives else "fresh"
        )
        if mode != "same_id" or not slot.client_id:
            slot.client_id = f"soak-{slot.index}-{slot.lives}-{self.rng.getrandbits(32):08x}"
        if slot.lives:
            self.events["restarts"] += 1
            self.events[f"restarts_{mode}"] += 1
        slot.stats = self.workdir / f"stats-{slot.index}-{slot.lives}.json"
        spec = {
            "endpoint": self.endpoint,
            "slot": slot.index,
            "slots": len(self.slots),
            "seed": self.rng.getrandbits(64),
            "client_id": slot.client_id,
            "takeover": mode == "takeover",
            "stats": str(slot.stats),
            "die_rate": self.args.die_rate,
        }
        log = open(self.workdir / f"worker-{slot.index}-{slot.lives}.log", "wb")  # noqa: SIM115
        slot.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.worker_pids.append(slot.proc.pid)
        slot.killed_by_driver = False
        slot.terminating = False
        slot.lives += 1

    def reap(self, slot: Slot, now: float) -> None:
        """Account for an exited worker and schedule its restart."""
        assert slot.proc is not None
        rc = slot.proc.returncode
        if rc == -signal.SIGKILL:
            self.events["killed_by_driver" if slot.killed_by_driver else "died_mid_store"] += 1
            remove_segments(slot.proc.pid)  # a SIGKILLed client leaves its /dev/shm names
        elif rc == 0:
            self.events["clean_exits"] += 1
        elif rc == -signal.SIGTERM and not (slot.stats and slot.stats.exists()):
            self.events["stopped_during_start_up"] += 1  # before its SIGTERM handler existed
        else:
            log = self.workdir / f"worker-{slot.index}-{slot.lives - 1}.log"
            self.failures.append(f"worker {slot.index} exited {rc}:\n{log.read_text()[-2000:]}")
        slot.proc = None
        slot.restart_at = now + self.rng.uniform(0.1, 1.5)

    def tick(self, now: float) -> None:
        """Reap exited workers, restart due slots, maybe kill or stop a running one."""
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is not None:
                self.reap(slot, now)
            if slot.proc is None and now >= slot.restart_at:
                self.spawn(slot)
            elif slot.proc is not None and self.rng.random() < 0.2 / self.args.mean_life_s:
                registered = slot.stats is not None and slot.stats.exists()
                if self.rng.random() < 0.6 or not registered or slot.terminating:
                    slot.killed_by_driver = True
                    slot.proc.send_signal(signal.SIGKILL)
                    self.events["sigkill"] += 1
                else:
                    slot.terminating = True
                    slot.proc.send_signal(signal.SIGTERM)
                    self.events["sigterm"] += 1

    def stop_all(self) -> None:
        """SIGTERM every worker (clean stop), SIGKILL those still running after 60 s.

        Workers still starting are given 60 s to register first, so that they see the
        SIGTERM (their handler is set when they register) and stop cleanly.
        """
        wait_until(
            lambda: all(
                s.proc is None or s.proc.poll() is not None or (s.stats and s.stats.exists())
                for s in self.slots
            ),
            60,
        )
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None and not slot.terminating:
                slot.terminating = True
                slot.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for slot in self.slots:
            if slot.proc is None:
                continue
            try:
                slot.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.failures.append(f"worker {slot.index} ignored SIGTERM for 60 s")
                slot.killed_by_driver = True
                slot.proc.kill()
                slot.proc.wait()
            self.reap(slot, time.monotonic())
        for pid in self.worker_pids:
            remove_segments(pid)

    def totals(self) -> tuple[Counter[str], list[str]]:
        """Sum of every life's counters, and their reported problems."""
        counts: Counter[str] = Counter()
        problems: list[str] = []
        for path in sorted(self.workdir.glob("stats-*.json")):
            data = json.loads(path.read_text())
            counts.update(data["counts"])
            problems += data["problems"]
        return counts, problems


def remove_segments(pid: int) -> None:
    for path in glob.glob(f"/dev/shm/kvflow-{pid}-*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.25)
    return cond()


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """Samples of the Prometheus endpoint: (name, labels, value)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
            out.append((match.group(1), labels, float(match.group(3))))
    return out


Check = tuple[str, bool, str]  # (what, passed, detail)


def event_checks(port: int, status: dict[str, Any]) -> Iterator[Check]:
    """(check, passed, detail) for START/END pairing, drops and in-flight gauges."""
    samples = scrape(port)
    published = {
        labels["event_type"]: value
        for name, labels, value in samples
        if name == "kvflow_bus_published_total"
    }
    pairs = sorted(k[: -len("_start")] for k in published if k.endswith("_start"))
    unpaired = {p: (published[f"{p}_start"], published.get(f"{p}_end", 0.0)) for p in pairs}
    unpaired = {p: v for p, v in unpaired.items() if v[0] != v[1]}
    starts = sum(published[f"{p}_start"] for p in pairs)
    yield "every START has its END", not unpaired, f"{int(starts)} STARTs; unpaired {unpaired}"
    dropped = sum(v for n, _, v in samples if n == "kvflow_bus_dropped_total")
    yield "no event dropped", dropped == 0, f"{int(dropped)} dropped"
    inflight = {
        f"{n}{labels}": v for n, labels, v in samples if n.startswith("kvflow_inflight_") and v
    }
    yield "kvflow_inflight_* all 0", not inflight, str(inflight or "all 0")
    bus = status["bus"]
    balanced = bus["published"] == bus["delivered"] + bus["dropped"] and bus["queue_depth"] == 0
    yield (
        "bus idle and balanced",
        balanced,
        f"published {bus['published']}, delivered {bus['delivered']}",
    )
    gauges = status.get("activity", {}).get("inflight", {})
    yield "status activity.inflight all 0", not any(gauges.values()), str(gauges)


def fmt_bytes(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


def resource_table(start: Resources, warm: Resources, end: Resources) -> list[Check]:
    """Print the server's resources at start, warm-up and end; check the bounds."""
    rss_bound = max(RSS_GROWTH_FRACTION * warm.rss, RSS_GROWTH_MIN_BYTES)
    rows: list[tuple[str, Callable[[Resources], int], Callable[[float], str], str]] = [
        ("threads", lambda r: r.threads, lambda v: f"{v:g}", f"+{THREADS_GROWTH}"),
        ("open fds", lambda r: r.fds, lambda v: f"{v:g}", f"+{FDS_GROWTH}"),
        ("shm/memfd mappings", lambda r: r.shm_maps, lambda v: f"{v:g}", "0 at end"),
        ("shm/memfd bytes", lambda r: r.shm_bytes, fmt_bytes, "0 at end"),
        ("RSS", lambda r: r.rss, fmt_bytes, "(info)"),
        ("L1 usage", lambda r: r.l1_usage, fmt_bytes, "(info)"),
        ("RSS - L1 usage", lambda r: r.rss - r.l1_usage, fmt_bytes, f"+{fmt_bytes(rss_bound)}"),
    ]
    print("\nserver resources (growth = end - warm-up)")
    print(f"{'':<20} {'start':>11} {'warm-up':>11} {'end':>11} {'growth':>11} {'bound':>11}")
    for label, get, show, bound in rows:
        growth = get(end) - get(warm)
        sign = "+" if growth >= 0 else "-"
        print(
            f"{label:<20} {show(get(start)):>11} {show(get(warm)):>11} {show(get(end)):>11}"
            f" {sign + show(abs(growth)):>11} {bound:>11}"
        )
    added = end.thread_names - warm.thread_names
    rss_growth = (end.rss - end.l1_usage) - (warm.rss - warm.l1_usage)
    return [
        (
            f"threads growth <= +{THREADS_GROWTH}",
            end.threads - warm.threads <= THREADS_GROWTH,
            f"{end.threads - warm.threads:+d}; new: {dict(added) or 'none'}",
        ),
        (f"open fds growth <= +{FDS_GROWTH}", end.fds - warm.fds <= FDS_GROWTH, ""),
        ("shm/memfd mappings back to 0", end.shm_maps == 0, f"{end.shm_maps} at end"),
        ("shm/memfd bytes back to 0", end.shm_bytes == 0, fmt_bytes(end.shm_bytes)),
        (
            f"RSS - L1 usage growth <= +{fmt_bytes(rss_bound)}",
            rss_growth <= rss_bound,
            f"{rss_growth / MIB:+.1f} MiB",
        ),
    ]


def drive(args: argparse.Namespace) -> int:
    """Run the soak; print the resource table, the checks and the summary; 0 when all pass."""
    workdir = Path(tempfile.mkdtemp(prefix="kvflow-soak-"))
    metrics_port = free_port()
    server, endpoint = start_server(workdir / "server.log", metrics_port)
    admin = KVFlowClient(endpoint, timeout_s=CALL_TIMEOUT_S)
    driver = Driver(args, endpoint, workdir)
    warmup_s = min(60.0, max(0.1 * args.duration_s, 20.0))
    baseline = sample(server.pid, admin)
    warm: Resources | None = None
    t0 = time.monotonic()
    print(f"soak: {args.clients} clients for {args.duration_s:g} s; work dir {workdir}", flush=True)
    try:
        while (now := time.monotonic()) - t0 < args.duration_s:
            driver.tick(now)
            if warm is None and now - t0 >= warmup_s:
                warm = sample(server.pid, admin)
                print(f"warm-up sample at {now - t0:.0f} s: {warm}", flush=True)
            if server.poll() is not None:
                driver.failures.append(f"server exited {server.returncode} during the soak")
                break
            time.sleep(0.2)
        driver.stop_all()
    except BaseException:
        for slot in driver.slots:
            if slot.proc is not None:
                slot.proc.kill()
        server.kill()
        raise
    assert warm is not None or server.poll() is not None

    checks: list[Check] = []
    alive = server.poll() is None
    end: Resources | None = None
    if alive:
        reaped = wait_until(
            lambda: (
                not admin.status()["server"]["instances"]
                and set(admin.status()["server"]["clients"]) <= {admin.client_id}
            ),
            10 * HEARTBEAT_TIMEOUT_S + 10,
        )
        checks.append(("all instances and clients reaped", reaped, ""))
        wait_until(lambda: admin.status()["bus"]["queue_depth"] == 0, 30)
        time.sleep(1.0)  # let in-flight reaps unmap and the bus deliver
        end = sample(server.pid, admin)
        status = admin.status()
        checks += list(event_checks(metrics_port, status))
    counts, problems = driver.totals()

    if warm is not None and end is not None:
        checks += resource_table(baseline, warm, end)

    checks.append(("server alive and answering status", alive and end is not None, ""))
    for kind in (
        "mismatched_bytes",
        "valid_timeouts",
        "invalid_timeouts",
        "unexpected_errors",
        "unexpected_replies",
        "wrong_results",
    ):
        checks.append((f"zero {kind}", counts[kind] == 0, str(counts[kind])))
    checks.append(("workers exited 0 or by SIGKILL", not driver.failures, ""))
    admin.close()
    rc_server: int | None = None
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            rc_server = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    checks.append(("server exits 0 on SIGTERM", rc_server == 0, f"rc {rc_server}"))

    print("\nchecks")
    for name, ok, detail in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}{'  (' + detail + ')' if detail else ''}")
    for failure in driver.failures:
        print("  worker failure:", failure)
    for problem in problems[:30]:
        print("  problem:", problem)

    print("\nsummary")
    requests_ok = counts["ok"]
    rows_summary = [
        ("valid requests ok", requests_ok),
        (
            "  stores / lookups / retrieves",
            f"{counts['stores']} / {counts['lookups']} / {counts['retrieves']}",
        ),
        ("  bytes checked", fmt_bytes(counts["checked_bytes"])),
        ("  lookups short (evicted)", counts["lookup_short_after_eviction"]),
        ("errors as expected", counts["errors_as_expected"]),
        ("  already_exists on restart", counts["expected_already_exists"]),
        ("mismatched bytes", counts["mismatched_bytes"]),
        (
            "timeouts (valid / invalid)",
            f"{counts['valid_timeouts']} / {counts['invalid_timeouts']}",
        ),
        (
            "unexpected errors / replies",
            f"{counts['unexpected_errors']} / {counts['unexpected_replies']}",
        ),
        ("client kills (driver SIGKILL)", driver.events["killed_by_driver"]),
        ("client self-kills mid-store", driver.events["died_mid_store"]),
        ("clean stops (SIGTERM)", driver.events["clean_exits"]),
        (
            "  unregistered / left to reaping",
            f"{counts['clean_unregisters']} / {counts['closed_without_unregister']}",
        ),
        (
            "restarts (fresh/same id/takeover)",
            f"{driver.events['restarts']} ({driver.events['restarts_fresh']}/"
            f"{driver.events['restarts_same_id']}/{driver.events['restarts_takeover']})",
        ),
    ]
    if warm is not None and end is not None:
        rows_summary += [
            ("threads warm-up -> end", f"{warm.threads} -> {end.threads}"),
            ("fds warm-up -> end", f"{warm.fds} -> {end.fds}"),
            ("shm maps warm-up -> end", f"{warm.shm_maps} -> {end.shm_maps}"),
            ("RSS warm-up -> end", f"{fmt_bytes(warm.rss)} -> {fmt_bytes(end.rss)}"),
        ]
    for label, value in rows_summary:
        print(f"  {label:<36} {value}")
    invalid = sorted(
        (k[len("invalid_") :], v) for k, v in counts.items() if k.startswith("invalid_")
    )
    print("  invalid requests answered as expected, by kind:")
    print("    " + ", ".join(f"{k} {v}" for k, v in invalid if k != "timeouts"))
    passed = all(ok for _, ok, _ in checks)
    print(f"\nsoak {'PASSED' if passed else 'FAILED'} (work dir {workdir})")
    return 0 if passed else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mean-life-s",
        type=float,
        default=15.0,
        help="mean seconds between kills/stops per client",
    )
    parser.add_argument(
        "--die-rate",
        type=float,
        default=0.005,
        help="chance per cycle a worker kills itself mid-store",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        torch.set_num_threads(1)
        sys.exit(Worker(spec).run(spec["die_rate"]))
    sys.exit(drive(args))


if __name__ == "__main__":
    main()
