"""Registered instances: their metadata, layout, chunk geometry and mover."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.core.engine.movers import Mover
from kvflow.kernels import KVLayout
from kvflow.kernels.rope_params import LayerRopes

#: (model_name, world_size, rank): the owner of a layout desc and of L1 objects.
ModelRank = tuple[str, int, int]
LayoutDesc = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass(eq=False)
class Instance:
    """One registered set of KV tensors; `lock` orders its transfers."""

    instance_id: str
    model_name: str
    world_size: int
    rank: int
    layout: KVLayout
    chunk_size: int
    layout_desc: LayoutDesc
    chunk_nbytes: int
    mover: Mover
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the model's rotary embedding per layer, which blend retrieves turn K with
    ropes: LayerRopes | None = None

    @property
    def model_rank(self) -> ModelRank:
        return (self.model_name, self.world_size, self.rank)

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.layout.block_size

    def event_attrs(self) -> dict[str, Any]:
        """REGISTER / UNREGISTER attrs (docs/EVENTS.md)."""
        layout = self.layout
        return {
            "instance_id": self.instance_id,
            "model_name": self.model_name,
            "world_size": self.world_size,
            "rank": self.rank,
            "kv_format": layout.format.value,
            "num_layers": layout.num_layers,
            "num_blocks": layout.num_blocks,
            "block_size": layout.block_size,
        }

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable summary for `status()`."""
        return {
            **self.event_attrs(),
            "device": str(self.layout.device),
            "chunk_nbytes": self.chunk_nbytes,
            "layer_groups": [
                {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
                for shape, dtype in self.layout_desc
            ],
        }
