"""L2 on disk through a real `kvflow server` subprocess, seen from a client and its event log.

One scenario, step by step: chunks evicted from a small L1 still hit on disk and come
back bit-exact; a restarted server finds them again; a prefetch puts them in L1 so the
retrieve after it reads only L1; a corrupted file in the middle gives the prefix before
it and writes nothing after it back to L1.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.engine.keys import chain_hashes
from tests.e2e.server_proc import running_server
from tests.support.launcher import kvflow_run

CHUNK = 16  # tokens per chunk = one block
BLOCKS = 32
N = 8  # chunks per request
L1_CHUNKS = 16  # T and OTHER fill L1; THIRD evicts T's last 6 chunks
SHAPE = (2, BLOCKS, CHUNK, 2, 64)  # vLLM flash-attn layer: [K|V, blocks, block size, heads, dim]
LAYERS = 2
CHUNK_BYTES = LAYERS * 2 * CHUNK * 2 * 64 * 2  # bf16


def _caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    caches = [empty_shared(SHAPE, torch.bfloat16) for _ in range(LAYERS)]
    for layer in caches:
        layer.copy_(torch.randn(SHAPE, generator=gen).to(torch.bfloat16))
    return caches


def _blocks(caches: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.stack([layer[:, ids] for layer in caches])


class Log:
    """The server's JSON event log lines, read as they grow."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.path.read_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == name:
                    out.append(record)
        return out


