"""Blend on a CPU engine, for the observability tests of blend (metrics, logs, spans,
`kvflow top` / `kvflow report`, the event log and its replay).

`stored_docs` stores a system prompt and two documents (`tests.support.blend.store_docs`,
as the engine's blend tests do) and registers `dst`; `blend_once` asks for them in another order behind the system
prompt and a question, so a blend lookup finds the system prompt as its prefix and both
documents past it, at offsets inside blocks, and a blend retrieve copies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from kvflow.core.engine.blend_index import BlendSegment
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.errors import InvalidRequestError
from tests.support.blend import ROPE, Model, store_docs
from tests.support.engine import BLOCK, CHUNK

#: bytes of one chunk object of Model's caches: layers x K|V x tokens x heads x head x f32
CHUNK_BYTES = 2 * 2 * CHUNK * 2 * 8 * 4
MODEL = "m"


@dataclass
class Docs:
    """The system prompt and documents `stored_docs` stored."""

    system: np.ndarray
    doc_a: np.ndarray
    doc_b: np.ndarray


@dataclass
class Blended:
    """One blend: the prompt, its prefix hit, the segments and tokens found past it, the
    tokens copied, and the prompt's blocks in `dst`."""

    prompt: np.ndarray
    prefix_tokens: int
    segments: list[BlendSegment]
    hit_tokens: int
    blended_tokens: int
    blocks: list[int]

    def lie(self) -> list[tuple[int, bytes, int]]:
        """A segment whose prompt tokens are not its chunk's: a blend retrieve refuses it."""
        first = self.segments[0]
        return [(first.offset + 1, first.chunk_hash, 0)]


def stored_docs(engine: CacheEngine) -> Docs:
    """Store a system prompt (one chunk), document A (two) and B (one) from a `src`
    instance of model MODEL, and register a `dst` instance to blend into."""
    model = Model()
    docs = Docs(*store_docs(engine, model, MODEL))
    engine.register_kv_caches("dst", model.caches(), model_name=MODEL, block_size=BLOCK, ropes=ROPE)
    return docs


def blend_once(
    engine: CacheEngine, docs: Docs, request_id: str = "q", *, prefetch: bool = True
) -> Blended:
    """Blend lookup and blend retrieve of: the system prompt, a 3-token question, document
    B, document A, the question again (3 chunks found past the one-chunk prefix)."""
    question = np.array([7, 8, 9], dtype=np.int32)
    prompt = np.concatenate([docs.system, question, docs.doc_b, docs.doc_a, question])
    hit = engine.blend_lookup(prompt, model_name=MODEL, request_id=request_id, prefetch=prefetch)
    blocks = list(range(10, 10 + -(-len(prompt) // BLOCK)))
    blended = engine.blend_retrieve("dst", prompt, blocks, hit.segments, request_id=request_id)
    return Blended(
        prompt, hit.prefix_tokens, list(hit.segments), hit.blended_tokens, blended.tokens, blocks
    )


def refused_blend(engine: CacheEngine, run: Blended, request_id: str = "bad") -> None:
    """A blend retrieve of `run.lie()`, which the engine refuses before writing anything."""
    with pytest.raises(InvalidRequestError, match="not those of stored chunk"):
        engine.blend_retrieve("dst", run.prompt, run.blocks, run.lie(), request_id=request_id)
