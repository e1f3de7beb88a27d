"""GPU: layerwise retrieves and stores through a server process, each layer ordered by its
IPC event, on cuda:0 and (gpu2) on cuda:1 with cuda:0's context current."""

from __future__ import annotations

import pytest
import torch

from kvflow.kernels import cuda_available

NL, NB, BS, NH, HS = 16, 1200, 16, 8, 128  # ~1.3 GB of bf16 KV; a prefix of 512 blocks
CHUNK = 256
PREFIX_BLOCKS = 512


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
@pytest.mark.parametrize("order", ["in-order", "shuffled", "staged", "staged-spans"])
def test_each_layer_is_read_only_after_its_copy(
    order: str, cuda_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads queued after `wait_layer(i)` see layer i whole (0.5 GiB in flight, so the last
    layers land tens of ms after the reply); the same reads queued without the waits,
    right after the call returns, catch copies still in flight: the waits do the ordering.
    Destination blocks in order take the direct copies (each layer marked on the copy
    stream), shuffled ones the server's staging ring and the block kernel (the kernel
    stream), or ("staged") a ring of the engine's, scattered on the engine's own stream,
    ("staged-spans") with slots of four layers, most of them scattered in spans: the
    engine's stream then waits once per span (layers 0, 1, 2-3, 4-7, 8-11, 12-15), not once
    per layer."""
    import random

    from kvflow.core import KVFlowClient
    from kvflow.cuda import DriverEvent
    from tests.core.server.test_server import ServerProcess

    srv = ServerProcess("--disable-observability", "--l1-size-gb", "1.5")
    try:
        gen = torch.Generator(device=cuda_device).manual_seed(0)
        caches = [
            torch.randn(2, NB, BS, NH, HS, device=cuda_device, generator=gen, dtype=torch.bfloat16)
            for _ in range(NL)
        ]
        src = list(range(PREFIX_BLOCKS))
        dst = list(range(PREFIX_BLOCKS, 2 * PREFIX_BLOCKS))
        if order != "in-order":
            dst = random.Random(0).sample(range(PREFIX_BLOCKS, NB), PREFIX_BLOCKS)
        tokens = list(range(PREFIX_BLOCKS * BS))
        layer_bytes = caches[0][:, src].numel() * caches[0].element_size()
        per_slot = {"staged": 1, "staged-spans": 4}.get(order, 0)
        ring = (
            {"staging_slots": 4, "staging_slot_bytes": per_slot * layer_bytes} if per_slot else {}
        )
        with KVFlowClient(srv.endpoint, timeout_s=120) as client:
            client.register_kv_caches("lw", caches, model_name="m", layerwise=True, **ring)
            assert client.store("lw", tokens, src, request_id="s") == len(tokens)
            want = [c[:, src].clone() for c in caches]
            stream_waits: list[int] = []  # the streams made to wait for an event
            real_wait, real_driver_wait = torch.cuda.Stream.wait_event, DriverEvent.wait_on

            def counted(stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
                stream_waits.append(stream.cuda_stream)
                real_wait(stream, event)

            def counted_raw(event: DriverEvent, stream: int) -> None:
                stream_waits.append(stream)
                real_driver_wait(event, stream)

            for waits in (True, False):
                for c in caches:
                    c[:, dst] = 0
                torch.cuda.synchronize(cuda_device)
                stream_waits.clear()
                monkeypatch.setattr(torch.cuda.Stream, "wait_event", counted)
                monkeypatch.setattr(DriverEvent, "wait_on", counted_raw)
                load = client.retrieve_layerwise("lw", tokens, dst, request_id=f"r{waits}")
                assert load.hit_tokens == len(tokens)
                seen = []
                for layer in range(NL):
                    if waits:
                        load.wait_layer(layer)
                    seen.append(caches[layer][:, dst].clone())
                torch.cuda.synchronize(cuda_device)
                equal = [torch.equal(s, w) for s, w in zip(seen, want, strict=True)]
                monkeypatch.undo()
                if waits:
                    if per_slot:  # the engine's stream waits once per scatter
                        engine_stream = torch.cuda.current_stream(cuda_device).cuda_stream
                        scatters = NL if per_slot == 1 else 6
                        assert stream_waits.count(engine_stream) == scatters, stream_waits
                    assert all(equal), (
                        f"layers read early: {[i for i, e in enumerate(equal) if not e]}"
                    )
                else:
                    assert not all(equal), "no copy was in flight: this test proves nothing here"
                load.wait()
                torch.cuda.synchronize(cuda_device)
                assert all(torch.equal(c[:, dst], w) for c, w in zip(caches, want, strict=True))
                assert load.staged_layers == (list(range(NL)) if ring else [])
    finally:
        assert srv.stop() == 0, "".join(srv.lines)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
@pytest.mark.parametrize("order", ["in-order", "shuffled"])
def test_a_layerwise_store_reads_each_layer_after_its_writes(
    order: str, cuda_device: torch.device
) -> None:
    """Each layer is written on the engine's stream behind a GPU sleep, then marked: the
    server's gather must wait for it on the GPU (its event), so what is stored is what
    the stream wrote, not what the blocks held when the mark was set on the host.
    Source blocks in order are copied straight to L1 (the copy stream waits), shuffled
    ones gathered by the block kernel (the kernel stream waits)."""
    import random

    from kvflow.core import KVFlowClient
    from tests.core.server.test_server import ServerProcess

    srv = ServerProcess("--disable-observability", "--l1-size-gb", "1.5")
    try:
        gen = torch.Generator(device=cuda_device).manual_seed(1)
        caches = [
            torch.zeros(2, NB, BS, NH, HS, device=cuda_device, dtype=torch.bfloat16)
            for _ in range(NL)
        ]
        src = list(range(PREFIX_BLOCKS))
        if order == "shuffled":
            src = random.Random(1).sample(src, PREFIX_BLOCKS)
        dst = list(range(PREFIX_BLOCKS, 2 * PREFIX_BLOCKS))
        tokens = list(range(PREFIX_BLOCKS * BS))
        want = [
            torch.randn(2, PREFIX_BLOCKS, BS, NH, HS, device=cuda_device, generator=gen,
                        dtype=torch.bfloat16)
            for _ in range(NL)
        ]  # fmt: skip
        torch.cuda.synchronize(cuda_device)
        with KVFlowClient(srv.endpoint, timeout_s=120) as client:
            client.register_kv_caches("lws", caches, model_name="m", layerwise=True)
            save = client.store_layerwise("lws", tokens, src, request_id="s")
            for layer in range(NL):
                with torch.cuda.device(cuda_device):
                    torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the layer's write
                caches[layer][:, src] = want[layer]
                save.layer_done(layer)
            assert save.wait(60) == len(tokens)
            assert client.retrieve("lws", tokens, dst, request_id="r") == len(tokens)
            torch.cuda.synchronize(cuda_device)
            bad = [i for i in range(NL) if not torch.equal(caches[i][:, dst], want[i])]
            assert not bad, f"layers stored before their writes: {bad}"
    finally:
        assert srv.stop() == 0, "".join(srv.lines)