def _wait(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@contextmanager
def _server(tmp_path: Path, disk: Path, name: str) -> Iterator[tuple[KVFlowClient, Log]]:
    """A server with an L1 of L1_CHUNKS objects and L2 on `disk`; a client with src and dst."""
    log_path = tmp_path / f"{name}.log"
    args = [
        "--l1-size-gb", str(L1_CHUNKS * CHUNK_BYTES / (1 << 30)),
        "--l2-disk", str(disk), "--l2-disk-size-gb", "0.01",
        "--log-level", "debug", "--log-format", "json",
    ]  # fmt: skip
    with running_server(CHUNK, log_path, args) as endpoint, KVFlowClient(endpoint) as client:
        yield client, Log(log_path)


class Worker:
    """The engine side: two registered KV caches of one model on one client."""

    def __init__(self, client: KVFlowClient, src: list[torch.Tensor], dst: list[torch.Tensor]):
        self.client = client
        self.src = src
        self.dst = dst
        client.register_kv_caches("src", src, model_name="m")
        client.register_kv_caches("dst", dst, model_name="m")

    def settled(self) -> bool:
        """No write-through pending and every prefetch done."""
        l2 = self.client.status()["l2"]
        return l2["in_flight"]["write_through"]["calls"] == 0 and l2["in_flight"]["loading"] == 0


SRC_IDS = list(range(N))
DST_IDS = list(range(N, 2 * N))
T = np.arange(100, 100 + N * CHUNK, dtype=np.int32)
OTHER = np.arange(5000, 5000 + N * CHUNK, dtype=np.int32)
THIRD = np.arange(7000, 7000 + 6 * CHUNK, dtype=np.int32)


def test_disk_tier_end_to_end_through_a_server_subprocess(tmp_path: Path) -> None:
    """Eviction to disk, restart, prefetch, and a corrupt chunk, checked bit for bit."""
    disk = tmp_path / "disk"
    src, dst = _caches(1), _caches(2)
    want = _blocks(src, SRC_IDS)

    with _server(tmp_path, disk, "first") as (client, log):
        w = Worker(client, src, dst)
        # 1. T is stored (and written through to disk); OTHER and THIRD then evict most
        #    of T from L1
        assert client.store("src", T, SRC_IDS, request_id="t") == N * CHUNK
        _wait(w.settled)
        assert client.store("src", OTHER, SRC_IDS, request_id="o") == N * CHUNK
        _wait(w.settled)
        assert client.store("src", THIRD, SRC_IDS, request_id="3") == 6 * CHUNK
        _wait(w.settled)
        assert client.status()["l1"]["evicted_chunks"] == 6
        # 2. the lookup counts T's evicted chunks as disk hits (no prefetch asked)
        assert client.lookup(T, model_name="m", request_id="q1", prefetch=False) == N * CHUNK
        _wait(lambda: bool(log.events("lookup_end")))
        by_tier = log.events("lookup_end")[-1]["hit_tokens_by_tier"]
        assert by_tier == {"l1": 2 * CHUNK, "disk": 6 * CHUNK}
        # 3. the retrieve loads them from disk, bit-exact
        assert client.retrieve("dst", T, DST_IDS, request_id="q1") == N * CHUNK
        assert torch.equal(_blocks(dst, DST_IDS), want)
        _wait(lambda: bool(log.events("retrieve_end")))
        assert log.events("retrieve_end")[-1]["l2_chunks"] == 6
        tiers = client.status()["l2"]["tiers"]["disk"]
        assert (tiers["stored"], tiers["loaded"], tiers["load_failures"]) == (2 * N + 6, 6, 0)
        assert [p["path"] for p in tiers["detail"]["paths"]] == [str(disk)]

    # 4. a new server on the same directory finds every object again
    for layer in dst:
        layer.zero_()
    with _server(tmp_path, disk, "second") as (client, log):
        w = Worker(client, src, dst)
        assert client.status()["l2"]["tiers"]["disk"]["objects"] == 2 * N + 6
        # 5. a prefetch (the API) brings T into L1...
        prefetch_id = client.prefetch(T, model_name="m", request_id="q2")
        _wait(lambda: client.prefetch_state(prefetch_id)["state"] == "done")
        state = client.prefetch_state(prefetch_id)
        assert state["written_back_chunks"] == N and state["landed_tokens"] == N * CHUNK
        loads_before = len(log.events("l2_load_end"))
        # ...so the retrieve reads only L1: no load, l2_chunks 0, bytes exact
        assert client.retrieve("dst", T, DST_IDS, request_id="q2") == N * CHUNK
        assert torch.equal(_blocks(dst, DST_IDS), want)
        _wait(lambda: bool(log.events("retrieve_end")))
        assert log.events("retrieve_end")[-1]["l2_chunks"] == 0
        assert len(log.events("l2_load_end")) == loads_before

    # 6. chunk 3's file is corrupted on disk; a fresh server (empty L1) retrieves T
    (h3_file,) = disk.rglob(f"{chain_hashes(T, CHUNK)[3].hex()}.*")
    data = bytearray(h3_file.read_bytes())
    data[-1] ^= 0xFF
    h3_file.write_bytes(bytes(data))
    for layer in dst:
        layer.zero_()
    with _server(tmp_path, disk, "third") as (client, log):
        w = Worker(client, src, dst)
        assert client.retrieve("dst", T, DST_IDS, request_id="q3") == 3 * CHUNK
        assert torch.equal(_blocks(dst, DST_IDS[:3]), want[:, :, :3])
        assert not _blocks(dst, DST_IDS[3:]).any()  # nothing after the gap was written
        _wait(lambda: bool(log.events("write_back")))
        (wb,) = log.events("write_back")
        assert wb["kept"] == 3 and wb["discarded"] == N - 4
        status = client.status()["l2"]["tiers"]["disk"]
        assert status["corrupt_objects"] == 1 and status["load_failures"] == 1
        # the corrupt object is gone: the lookup now stops before it, the server serves on
        assert client.lookup(T, model_name="m", prefetch=False) == 3 * CHUNK
        _wait(w.settled)


def test_a_second_server_on_the_same_disk_path_is_refused(tmp_path: Path) -> None:
    """Two servers never share a disk path: the second exits 2 naming --l2-disk and the
    holder, and the first keeps serving."""
    disk = tmp_path / "disk"
    with _server(tmp_path, disk, "holder") as (client, _):
        holder = client.status()["server"]["pid"]
        second = kvflow_run(
            ["server", "--port", "0", "--prometheus-port", "0", "--l2-disk", str(disk)]
        )
        assert second.returncode == 2
        assert "--l2-disk" in second.stderr and str(holder) in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1
        assert client.lookup(T, model_name="m") == 0  # still serving


def test_a_server_killed_mid_write_serves_only_whole_objects(tmp_path: Path) -> None:
    """SIGKILL while write-through runs: the restarted server finds only whole objects,
    and whatever prefix it reports comes back bit-exact."""
    disk = tmp_path / "disk"
    src, dst = _caches(1), _caches(2)
    with _server(tmp_path, disk, "killed") as (client, _):
        Worker(client, src, dst)
        pid = client.status()["server"]["pid"]
        for i in range(16):  # many writes in flight, then the kill
            tokens = np.arange(i * 10_000, i * 10_000 + N * CHUNK, dtype=np.int32)
            client.store("src", tokens, SRC_IDS, request_id=f"w{i}")
        os.kill(pid, signal.SIGKILL)
    with _server(tmp_path, disk, "restarted") as (client, _):
        w = Worker(client, src, dst)
        assert not list(disk.rglob("*.tmp"))  # a dead writer's temporary files are swept
        for i in range(16):
            tokens = np.arange(i * 10_000, i * 10_000 + N * CHUNK, dtype=np.int32)
            for layer in dst:
                layer.zero_()
            hit = client.retrieve("dst", tokens, DST_IDS, request_id=f"r{i}")
            n = hit // CHUNK
            assert torch.equal(_blocks(dst, DST_IDS[:n]), _blocks(src, SRC_IDS[:n]))
            assert not _blocks(dst, DST_IDS[n:]).any()
        _wait(w.settled)
        assert client.status()["l2"]["tiers"]["disk"]["load_failures"] == 0
