"""The L2 tiers a ServerConfig names (`--l2-disk`, `--l2-redis`), built for the engine.

A tier's module is imported only when the config names it, so an L1-only engine never
loads the disk or Redis code.
"""

from __future__ import annotations

import torch

from kvflow.core.config import ServerConfig
from kvflow.core.tiers.base import StorageTier
from kvflow.kernels import cuda_available

GIB = 1 << 30


def gpu_count() -> int:
    """GPUs the disk tier's by_gpu sharding spreads over (a GPU-less host counts one)."""
    return max(1, torch.cuda.device_count()) if cuda_available() else 1


def build_l2(config: ServerConfig) -> list[StorageTier]:
    """The L2 tiers the config names, in order: disk, then Redis (none: L1 only).

    A tier that fails to start closes the ones built before it (a disk tier holds its
    directories' locks).
    """
    tiers: list[StorageTier] = []
    try:
        if config.l2_disk_paths:
            from kvflow.core.tiers.disk import DiskTier

            tiers.append(
                DiskTier(
                    config.l2_disk_paths,
                    int(config.l2_disk_size_gb * GIB),
                    num_gpus=gpu_count(),
                    direct_io=config.l2_disk_direct_io,
                )
            )
        if config.l2_redis_url is not None:
            from kvflow.core.tiers.redis import RedisTier
            from kvflow.core.tiers.redis_target import resolve_target

            target = resolve_target(
                config.l2_redis_url,
                username=config.l2_redis_username,
                password=config.l2_redis_password,
            )
            tiers.append(
                RedisTier(
                    target,
                    cluster=config.l2_redis_cluster,
                    key_prefix=config.l2_redis_key_prefix,
                    timeout_s=config.l2_redis_timeout_s,
                    pool_size=config.l2_redis_pool_size,
                )
            )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
