"""Blend checks that need no model: K in a cache is RoPE(k_raw, position).

`Model` holds raw K and V per token id (what a first layer's projections give) and
writes caches as a forward pass would at given positions; `check_blended` compares
blended blocks with K computed directly at the new positions (float32 caches: within
float32 rounding of one rotation) and V bit for bit. The engine and server blend tests
share them; `store_docs` stores the documents they blend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvflow.core.engine.blend_index import BlendSegment
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.kernels.rope_params import RopeParams
from tests.support.engine import BLOCK, CHUNK

LAYERS, HEADS, HEAD = 2, 2, 8
VOCAB = 1000
ROPE = RopeParams(rotary_dim=HEAD, theta=10000.0)

#: makes a zeroed cache tensor of a shape (torch.zeros; kvflow.core.empty_shared for a server)
Alloc = Callable[[tuple[int, ...]], torch.Tensor]


def rotate(raw: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    """NeoX RoPE (ROPE's parameters) of raw [T, heads, head] at `positions`, in float64."""
    half = HEAD // 2
    inv = 1.0 / (ROPE.theta ** (np.arange(half, dtype=np.float64) * 2 / HEAD))
    angles = torch.from_numpy(np.outer(positions.astype(np.float64), inv))[:, None, :]
    x, y = raw[..., :half].double(), raw[..., half:].double()
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([x * cos - y * sin, y * cos + x * sin], dim=-1)


class Model:
    """Raw K and V per token id, and vllm_flash_attn caches (float32, LAYERS x [2, blocks,
    BLOCK, HEADS, HEAD]) written as a forward pass would write them."""

    def __init__(self, seed: int = 0, *, blocks: int = 40, alloc: Alloc | None = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.k_raw = torch.randn(VOCAB, LAYERS, HEADS, HEAD, generator=gen)
        self.v = torch.randn(VOCAB, LAYERS, HEADS, HEAD, generator=gen)
        self.blocks = blocks
        self._alloc: Alloc = alloc if alloc is not None else torch.zeros

    def caches(self) -> list[torch.Tensor]:
        """Zeroed caches of `blocks` blocks per layer."""
        shape = (2, self.blocks, BLOCK, HEADS, HEAD)
        return [self._alloc(shape).zero_() for _ in range(LAYERS)]

    def write(self, caches: list[torch.Tensor], tokens: np.ndarray, blocks: list[int]) -> None:
        """K and V of `tokens` at positions 0.. into `blocks`, as prefill writes them."""
        slots = np.arange(len(tokens))
        for layer in range(LAYERS):
            k = rotate(self.k_raw[tokens, layer], slots).float()
            for t in range(len(tokens)):
                b, o = blocks[t // BLOCK], t % BLOCK
                caches[layer][0, b, o] = k[t]
                caches[layer][1, b, o] = self.v[tokens[t], layer]

    def expected_k(self, tokens: np.ndarray, positions: np.ndarray, layer: int) -> torch.Tensor:
        """K of `tokens` computed directly at `positions` (float64)."""
        return rotate(self.k_raw[tokens, layer], positions)

    def check_blended(
        self,
        caches: list[torch.Tensor],
        prompt: np.ndarray,
        blocks: Sequence[int],
        segments: Sequence[BlendSegment],
        *,
        turned: Sequence[int] = tuple(range(LAYERS)),
    ) -> set[tuple[int, int]]:
        """Assert each segment's slots hold V bit-exact and K at its new position (layers
        not in `turned`, NoPE ones: K at the stored position, bit-exact); returns the
        (block, offset) slots the segments cover."""
        written = set()
        for s in segments:
            tokens = prompt[s.offset : s.offset + s.length]
            positions = np.arange(s.offset, s.offset + s.length)
            stored_at = np.arange(s.original_start, s.original_start + s.length)
            for layer in range(LAYERS):
                if layer in turned:
                    want_k = self.expected_k(tokens, positions, layer)
                else:
                    want_k = self.expected_k(tokens, stored_at, layer).float().double()
                for i, p in enumerate(positions):
                    b, o = blocks[p // BLOCK], p % BLOCK
                    written.add((b, o))
                    got_k = caches[layer][0, b, o].double()
                    tol = 2e-5 * (1 + float(want_k[i].abs().max())) if layer in turned else 0.0
                    assert torch.allclose(got_k, want_k[i], rtol=0, atol=tol), (layer, p)
                    assert torch.equal(caches[layer][1, b, o], self.v[tokens[i], layer])
        return written


def untouched(
    caches: list[torch.Tensor], before: list[torch.Tensor], written: set[tuple[int, int]]
) -> bool:
    """Whether every (block, offset) slot outside `written` kept its bytes."""
    for layer, old in zip(caches, before, strict=True):
        keep = torch.ones(layer.shape[1:3], dtype=torch.bool)
        for b, o in written:
            keep[b, o] = False
        if not torch.equal(layer[:, keep], old[:, keep]):
            return False
    return True


def store_docs(
    engine: CacheEngine, model: Model, model_name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Store a system prompt (one chunk), document A (two) and B (one), in that order,
    from a `src` instance of `model_name` with ropes registered; returns the three."""
    rng = np.random.default_rng(1)
    system, doc_a, doc_b = (
        rng.integers(0, VOCAB, n).astype(np.int32) for n in (CHUNK, 2 * CHUNK, CHUNK)
    )
    stored = np.concatenate([system, doc_a, doc_b])
    src = model.caches()
    src_blocks = list(range(len(stored) // BLOCK))
    model.write(src, stored, src_blocks)
    engine.register_kv_caches("src", src, model_name=model_name, block_size=BLOCK, ropes=ROPE)
    assert engine.store("src", stored, src_blocks, request_id="s") == len(stored)
    return system, doc_a, doc_b
