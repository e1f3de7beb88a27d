"""GPU: KV shared with a server process through CUDA IPC round-trips bit-exactly (skips on CPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.kernels import cuda_available

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_ipc_roundtrip.py"


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_cuda_ipc_round_trip_between_processes() -> None:
    """Three layouts, stored without synchronizing, retrieved into other blocks: exact."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--repeat", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_cuda_ipc_mappings_close_when_their_last_instance_goes() -> None:
    """Two instances over one allocation share one mapping in the server; unregistering
    one leaves the other working, unregistering both closes it at once (not at GC)."""
    import torch

    from kvflow.core import KVFlowClient
    from tests.core.server.test_server import ServerProcess

    srv = ServerProcess("--disable-observability")
    try:
        kv = torch.randn(2, 64, 16, 2, 64, device="cuda").half()  # one cudaMalloc allocation
        with KVFlowClient(srv.endpoint, timeout_s=60) as client:

            def mappings() -> int:
                return int(client.status()["server"]["cuda_ipc_mappings"])

            assert mappings() == 0
            client.register_kv_caches("a", [kv], model_name="m")
            client.register_kv_caches("b", [kv], model_name="m")
            assert mappings() == 1
            tokens = list(range(256))
            assert client.store("a", tokens, list(range(16)), request_id="s") == 256
            expected = kv[:, :16].clone()
            client.unregister("a")
            assert mappings() == 1  # "b" still views it
            assert client.retrieve("b", tokens, list(range(16, 32)), request_id="r") == 256
            torch.cuda.synchronize()
            assert torch.equal(kv[:, 16:32], expected)
            client.register_kv_caches("b", [kv], model_name="m")  # replace: reopen, release old
            assert mappings() == 1
            client.unregister("b")
            assert mappings() == 0
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_a_server_stopped_while_l1_is_pinned_ahead_exits_cleanly() -> None:
    """Stopped while its L1 is still being pinned (4 GiB: about a second), the server
    waits for the segment in flight and exits 0: a pinning thread left inside the
    driver's registration aborted the process at exit ("terminate called without an
    active exception", exit -6)."""
    from tests.core.server.test_server import ServerProcess

    srv = ServerProcess("--l1-size-gb", "4", "--disable-observability")
    assert srv.stop() == 0, "".join(srv.lines)
    assert not any("terminate called" in line for line in srv.lines), "".join(srv.lines)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_a_store_waits_for_the_writes_still_queued_on_the_callers_stream() -> None:
    """The KV a store reads is what the engine's stream wrote before the call, even when
    those writes still wait behind ~0.1 s of other work on the GPU."""
    import torch

    from kvflow.core import KVFlowClient
    from tests.core.server.test_server import ServerProcess

    srv = ServerProcess("--disable-observability")
    try:
        kv = torch.zeros(2, 64, 16, 2, 64, device="cuda", dtype=torch.float16)
        with KVFlowClient(srv.endpoint, timeout_s=60) as client:
            client.register_kv_caches("w", [kv], model_name="m")
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # the writes below queue behind this
            kv[:, :16].fill_(3.0)
            tokens = list(range(256))
            assert client.store("w", tokens, list(range(16)), request_id="s") == 256
            assert client.retrieve("w", tokens, list(range(16, 32)), request_id="r") == 256
            torch.cuda.synchronize()
            assert bool((kv[:, 16:32] == 3.0).all())
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
def test_a_store_returns_once_its_copies_ran_and_is_seen_by_the_next_lookup() -> None:
    """The server answers a store once its copies are queued; the client waits for them
    before returning, so the engine may overwrite the blocks at once (0.5 GiB in flight:
    a client that did not wait would have the fill below race the copies), and a lookup
    made right after counts every chunk (L1 commits the store at the first read after
    its copies, before the server's own wait for them returns)."""
    import torch

    from kvflow.core import KVFlowClient
    from tests.core.server.test_server import ServerProcess

    layers, blocks, block_size, stored = 16, 1100, 16, 512
    srv = ServerProcess("--disable-observability", "--l1-size-gb", "1.5")
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        caches = [
            torch.randn(2, blocks, block_size, 8, 128, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
            for _ in range(layers)
        ]  # fmt: skip
        src, dst = list(range(stored)), list(range(stored, 2 * stored))
        tokens = list(range(stored * block_size))
        with KVFlowClient(srv.endpoint, timeout_s=120) as client:
            client.register_kv_caches("e", caches, model_name="m")
            for round_ in range(3):
                want = [c[:, src].clone() for c in caches]
                torch.cuda.synchronize()
                ids = [t + round_ * len(tokens) for t in tokens]
                assert client.store("e", ids, src, request_id=f"s{round_}") == len(ids)
                assert client.lookup(ids, model_name="m") == len(ids)
                for c in caches:  # the engine reuses the blocks at once
                    c[:, src] = 0
                assert client.retrieve("e", ids, dst, request_id=f"r{round_}") == len(ids)
                torch.cuda.synchronize()
                for layer, (c, w) in enumerate(zip(caches, want, strict=True)):
                    assert torch.equal(c[:, dst], w), f"round {round_}: layer {layer} differs"
                for c in caches:
                    c[:, src] = torch.randn_like(c[:, src])
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
@pytest.mark.parametrize("op", ["store", "retrieve"])
def test_a_transfer_whose_server_dies_after_replying_ends_without_hanging(op: str) -> None:
    """The server is killed the moment it answered a 0.5 GiB store or retrieve (its copies
    queued, not done): the client's wait for them ends within its timeout, returning or
    raising, and neither it nor the engine's stream hangs on the dead server's event (a
    synchronize on it does, and so would a stream made to wait on it)."""
    import signal
    import threading
    import time

    import torch

    from kvflow.core import KVFlowClient
    from kvflow.core.errors import KVFlowError
    from tests.core.server.test_server import ServerProcess

    layers, blocks, block_size, moved = 16, 1100, 16, 512
    srv = ServerProcess("--disable-observability", "--l1-size-gb", "1")
    try:
        caches = [
            torch.randn(2, blocks, block_size, 8, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(layers)
        ]
        tokens = list(range(moved * block_size))
        with KVFlowClient(srv.endpoint, timeout_s=5) as client:
            client.register_kv_caches("k", caches, model_name="m")
            if op == "retrieve":
                assert client.store("k", tokens, list(range(moved)), request_id="s") == len(tokens)
            real_count = client._count

            def count_then_kill(*args: object, **kwargs: object) -> int:
                held = real_count(*args, **kwargs)  # type: ignore[arg-type]
                srv.proc.send_signal(signal.SIGKILL)
                return held

            client._count = count_then_kill  # type: ignore[method-assign]
            torch.cuda.synchronize()
            ended: list[str] = []

            def transfer() -> None:
                try:
                    if op == "store":
                        client.store("k", tokens, list(range(moved)), request_id="s")
                    else:
                        client.retrieve("k", tokens, list(range(moved, 2 * moved)), request_id="r")
                    torch.cuda.current_stream().synchronize()  # the engine's next work runs
                    ended.append("returned")
                except KVFlowError as exc:
                    ended.append(type(exc).__name__)

            waiter = threading.Thread(target=transfer, daemon=True)
            began = time.monotonic()
            waiter.start()
            waiter.join(5 + 10)
            assert not waiter.is_alive(), f"the {op} still waits for a dead server's copies"
            assert ended and time.monotonic() - began < 5 + 10, ended
    finally:
        srv.stop(signal.SIGKILL)
