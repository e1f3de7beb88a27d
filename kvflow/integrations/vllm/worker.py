"""The connector's worker side: registration, retrieves before the forward pass, stores after.

Runs in every vLLM worker (one per tensor-parallel rank), each registering its own
KV caches as instance `<prefix>-rank<r>`. Loads start in `start_load_kv`: whole
(they have landed when it returns) or, layerwise, returning once the request is sent,
each layer waited for at its `wait_layer` right before its attention reads it (no
wait needs the reply), the reply read once the forward pass is over. Stores run in
`wait_for_save` (after the forward pass wrote the cache), once the step's layerwise
loads are all waited for; layerwise, they
start at the step's first `layer_written` (vLLM's `save_kv_layer`), take each layer as
the pass writes it, and `wait_for_save` only waits for their replies. A load that falls
short or fails reports the blocks it did not fill through `take_load_errors`, so vLLM
recomputes them. A failed store is only a future miss: it is logged, never raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from kvflow.core import KVFlowClient
from kvflow.core.server.layers import LayerwiseLoad, LayerwiseSave
from kvflow.core.server.shm import shared_memory_of
from kvflow.integrations.vllm.config import ConnectorConfig, staging_ring
from kvflow.integrations.vllm.layout import (
    KV_FORMAT,
    kvflow_views,
    layer_token_bytes,
    split_for_device,
)
from kvflow.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec
from kvflow.integrations.vllm.shared_kv import SharedKV

log = logging.getLogger("kvflow.integrations.vllm")


class WorkerSide:
    """Everything `KVFlowConnector` does in one vLLM worker process."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        model_name: str,
        world_size: int,
        rank: int,
        instance_id: str,
        client_factory: Callable[[], KVFlowClient] | None = None,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.world_size = world_size
        self.rank = rank
        self.instance_id = instance_id
        factory = client_factory or (
            lambda: KVFlowClient(
                config.endpoint_of(rank, world_size),  # its own server, when one per rank
                timeout_s=config.timeout_s,
                client_id=instance_id,
                curve_server_key=config.curve_server_key,
                curve_key=config.curve_key,
            )
        )
        self._client = factory()
        self._shared = SharedKV()
        self._block_size = 0
        self.registered = False
        self._load_errors: set[int] = set()
        self._layerwise = False
        #: slots of the staging ring registered with the caches (0: none)
        self.ring_slots = 0
        #: vLLM layer name -> index of its (possibly shared) cache among the registered ones
        self._layer_index: dict[str, int] = {}
        #: this step's layerwise loads still to be waited for, with their plans
        self._pending: list[tuple[LayerwiseLoad, LoadSpec]] = []
        #: this step's layerwise stores (started at its first written layer), by plan
        self._saves: list[tuple[LayerwiseSave, StoreSpec]] = []
        self._saves_started = False
        self._reports = ThreadPoolExecutor(1, thread_name_prefix="kvflow-report")
        #: tokens retrieved and stored by this worker, for tests and logs
        self.loaded_tokens = 0
        self.stored_tokens = 0
        #: layers of layerwise loads that came through the staging ring
        self.staged_layers = 0

    def register(self, kv_caches: Mapping[str, torch.Tensor], block_size: int) -> None:
        """Register vLLM's KV caches (CPU ones are first moved into shared memory, in place)."""
        if not kv_caches:
            raise ValueError("vLLM passed no KV caches to register")
        self._block_size = block_size
        device = next(iter(kv_caches.values())).device
        distinct: dict[int, int] = {}
        self._layer_index = {
            name: distinct.setdefault(id(t), len(distinct)) for name, t in kv_caches.items()
        }
        layerwise = self.config.layerwise
        self._layerwise = device.type == "cuda" if layerwise is None else layerwise
        how = "CUDA IPC"
        if device.type == "cpu":
            already = all(shared_memory_of(t) is not None for t in kv_caches.values())
            how = "shared memory (allocated there)" if already else "shared memory (remapped)"
        try:
            if device.type == "cpu":  # ValueError for a buffer that may share its pages
                kv_caches = {name: self._shared.share(t) for name, t in kv_caches.items()}
            views = kvflow_views(kv_caches, split_for_device(device))
            slots, slot_bytes = staging_ring(
                self.config, self._layerwise, device.type == "cuda",
                layer_token_bytes(views),
            )  # fmt: skip
            self._client.register_kv_caches(
                self.instance_id,
                views,
                model_name=self.model_name,
                world_size=self.world_size,
                rank=self.rank,
                block_size=block_size,
                kv_format=KV_FORMAT,
                takeover=True,
                layerwise=self._layerwise,
                staging_slots=slots,
                staging_slot_bytes=slot_bytes,
            )
        except Exception as exc:
            log.error(
                "kvflow: registering %s with %s failed, this worker will neither load nor"
                " store: %s",
                self.instance_id,
                self.config.endpoint_of(self.rank, self.world_size),
                exc,
            )
            return
        self.registered = True
        self.ring_slots = slots
        ring = f" (staging ring of {slots} x {slot_bytes / (1 << 20):g} MiB)" if slots else ""
        log.info(
            "kvflow: registered %d layers of %s as %s through %s%s",
            len(views),
            device,
            self.instance_id,
            how,
            (", loading layer by layer" + ring if self._layerwise else ""),
        )

    def load(self, plan: StepPlan) -> None:
        """Retrieve every planned load into vLLM's blocks (layerwise: send it; its layers'
        waits need no reply, which `finish_loads` reads, so the server's work and the trip
        overlap the forward pass); shortfalls become load errors."""
        for spec in plan.loads:
            got = 0
            if self.registered:
                try:
                    if self._layerwise:
                        self._pending.append((self._send_load(spec), spec))
                        continue
                    got = self._client.retrieve(
                        self.instance_id, spec.token_ids, spec.block_ids,
                        request_id=spec.req_id, skip_first_n_tokens=spec.skip_tokens,
                        cache_salt=spec.cache_salt,
                    )  # fmt: skip
                except Exception as exc:
                    log.warning("kvflow: retrieve for %s failed: %s", spec.req_id, exc)
            self._account(spec, got)

    def _send_load(self, spec: LoadSpec) -> LayerwiseLoad:
        return self._client.retrieve_layerwise(
            self.instance_id, spec.token_ids, spec.block_ids, request_id=spec.req_id,
            skip_first_n_tokens=spec.skip_tokens, cache_salt=spec.cache_salt,
        )  # fmt: skip

    def _account(self, spec: LoadSpec, got: int) -> None:
        """A load brought `got` tokens of its prompt: the blocks past them are load errors."""
        got = max(got, spec.skip_tokens)
        if got < len(spec.token_ids):
            self._fail_from(spec, got)
        self.loaded_tokens += max(min(got, len(spec.token_ids)) - spec.skip_tokens, 0)

    def _fail_from(self, spec: LoadSpec, tokens: int) -> None:
        """Report spec's blocks from token `tokens` on as not loaded (vLLM recomputes them)."""
        bs = self._block_size
        self._load_errors.update(spec.block_ids[tokens // bs :] if bs else spec.block_ids)

    def wait_layer(self, layer_name: str) -> None:
        """Order the named layer's reads after this step's layerwise loads of it; a load
        that failed is reported from its first unfilled block and waited for no more."""
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._wait_index(layer)

    def _wait_index(self, layer: int) -> None:
        if not self._pending:
            return
        failed = []
        for load, spec in self._pending:
            try:
                load.wait_layer(layer)
            except Exception as exc:
                log.warning("kvflow: layerwise load for %s failed: %s", spec.req_id, exc)
                self._fail_from(spec, spec.skip_tokens)
                failed.append(load)
        if failed:
            self._pending = [(ld, sp) for ld, sp in self._pending if ld not in failed]

    def finish_loads(self) -> None:
        """Wait for every layer of the step's layerwise loads (those vLLM did not ask for
        too): once the forward pass is over, nothing may land in its blocks later. Then
        read their replies: the blocks past a load's hit are load errors."""
        layers = sorted(set(self._layer_index.values()))
        for load, spec in self._pending:
            log.info(
                "kvflow: layerwise load of %s: vLLM waited for %d of %d layers, %.2f ms on"
                " the host for their flags",
                spec.req_id,
                len(load.waited_s),
                len(layers),
                1e3 * sum(load.waited_s.values()),
            )
        for layer in layers:
            self._wait_index(layer)
        for load, spec in self._pending:
            try:
                got = load.hit_tokens
            except Exception as exc:
                log.warning("kvflow: retrieve for %s failed: %s", spec.req_id, exc)
                got = 0
            self._account(spec, got)
            if self.ring_slots:
                log.info(
                    "kvflow: layerwise load of %s: %d of %d layers came through the staging ring",
                    spec.req_id,
                    len(load.staged_layers),
                    len(layers),
                )
            self.staged_layers += len(load.staged_layers)
            self._reports.submit(self._report_waits, load, spec.req_id)
        self._pending = []

    def layer_written(self, layer_name: str, plan: StepPlan | None) -> None:
        """vLLM's forward pass queued the named layer's KV writes: hand the layer to the
        step's layerwise stores, which start at the step's first written layer."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._layerwise or not self.registered or plan is None:
            return
        if not self._saves_started:
            self._saves_started = True
            for spec in plan.stores:
                try:
                    save = self._client.store_layerwise(
                        self.instance_id, spec.token_ids, spec.block_ids,
                        request_id=spec.req_id, cache_salt=spec.cache_salt,
                    )  # fmt: skip
                except Exception as exc:  # stored whole in `save` instead
                    log.warning("kvflow: layerwise store for %s failed: %s", spec.req_id, exc)
                    continue
                self._saves.append((save, spec))
        for save, _ in self._saves:
            save.layer_done(layer)

    def save(self, plan: StepPlan) -> None:
        """Store every planned prompt chunk (after `finish_loads`): wait for the step's
        layerwise stores, store the rest whole; rank 0 reports the step's block
        allocations."""
        saves, self._saves, self._saves_started = self._saves, [], False
        if not self.registered:
            return
        layered = set()
        for save, spec in saves:
            layered.add(id(spec))
            try:
                self.stored_tokens += save.wait(self.config.timeout_s)
            except Exception as exc:
                log.warning("kvflow: layerwise store for %s failed: %s", spec.req_id, exc)
        for spec in plan.stores:
            if id(spec) in layered:
                continue
            try:
                self.stored_tokens += self._client.store(
                    self.instance_id,
                    spec.token_ids,
                    spec.block_ids,
                    request_id=spec.req_id,
                    cache_salt=spec.cache_salt,
                )
            except Exception as exc:
                log.warning("kvflow: store for %s failed: %s", spec.req_id, exc)
        if plan.allocations and self.rank == 0:
            self._reports.submit(self._report, list(plan.allocations))

    def _report(self, records: list[tuple[str, list[int], list[int]]]) -> None:
        try:
            self._client.report_block_allocations(self.instance_id, records)
        except Exception as exc:
            log.warning("kvflow: reporting block allocations failed: %s", exc)

    def _report_waits(self, load: LayerwiseLoad, req_id: str) -> None:
        """Send a layerwise load's per-layer waits (the server's kvflow.retrieve.layer_wait)."""
        try:
            self._client.report_layer_waits(self.instance_id, req_id, load.layer_waits())
        except Exception as exc:
            log.warning("kvflow: reporting layer waits failed: %s", exc)

    def take_load_errors(self) -> set[int]:
        """Blocks that loads since the last call left unfilled (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish queued reports, unregister, close the client."""
        self._reports.shutdown(wait=True)
        if self.registered:
            try:
                self._client.unregister(self.instance_id)
            except Exception as exc:
                log.warning("kvflow: unregister %s failed: %s", self.instance_id, exc)
            self.registered = False
        self._client.close()
