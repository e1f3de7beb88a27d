"""Blend through the engine: documents stored in one order are found in another and
copied to their new positions, K turned so that it equals K computed there.

The check needs no model: K in a cache is RoPE(k_raw, position). The test writes K for
known raw vectors at the stored positions, blends, and compares the blocks with K
computed directly at the new positions (float32 caches: within float32 rounding of one
rotation), V bit-exact."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core.errors import InvalidRequestError
from kvflow.events import EventType
from tests.support.blend import ROPE, Model, store_docs, untouched
from tests.support.engine import BLOCK, CHUNK, events_of, pairs, small_engine


def _setup(**engine_kw: Any) -> tuple[Any, Any, Model, np.ndarray, np.ndarray, np.ndarray]:
    engine, recorder = small_engine(**engine_kw)
    model = Model()
    return engine, recorder, model, *store_docs(engine, model, "m")


def test_documents_blend_at_new_offsets_inside_blocks() -> None:
    engine, recorder, model, system, doc_a, doc_b = _setup()
    question = np.array([7, 8, 9], dtype=np.int32)  # shifts both documents off block bounds
    prompt = np.concatenate([system, question, doc_b, doc_a, question])
    hit = engine.blend_lookup(prompt, model_name="m", request_id="q")
    assert hit.prefix_tokens == CHUNK
    b_at, a_at = CHUNK + 3, CHUNK + 3 + CHUNK
    assert [(s.offset, s.original_start) for s in hit.segments] == [
        (b_at, 3 * CHUNK), (a_at, CHUNK), (a_at + CHUNK, 2 * CHUNK),
    ]  # fmt: skip
    dst = model.caches()
    before = [c.clone() for c in dst]
    dst_blocks = list(range(10, 10 + -(-len(prompt) // BLOCK)))
    engine.register_kv_caches("dst", dst, model_name="m", block_size=BLOCK, ropes=ROPE)
    blended = engine.blend_retrieve("dst", prompt, dst_blocks, hit.segments, request_id="q")
    assert blended.tokens == hit.blended_tokens == 3 * CHUNK and blended.skipped == ()
    written = model.check_blended(dst, prompt, dst_blocks, hit.segments)
    assert untouched(dst, before, written), "a slot outside the segments was written"
    events = events_of(recorder, engine)
    blend = [(s, e) for s, e in pairs(events) if s.type is EventType.BLEND_RETRIEVE_START]
    assert len(blend) == 1 and blend[0][1].attrs["blended_tokens"] == 3 * CHUNK
    reads = [e for e in events if e.type is EventType.L1_READ and e.session_id == "q"]
    assert [e.attrs["chunks"] for e in reads] == [3], "a blend's copies are L1 reads too"
    lookups = [(s, e) for s, e in pairs(events) if s.type is EventType.BLEND_LOOKUP_START]
    assert lookups[0][1].attrs["blend_hit_tokens"] == 3 * CHUNK
    assert lookups[0][1].attrs["blend_hit_tokens_by_tier"] == {"l1": 3 * CHUNK}


def test_isolation_missing_ropes_lies_and_forgotten_chunks() -> None:
    engine, _, model, system, doc_a, doc_b = _setup()
    prompt = np.concatenate([doc_b, system[:3], doc_a])
    assert engine.blend_lookup(prompt, model_name="other").segments == []
    assert engine.blend_lookup(prompt, model_name="m", cache_salt="tenant").segments == []
    hit = engine.blend_lookup(prompt, model_name="m")
    assert hit.prefix_tokens == 0 and len(hit.segments) == 3
    blocks = list(range(20, 20 + -(-len(prompt) // BLOCK)))
    engine.register_kv_caches("plain", model.caches(), model_name="m", block_size=BLOCK)
    with pytest.raises(InvalidRequestError, match="registered no rotary parameters"):
        engine.blend_retrieve("plain", prompt, blocks, hit.segments, request_id="r")
    dst = model.caches()
    engine.register_kv_caches("dst", dst, model_name="m", block_size=BLOCK, ropes=ROPE)
    lie = [(hit.segments[0].offset + 1, hit.segments[0].chunk_hash, 0)]
    with pytest.raises(InvalidRequestError, match="not those of stored chunk"):
        engine.blend_retrieve("dst", prompt, blocks, lie, request_id="r")
    with pytest.raises(InvalidRequestError, match="overlap"):
        twice = [hit.segments[0], hit.segments[0]]
        engine.blend_retrieve("dst", prompt, blocks, twice, request_id="r")
    with pytest.raises(InvalidRequestError, match="past the prompt"):
        engine.blend_retrieve("dst", prompt, blocks[:2], hit.segments, request_id="r")
    assert all(torch.count_nonzero(c) == 0 for c in dst), "a refused blend wrote something"


def test_a_segment_no_tier_holds_any_more_is_skipped_and_named() -> None:
    """Objects dropped between the lookup and the retrieve: their segments are reported
    by prompt offset (the engine recomputes them), the rest are copied, and the skipped
    slots are left as they were."""
    engine, _, model, system, doc_a, doc_b = _setup()
    prompt = np.concatenate([system, doc_b, doc_a])
    hit = engine.blend_lookup(prompt, model_name="m")
    assert len(hit.segments) == 3
    gone = hit.segments[1]
    assert engine.l1.drop_where(lambda key: key.chunk_hash == gone.chunk_hash) == 1
    dst = model.caches()
    engine.register_kv_caches("dst", dst, model_name="m", block_size=BLOCK, ropes=ROPE)
    blocks = list(range(10, 10 + -(-len(prompt) // BLOCK)))
    got = engine.blend_retrieve("dst", prompt, blocks, hit.segments, request_id="q")
    assert got == (2 * CHUNK, (gone.offset,))
    kept = [s for s in hit.segments if s is not gone]
    written = model.check_blended(dst, prompt, blocks, kept)
    assert untouched(dst, [torch.zeros_like(c) for c in dst], written)
