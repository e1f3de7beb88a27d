"""Which pages a rank may share: model name, world size and rank from SGLang's storage config.

kvflow's object key is (chunk key, model name, world size, rank, salt) (docs/ENGINE.md).
An MHA rank holds its own heads, so every tensor-parallel rank of every pipeline stage
and context-parallel rank is a rank of its own; MLA KV is replicated over tensor
parallelism (`HiCacheStorageConfig.is_storage_writer`: one rank writes, every rank
reads), so MLA ranks differ only by stage, context-parallel and decode-context-parallel
shard. Data-parallel replicas run the same weights and share.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from kvflow.integrations.sglang.config import StorageConfig


@dataclass(frozen=True)
class RankIdentity:
    """This rank's place in kvflow's keys and the instance id it registers as."""

    model_name: str
    world_size: int
    rank: int
    instance_id: str


def rank_identity(
    storage: Any, config: StorageConfig, dtype: torch.dtype, is_mla: bool
) -> RankIdentity:
    """The identity of the rank `storage` (a HiCacheStorageConfig) describes."""
    tp, tp_rank = int(storage.tp_size), int(storage.tp_rank)
    pp, pp_rank = int(storage.pp_size), int(storage.pp_rank)
    cp, cp_rank = int(storage.attn_cp_size), int(storage.attn_cp_rank)
    dcp, dcp_rank = int(getattr(storage, "dcp_size", 1)), int(getattr(storage, "dcp_rank", 0))
    stage = pp_rank * cp + cp_rank
    if is_mla:
        world, rank = pp * cp * dcp, stage * dcp + dcp_rank
    else:
        world, rank = pp * cp * tp, stage * tp + tp_rank
    kind = "mla" if is_mla else "mha"
    dtype_name = str(dtype).removeprefix("torch.")
    model = config.model_name or f"sglang:{storage.model_name or 'model'}:{dtype_name}:{kind}"
    dp_rank = int(getattr(storage, "dp_rank", 0))
    instance = (
        f"{config.instance_id}-dp{dp_rank}-pp{pp_rank}-cp{cp_rank}-tp{tp_rank}"
        f"-{os.getpid()}-{secrets.token_hex(3)}"
    )
    return RankIdentity(model, world, rank, instance)
