"""`KVFlowConnector`: vLLM's KV connector API (KVConnectorBase_V1) over a kvflow server.

This module imports vLLM; `kvflow.integrations.vllm` imports it only when vLLM asks
for the class. The logic lives in `scheduler.SchedulerSide` and `worker.WorkerSide`
(which need no vLLM); this is the thin adapter between them and vLLM's hooks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvflow.core import KVFlowClient
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.kv_events import (
    BlockEvent,
    BlocksStored,
    RankVotes,
    WorkerKVEvents,
)
from kvflow.integrations.vllm.plan import StepPlan
from kvflow.integrations.vllm.scheduler import SchedulerSide
from kvflow.integrations.vllm.shared_kv import SharedZeros
from kvflow.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvflow.integrations.vllm")


def _log_through_vllm() -> None:
    """Send this package's log lines to vLLM's handlers (vLLM configures only its own logger)."""
    ours = logging.getLogger("kvflow.integrations.vllm")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False


class KVFlowConnectorMetadata(KVConnectorMetadata):
    """One step's plan, sent by vLLM from the scheduler to every worker."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVFlowKVEvents(KVConnectorKVEvents):
    """One step's block events of the workers, as vLLM carries them to the scheduler
    (which keeps those every rank reported: RankVotes)."""

    def __init__(self, events: list[KVCacheEvent], workers: int = 1) -> None:
        self._events = events
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVFlowKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1


#: the counters KVFlowConnectorStats sums: scheduler lookups, worker loads and stores
STAT_KEYS = (
    "lookups", "hit_tokens", "loads", "loaded_tokens", "load_failed_blocks", "stores",
    "stored_tokens",
)  # fmt: skip


class KVFlowConnectorStats(KVConnectorStats):
    """Per-step counters for vLLM's connector metrics: the scheduler's lookups and hit
    tokens, the workers' loads and stores (summed over workers: each rank moves its shard)."""

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in STAT_KEYS:
            self.data[key] = self.data.get(key, 0) + int(other.data.get(key, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: int(self.data.get(key, 0)) for key in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.get(key, 0) for key in STAT_KEYS)


def _vllm_event(event: BlockEvent, block_size: int) -> KVCacheEvent:
    """vLLM's event for a block event (KV cache group 0: the connector serves one group)."""
    if isinstance(event, BlocksStored):
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=None,
            group_idx=0,
        )
    return BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium, group_idx=0)


def _kv_events_on(vllm_config: VllmConfig) -> bool:
    """Whether vLLM publishes KV events (--kv-events-config with enable_kv_cache_events)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and getattr(events, "enable_kv_cache_events", False))


def _block_hashes(request: Any, n: int) -> list[Any]:
    """vLLM's hashes of a request's first n blocks, as its own KV events publish them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in request.block_hashes[:n]]


def default_model_name(vllm_config: VllmConfig) -> str:
    """`<model>:<dtype>[:<kv cache dtype>]`: engines whose KV bytes differ never share keys."""
    model = vllm_config.model_config
    name = f"{model.model}:{str(model.dtype).removeprefix('torch.')}"
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    return name if cache_dtype == "auto" else f"{name}:{cache_dtype}"


def parallel_layout(vllm_config: VllmConfig) -> tuple[int, int]:
    """(world_size, rank) over tensor x pipeline parallelism; rank 0 outside a worker."""
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    pp = int(parallel.pipeline_parallel_size)
    rank = 0
    with contextlib.suppress(Exception):  # no process group: the scheduler, or a test
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        rank = get_pp_group().rank_in_group * tp + get_tp_group().rank_in_group
    return tp * pp, rank


