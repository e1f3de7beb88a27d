"""GPU: a blend retrieve into CUDA caches (segment bytes staged to the GPU, indexed token
writes and the K re-rotation kernel on the mover's kernel stream) gives what the CPU
path gives: V bit-exact, K equal to K computed at the new position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.kernels import cuda_available
from tests.support.blend import ROPE, VOCAB, Model, untouched
from tests.support.engine import BLOCK, CHUNK, small_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda"),
]


def test_documents_blend_into_cuda_caches(cuda_device: torch.device) -> None:
    engine, _ = small_engine(l1_bytes=4 << 20)
    model = Model(alloc=lambda shape: torch.zeros(shape, device=cuda_device))
    rng = np.random.default_rng(2)
    system, doc_a, doc_b = (
        rng.integers(0, VOCAB, n).astype(np.int32) for n in (CHUNK, 3 * CHUNK, 2 * CHUNK)
    )
    stored = np.concatenate([system, doc_a, doc_b])
    src = model.caches()
    model.write(src, stored, list(range(len(stored) // BLOCK)))
    engine.register_kv_caches("src", src, model_name="m", block_size=BLOCK, ropes=ROPE)
    assert engine.store("src", stored, list(range(len(stored) // BLOCK)), request_id="s")
    question = np.array([5, 6, 7, 8, 9], dtype=np.int32)  # every segment lands inside blocks
    prompt = np.concatenate([system, question, doc_b, question[:2], doc_a, question])
    hit = engine.blend_lookup(prompt, model_name="m", request_id="q")
    assert hit.prefix_tokens == CHUNK and hit.blended_tokens == 5 * CHUNK
    dst = model.caches()
    before = [c.cpu() for c in dst]
    blocks = list(range(8, 8 + -(-len(prompt) // BLOCK)))
    engine.register_kv_caches("dst", dst, model_name="m", block_size=BLOCK, ropes=ROPE)
    blended = engine.blend_retrieve("dst", prompt, blocks, hit.segments, request_id="q")
    assert blended == (5 * CHUNK, ())
    after = [c.cpu() for c in dst]
    written = model.check_blended(after, prompt, blocks, hit.segments)
    assert untouched(after, before, written)
    engine.close()
