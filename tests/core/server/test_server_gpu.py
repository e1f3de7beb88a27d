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