class KVFlowConnector(KVConnectorBase_V1):
    """Loads prompt prefixes from a kvflow server and stores prompts' chunks into it.

    Configured by the `kvflow.*` keys of `kv_connector_extra_config` (docs/VLLM.md).
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        transfer = vllm_config.kv_transfer_config
        self.kvflow_config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        model_name = self.kvflow_config.model_name or default_model_name(vllm_config)
        world_size, rank = parallel_layout(vllm_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._zeros: SharedZeros | None = None
        kv_events = _kv_events_on(vllm_config)
        self._kv_events: WorkerKVEvents | None = None
        self._votes: RankVotes | None = RankVotes(world_size) if kv_events else None
        self._ready: list[KVCacheEvent] = []
        #: running totals of the stats, and their values at the last get_kv_connector_stats
        self._counted = dict.fromkeys(STAT_KEYS, 0)
        self._reported = dict.fromkeys(STAT_KEYS, 0)
        if role == KVConnectorRole.SCHEDULER:
            if self.kvflow_config.recompute_failed_loads:
                # vLLM's scheduler reads the policy right after creating its connector
                transfer.kv_load_failure_policy = "recompute"
            self._scheduler = SchedulerSide(
                self.kvflow_config,
                model_name=model_name,
                world_size=world_size,
                block_size=self._block_size,
                block_hashes=_block_hashes if kv_events else None,
            )
        else:
            prefix = self.kvflow_config.instance_id or f"vllm-{transfer.engine_id}"
            self._worker = WorkerSide(
                self.kvflow_config,
                model_name=model_name,
                world_size=world_size,
                rank=rank,
                instance_id=f"{prefix}-rank{rank}",
            )
            if kv_events:
                cfg = self.kvflow_config
                self._kv_events = WorkerKVEvents(
                    lambda: KVFlowClient(  # polls are quick: a dead server shows soon
                        cfg.endpoint_of(rank, world_size), timeout_s=cfg.lookup_timeout_s,
                        curve_server_key=cfg.curve_server_key, curve_key=cfg.curve_key,
                    ),
                    model_name=model_name, world_size=world_size, rank=rank,
                    block_size=self._block_size,
                )  # fmt: skip
        log.info(
            "kvflow connector (%s) for %s, world_size %d rank %d, server %s",
            role.name.lower(),
            model_name,
            world_size,
            rank,
            self.kvflow_config.endpoint,
        )

    # -- worker side ---------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        """On CPU, vLLM allocates the KV cache inside this: in shared memory (shared_kv.py)."""
        from vllm.platforms import current_platform

        if self._worker is None or not current_platform.is_cpu():
            return None
        self._zeros = SharedZeros()
        return self._zeros

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._block_size)

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KVFlowConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if self._worker is not None and plan is not None and plan.loads:
            self._remember(plan.loads)
            self._counted["loads"] += len(plan.loads)
            self._worker.load(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise loads: order this layer's reads after its copies (worker.py)."""
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Layerwise: hand the layer the forward pass just wrote to the step's stores."""
        if self._worker is not None:
            self._worker.layer_written(layer_name, self._plan())

    def wait_for_save(self) -> None:
        plan = self._plan()
        if self._worker is not None:
            self._worker.finish_loads()
        if self._worker is not None and plan is not None:
            self._remember(plan.stores)
            self._counted["stores"] += len(plan.stores)
            self._worker.save(plan)

    def _remember(self, specs: Any) -> None:
        """Tell the KV-event follower which vLLM blocks the planned chunks are."""
        if self._kv_events is not None:
            for spec in specs:
                if spec.block_hashes:
                    self._kv_events.remember(spec.token_ids, spec.block_hashes, spec.cache_salt)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads and stores complete within their step: nothing finishes later."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        errors = self._worker.take_load_errors()
        self._counted["load_failed_blocks"] += len(errors)
        return errors

    def get_kv_connector_kv_cache_events(self) -> KVFlowKVEvents | None:
        """The block events this worker's KV-event follower gathered since the last step."""
        if self._kv_events is None:
            return None
        events = self._kv_events.take()
        if not events:
            return None
        return KVFlowKVEvents([_vllm_event(e, self._block_size) for e in events])

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This step's lookups (scheduler) or loads and stores (worker), for vLLM's metrics."""
        counted = self._counted
        if self._scheduler is not None:
            counted["lookups"], counted["hit_tokens"] = (
                self._scheduler.lookups, self._scheduler.matched_tokens
            )  # fmt: skip
        if self._worker is not None:
            counted["loaded_tokens"] = self._worker.loaded_tokens
            counted["stored_tokens"] = self._worker.stored_tokens
        last, self._reported = self._reported, dict(counted)
        stats = KVFlowConnectorStats(data={k: counted[k] - last[k] for k in STAT_KEYS})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVFlowConnectorStats(data=dict(data)) if data is not None else KVFlowConnectorStats()

    def shutdown(self) -> None:
        if self._kv_events is not None:
            self._kv_events.close()
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KVFlowConnectorMetadata(self._scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        """Chunks whose load failed are stored again after vLLM recomputes them."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if self._scheduler is not None and invalid:
            self._scheduler.load_failed(set(invalid))
        events = getattr(connector_output, "kv_cache_events", None)
        if self._votes is not None and isinstance(events, KVConnectorKVEvents):
            self._ready.extend(self._votes.add(events.get_all_events()))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' block events every rank reported, for vLLM's KV-event publisher."""
        ready, self._ready = self._ready, []
        return ready

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.request_finished(request)
        return False, None
