"""Layerwise retrieves on CPU caches: each layer lands whole, in order, before its signal."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.errors import InvalidRequestError
from kvflow.events import EventType
from tests.support.engine import (
    BLOCK,
    CHUNK,
    ToldSignal,
    block_bytes,
    caches,
    events_of,
    small_engine,
)

TOKENS = np.arange(100, 100 + 3 * CHUNK + 3, dtype=np.int32)  # 3 full chunks + a partial one
SRC_BLOCKS = [5, 2, 9, 0, 14, 7, 3]
DST_BLOCKS = [1, 11, 4, 13, 6, 8, 10]
TWO_GROUPS = [(2, 8, torch.bfloat16), (1, 12, torch.float32), (2, 8, torch.bfloat16)]


def _layer_block(kv_caches: Any, layer: int, block: int) -> torch.Tensor:
    """Block `block` of one layer of flash-attn caches ([2, blocks, block_size, heads, size])."""
    return kv_caches[layer][:, block].contiguous().view(torch.uint8).clone()


class Recorder:
    """A LayerSignal that checks, at each layer's signal, which layers hold the source's
    KV: exactly the layers signalled so far (the copies run layer by layer, in order)."""

    def __init__(self, src: Any, dst: Any, blocks: list[int], src_blocks: list[int]) -> None:
        self.src, self.dst = src, dst
        self.pairs = list(zip(blocks, src_blocks, strict=True))
        self.ready_layers: list[int] = []
        self.failed_from: int | None = None
        self.streams: list[Any] = []

    def _landed(self, layer: int) -> bool:
        return all(
            torch.equal(_layer_block(self.dst, layer, d), _layer_block(self.src, layer, s))
            for d, s in self.pairs
        )

    def ready(self, layer: int, stream: Any) -> None:
        self.streams.append(stream)
        if self.pairs:
            assert self._landed(layer), f"layer {layer} signalled before its blocks landed"
            later = range(layer + 1, len(self.dst))
            assert not any(self._landed(i) for i in later), f"layers after {layer} landed early"
        self.ready_layers.append(layer)

    def failed(self, first_layer: int) -> None:
        self.failed_from = first_layer


def _pair(**kw: Any) -> tuple[Any, Any, Any, dict[str, Any], Any, dict[str, Any]]:
    """An engine with instances src and dst of one model (caches as `kw` says):
    (engine, its recorder, src caches, their kwargs, dst caches, their kwargs)."""
    engine, recorder = small_engine()
    src, src_kw = caches("vllm_flash_attn", seed=1, **kw)
    dst, dst_kw = caches("vllm_flash_attn", seed=2, **kw)
    engine.register_kv_caches("src", src, model_name="m", **src_kw)
    engine.register_kv_caches("dst", dst, model_name="m", **dst_kw)
    return engine, recorder, src, src_kw, dst, dst_kw


@pytest.mark.parametrize("specs", [None, TWO_GROUPS], ids=["one-group", "two-groups"])
def test_layers_land_in_order_each_before_its_signal(specs: Any) -> None:
    """Every layer of the hit is written before its signal and none after it early."""
    kw: dict[str, Any] = {"layer_specs": specs} if specs else {}
    engine, recorder, src, src_kw, dst, dst_kw = _pair(**kw)
    assert engine.store("src", TOKENS, SRC_BLOCKS, request_id="w") == 3 * CHUNK
    before = block_bytes(dst, dst_kw, DST_BLOCKS)
    signal = Recorder(src, dst, DST_BLOCKS[:6], SRC_BLOCKS[:6])
    got = engine.retrieve("dst", TOKENS, DST_BLOCKS, request_id="r", layers=signal)
    assert got == 3 * CHUNK
    assert signal.ready_layers == list(range(len(dst)))
    assert signal.streams == [None] * len(dst)  # CPU: done when signalled
    after = block_bytes(dst, dst_kw, DST_BLOCKS)
    assert torch.equal(after[:6], block_bytes(src, src_kw, SRC_BLOCKS)[:6])
    assert torch.equal(after[6], before[6])  # the partial chunk's block is never written
    ends = [e for e in events_of(recorder, engine) if e.type is EventType.RETRIEVE_END]
    assert len(ends) == 1 and ends[0].attrs["layerwise"] is True
    assert ends[0].attrs["hit_tokens"] == 3 * CHUNK
    engine.close()


def test_skipped_blocks_stay_untouched_and_a_miss_signals_every_layer() -> None:
    """skip_first_n_tokens leaves those blocks alone; a miss still signals each layer."""
    engine, _, src, src_kw, dst, dst_kw = _pair()
    engine.store("src", TOKENS, SRC_BLOCKS, request_id="w")
    before = block_bytes(dst, dst_kw, DST_BLOCKS)
    signal = Recorder(src, dst, DST_BLOCKS[3:6], SRC_BLOCKS[3:6])
    skip = 3 * BLOCK
    got = engine.retrieve(
        "dst", TOKENS, DST_BLOCKS, request_id="r", skip_first_n_tokens=skip, layers=signal
    )
    assert got == 3 * CHUNK
    after = block_bytes(dst, dst_kw, DST_BLOCKS)
    assert torch.equal(after[:3], before[:3])
    assert torch.equal(after[3:6], block_bytes(src, src_kw, SRC_BLOCKS)[3:6])
    other = np.arange(500, 500 + 2 * CHUNK, dtype=np.int32)
    miss = Recorder(src, dst, [], [])
    assert engine.retrieve("dst", other, DST_BLOCKS[:4], request_id="m", layers=miss) == 0
    assert miss.ready_layers == list(range(len(dst)))
    engine.close()


def test_a_bad_block_id_fails_before_any_layer_and_writes_nothing() -> None:
    """A repeated block id is refused with a clear error; no layer is written or signalled."""
    engine, _, src, _, dst, dst_kw = _pair()
    engine.store("src", TOKENS, SRC_BLOCKS, request_id="w")
    before = block_bytes(dst, dst_kw, DST_BLOCKS)
    signal = Recorder(src, dst, [], [])
    bad = [1, 11, 4, 4, 6, 8, 10]
    with pytest.raises(InvalidRequestError, match="block"):
        engine.retrieve("dst", TOKENS, bad, request_id="r", layers=signal)
    assert signal.ready_layers == [] and signal.failed_from == 0
    assert torch.equal(block_bytes(dst, dst_kw, DST_BLOCKS), before)
    assert engine.retrieve("dst", TOKENS, DST_BLOCKS, request_id="r2") == 3 * CHUNK
    engine.close()


class Forward:
    """A WrittenSignal playing the forward pass: when the store asks for layer i it first
    writes layer i's KV into the source blocks, as a layer's attention would just before
    its mark, and records the order it was asked in."""

    def __init__(self, caches: Any, blocks: list[int], seed: int) -> None:
        self.caches, self.blocks = caches, blocks
        gen = torch.Generator().manual_seed(seed)
        self.kv = [torch.randn(c[:, blocks].shape, generator=gen).to(c.dtype) for c in caches]
        self.asked: list[int] = []

    def wait_written(self, layer: int, stream: Any) -> None:
        assert stream is None  # CPU caches
        self.caches[layer][:, self.blocks] = self.kv[layer]
        self.asked.append(layer)


def test_a_layerwise_store_takes_each_layer_as_written() -> None:
    """Each layer is read after its signal returned (the data written at that moment is
    what was stored), in order; the chunks read back bit-exact; END says layerwise."""
    engine, recorder, src, _, dst, _ = _pair()
    forward = Forward(src, SRC_BLOCKS[:6], seed=3)
    assert engine.store("src", TOKENS, SRC_BLOCKS, request_id="w", layers=forward) == 3 * CHUNK
    assert forward.asked == list(range(len(src)))
    assert engine.retrieve("dst", TOKENS, DST_BLOCKS, request_id="r") == 3 * CHUNK
    for layer in range(len(src)):
        assert torch.equal(dst[layer][:, DST_BLOCKS[:6]], forward.kv[layer])
    ends = [e for e in events_of(recorder, engine) if e.type is EventType.STORE_END]
    assert ends[0].attrs["layerwise"] is True and ends[0].attrs["held_tokens"] == 3 * CHUNK
    engine.close()


def test_a_layerwise_store_that_fails_midway_leaves_nothing_visible() -> None:
    """An engine that never marks layer 1: the store fails, no chunk is visible, and a
    plain store of the same request works afterwards."""
    engine, _ = small_engine()
    src, src_kw = caches("vllm_flash_attn", seed=1)
    engine.register_kv_caches("src", src, model_name="m", **src_kw)

    class Dies:
        def wait_written(self, layer: int, stream: Any) -> None:
            if layer == 1:
                raise TimeoutError("layer 1 was not marked")

    with pytest.raises(Exception, match="layer 1"):
        engine.store("src", TOKENS, SRC_BLOCKS, request_id="w", layers=Dies())
    assert engine.lookup(TOKENS, model_name="m") == 0
    assert engine.store("src", TOKENS, SRC_BLOCKS, request_id="w2") == 3 * CHUNK
    engine.close()


def test_a_slot_takes_a_growing_span_of_layers_that_lie_together() -> None:
    """`stage_span`: the first layers alone, then as many as the slot takes, at most the
    layer's index; never a layer past a group's end, past the last layer or one the ring
    does not take (it goes straight into its blocks); 0 when not even one fits."""
    from kvflow.core.engine.layerwise import stage_span
    from kvflow.kernels import KVFormat, KVLayout
    from kvflow.kernels.synthetic import make_kv_caches

    kv, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_layers=8, num_blocks=8)
    layout = KVLayout.from_kv_caches(kv, **kw)
    tokens = 2 * layout.block_size
    width = sum(n for _, n in layout.layer_parts(0, tokens))
    every = lambda _: True  # noqa: E731
    spans = [stage_span(layout, layer, 3, tokens, 4 * 3 * width, every) for layer in range(8)]
    assert spans == [1, 1, 2, 3, 4, 3, 2, 1]
    assert stage_span(layout, 4, 3, tokens, 4 * 3 * width - 1, every) == 3  # 3 fit
    assert stage_span(layout, 4, 3, tokens, 3 * width - 1, every) == 0
    assert stage_span(layout, 4, 3, tokens, 4 * 3 * width, lambda layer: layer != 6) == 2
    specs = [(2, 8, torch.float16)] * 3 + [(1, 8, torch.float16)] * 3
    mixed, kw = make_kv_caches(KVFormat.VLLM_FLASHINFER, layer_specs=specs)
    layout = KVLayout.from_kv_caches(mixed, **kw)
    tokens = layout.block_size
    assert stage_span(layout, 2, 1, tokens, 1 << 20, every) == 1  # the group ends at 2
    assert stage_span(layout, 3, 1, tokens, 1 << 20, every) == 3


def test_on_cpu_the_reply_goes_before_the_copies() -> None:
    """CPU caches are copied on the thread that serves the retrieve: the reply goes first
    (with the hit), so the engine reads it while the layers are copied."""
    engine, _, _, _, _, _ = _pair()
    engine.store("src", TOKENS, SRC_BLOCKS, request_id="w")
    told = ToldSignal()
    got = engine.retrieve(
        "dst", TOKENS, DST_BLOCKS, request_id="r", layers=told, enqueued=told.enqueued
    )
    assert got == 3 * CHUNK
    assert told.log == [f"reply {3 * CHUNK}", "layer 0", "layer 1"]
    engine.close()
