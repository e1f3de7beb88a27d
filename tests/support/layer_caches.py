"""Small vLLM flash-attention caches in shared memory for layerwise tests through a real
server: NL layers of [2, NB, BS, NH, HS] fp16, random by seed."""

from __future__ import annotations

import torch

from kvflow.core import empty_shared

NL, NB, BS, NH, HS = 6, 64, 16, 2, 8
#: the chunk size the layerwise tests' servers run with (two blocks a chunk)
CHUNK = 32


def shared_caches(seed: int) -> list[torch.Tensor]:
    """NL random layers in shared memory (the same for the same seed)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(NL):
        t = empty_shared((2, NB, BS, NH, HS), torch.float16)
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(torch.float16))
        layers.append(t)
    return layers


def layer_blocks(caches: list[torch.Tensor], layer: int, blocks: list[int]) -> torch.Tensor:
    """A copy of `blocks` of one layer, K and V."""
    return caches[layer][:, blocks].clone()
