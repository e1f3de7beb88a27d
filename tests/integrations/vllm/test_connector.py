"""KVFlowConnector's logic without vLLM: config, layout, shared memory, both sides.

The scheduler and worker sides run against a real `kvflow server` subprocess over
real ZMQ; vLLM's objects they read (Request, KVCacheBlocks, SchedulerOutput) are
stood in for by namespaces carrying the same attributes, since vLLM is not in
this venv (tests/integrations/vllm/test_vllm_e2e.py drives the real ones).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient
from kvflow.core.server.shm import map_shared, shared_memory_of
from kvflow.integrations.vllm import scheduler as scheduler_module
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.layout import kvflow_view, kvflow_views, layer_token_bytes
from kvflow.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec
from kvflow.integrations.vllm.scheduler import SchedulerSide
from kvflow.integrations.vllm.shared_kv import (
    MIN_REMAP_BYTES,
    SharedKV,
    SharedZeros,
    owns_its_pages,
)
from kvflow.integrations.vllm.worker import WorkerSide
from kvflow.kernels import KVLayout, cuda_available
from tests.e2e.server_proc import running_server
from tests.support.collectors import free_port

BLOCK = 16
CHUNK = 32
LAYERS, BLOCKS, HEADS, HEAD = 2, 24, 2, 8
MODEL = "tiny:float32"


# -- the package and its config ------------------------------------------------------------


def test_the_package_imports_without_vllm() -> None:
    import kvflow.integrations.vllm as pkg

    assert pkg.__all__ == ["KVFlowConnector"]
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match="vllm"):
            _ = pkg.KVFlowConnector
    with pytest.raises(AttributeError):
        _ = pkg.Nothing


def test_config_reads_only_kvflow_keys() -> None:
    config = ConnectorConfig.from_extra_config(
        {
            "kvflow.endpoint": "tcp://10.0.0.1:6000",
            "kvflow.timeout_s": "5",
            "other.key": 1,
            "kvflow.store": "off",
            "kvflow.model_name": "m",
        }
    )
    assert config.endpoint == "tcp://10.0.0.1:6000" and config.timeout_s == 5.0
    assert config.store is False and config.load is True and config.model_name == "m"
    assert ConnectorConfig.from_extra_config(None) == ConnectorConfig()
    ring = ConnectorConfig.from_extra_config(
        {"kvflow.staging_slots": "4", "kvflow.staging_slot_mb": "128"}
    )
    assert ring.staging_slots == 4 and ring.staging_slot_mb == 128.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvflow.endpont": "tcp://x:1"}, "unknown kv_connector_extra_config key 'kvflow.endpont'"),
        ({"kvflow.endpoint": "http://x"}, "kvflow.endpoint must look like tcp://"),
        ({"kvflow.endpoint": "tcp://a:1,http://x"}, "kvflow.endpoint must look like tcp://"),
        ({"kvflow.timeout_s": float("inf")}, r"kvflow.timeout_s must be in"),
        ({"kvflow.lookup_timeout_s": True}, "kvflow.lookup_timeout_s must be a number"),
        ({"kvflow.load": "maybe"}, "kvflow.load must be a boolean"),
        ({"kvflow.recompute_failed_loads": 2}, "kvflow.recompute_failed_loads must be a boolean"),
        ({"kvflow.curve_key": "c.key_secret"}, "go together"),
        ({"kvflow.staging_slots": 65, "kvflow.staging_slot_mb": 8}, r"in \[0, 64\]"),
        ({"kvflow.staging_slots": "2.5"}, "kvflow.staging_slots must be a whole number"),
        ({"kvflow.staging_slots": True}, "kvflow.staging_slots must be a whole number"),
        ({"kvflow.staging_slot_mb": "lots"}, "kvflow.staging_slot_mb must be a number of MiB"),
        ({"kvflow.staging_slots": 0, "kvflow.staging_slot_mb": 8}, "staging_slots is 0 .no ring."),
        ({"kvflow.staging_slot_mb": 0}, "kvflow.staging_slot_mb must be more than 0 MiB"),
        (
            {"kvflow.staging_slots": 2, "kvflow.staging_slot_mb": 0},
            "kvflow.staging_slot_mb must be more than 0 MiB",
        ),
        (
            {"kvflow.staging_slots": 2, "kvflow.staging_slot_mb": 8, "kvflow.layerwise": "off"},
            "kvflow.staging_slots needs layerwise loads",
        ),
    ],
)
def test_config_refuses_bad_values(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra_config(extra)


def test_the_staging_ring_is_on_by_default_for_cuda_layerwise_workers_only() -> None:
    """Unnamed, a CUDA worker loading layer by layer gets DEFAULT_RING_SLOTS slots of one
    layer of DEFAULT_SLOT_TOKENS tokens; a CPU worker or one loading whole gets none; what
    the config names wins (a size alone keeps the default count)."""
    from kvflow.integrations.vllm.config import (
        DEFAULT_RING_SLOTS,
        DEFAULT_SLOT_TOKENS,
        staging_ring,
    )

    def ring(extra: dict[str, Any], layerwise: bool = True, cuda: bool = True) -> tuple[int, int]:
        return staging_ring(ConnectorConfig.from_extra_config(extra), layerwise, cuda, 4096)

    assert ring({}) == (DEFAULT_RING_SLOTS, 4096 * DEFAULT_SLOT_TOKENS)
    assert ring({}, cuda=False) == (0, 0)
    assert ring({}, layerwise=False) == (0, 0)
    assert ring({"kvflow.staging_slots": 0}) == (0, 0)
    assert ring({"kvflow.staging_slots": 0, "kvflow.staging_slot_mb": 0}) == (0, 0)  # as before
    assert ring({"kvflow.staging_slots": 2}) == (2, 4096 * DEFAULT_SLOT_TOKENS)
    assert ring({"kvflow.staging_slot_mb": 8}) == (DEFAULT_RING_SLOTS, 8 << 20)
    assert ring({"kvflow.staging_slots": 2, "kvflow.staging_slot_mb": 1}, cuda=False) == (
        2,
        1 << 20,
    )


# -- layout: vLLM's manager views as kvflow's vllm_flash_attn format -----------------------


def _manager_view(buf: torch.Tensor, layer: int) -> torch.Tensor:
    """vLLM's per-layer [B, H, N, 2*D] view of a layer-major float32 buffer."""
    per_layer = BLOCKS * HEADS * BLOCK * 2 * HEAD
    return buf.view(torch.float32)[layer * per_layer : (layer + 1) * per_layer].view(
        BLOCKS, HEADS, BLOCK, 2 * HEAD
    )


def test_rows_view_matches_the_cpu_backends_k_and_v() -> None:
    layer = torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD)
    # vLLM's CPU attention: view [B, H, 2N, D] and chunk dim 2 into K and V
    key, value = layer.view(BLOCKS, HEADS, 2 * BLOCK, HEAD).chunk(2, dim=2)
    view = kvflow_view(layer, "rows")
    assert view.shape == (2, BLOCKS, BLOCK, HEADS, HEAD)
    assert torch.equal(view[0], key.transpose(1, 2)) and torch.equal(view[1], value.transpose(1, 2))
    assert view.data_ptr() == layer.data_ptr()


def test_channels_view_matches_flash_attentions_k_and_v() -> None:
    layer = torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD)
    # vLLM's FlashAttention: (B, H, N, 2D) -> transpose(1, 2).split(D, dim=-1)
    key, value = layer.transpose(1, 2).split(HEAD, dim=-1)
    view = kvflow_view(layer, "channels")
    assert torch.equal(view[0], key) and torch.equal(view[1], value)


def test_views_fit_kvflows_format_and_refuse_other_shapes() -> None:
    buf = torch.zeros(LAYERS * BLOCKS * HEADS * BLOCK * 2 * HEAD * 4, dtype=torch.int8)
    caches = {f"model.layers.{i}.self_attn.attn": _manager_view(buf, i) for i in range(LAYERS)}
    caches["shared"] = caches["model.layers.0.self_attn.attn"]  # a layer reusing another's
    views = kvflow_views(caches, "rows")
    assert len(views) == LAYERS
    layout = KVLayout.from_kv_caches(views, block_size=None, kv_format="vllm_flash_attn")
    assert (layout.num_layers, layout.num_blocks, layout.block_size) == (LAYERS, BLOCKS, BLOCK)
    assert layer_token_bytes(views) == 2 * HEADS * HEAD * 4  # K and V, float32
    with pytest.raises(ValueError, match="2 \\* head_size"):
        kvflow_view(torch.zeros(4, 2, 16, 7), "rows")
    with pytest.raises(ValueError, match="split must be"):
        kvflow_view(torch.zeros(4, 2, 16, 8), "cols")


# -- shared memory --------------------------------------------------------------------------


def test_shared_zeros_allocates_vllms_buffer_in_shared_memory() -> None:
    zeros = SharedZeros(min_bytes=1 << 16)
    with zeros:
        big = torch.zeros(1 << 20, dtype=torch.int8, device=torch.device("cpu"))
        small = torch.zeros(16, dtype=torch.int8)
        floats = torch.zeros(1 << 20)
        elsewhere = torch.zeros(1 << 20, dtype=torch.int8, device="meta")
    assert shared_memory_of(big) is not None and shared_memory_of(small) is None
    assert shared_memory_of(floats) is None  # only vLLM's raw int8 KV buffer is taken over
    assert elsewhere.device.type == "meta"  # and only on the CPU
    assert int(big.abs().sum()) == 0 and len(zeros.allocated) == 1


def test_remapping_in_place_shares_every_existing_view() -> None:
    """The fallback: a buffer vLLM allocated privately is moved into shared memory in place,
    so views taken before the move (the layers') write what the server maps."""
    buf = torch.zeros(4 * MIN_REMAP_BYTES, dtype=torch.int8)  # the layers' bytes at its start
    layer1 = _manager_view(buf, 1)
    before = layer1[:, :, :, :]  # a view vLLM took earlier, never shown to the connector
    shared = SharedKV()
    alias = shared.share(layer1)
    assert shared.share(alias) is alias  # already shared: unchanged
    before[5, 1, 3, 7] = 42.0
    memory = shared_memory_of(alias)
    assert memory is not None
    server_side = map_shared(memory)[memory.offset :].view(torch.float32)
    assert alias[5, 1, 3, 7] == 42.0
    assert server_side[((5 * HEADS + 1) * BLOCK + 3) * 2 * HEAD + 7] == 42.0
    server_side[0] = 7.0
    assert layer1[0, 0, 0, 0] == 7.0


def test_a_buffer_that_may_share_pages_with_the_heap_is_not_remapped() -> None:
    """Remapping a heap buffer's pages loses the writes other threads make to its
    neighbours meanwhile (a corrupt heap, glibc aborting later): only a buffer of 32 MiB or
    more whose glibc size word marks it mapped alone is moved. A small one, and a large
    one whose size word says heap (glibc carves even 32 MiB from a heap's free top), are
    refused whole and left as they were."""
    mapped = torch.empty(MIN_REMAP_BYTES + (1 << 16), dtype=torch.uint8)
    # glibc maps it alone unless its heap had that much free already (earlier tests' leftovers)
    assert owns_its_pages(mapped.data_ptr(), mapped.numel()) is not _in_the_brk_heap(mapped)
    words = mapped[4096 - 8 : 4096]
    words.copy_(torch.tensor([2, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8))  # "mapped alone"
    assert owns_its_pages(mapped.data_ptr() + 4096, MIN_REMAP_BYTES)  # the size word read right
    # ...before another allocator's small block: refused by its size alone
    assert not owns_its_pages(mapped.data_ptr() + 4096, 1 << 16)
    words.copy_(torch.tensor([0x11, 0, 0, 2, 0, 0, 0, 0], dtype=torch.uint8))  # 32 MiB, in a heap
    carved = torch.frombuffer(memoryview(mapped.numpy())[4096:], dtype=torch.uint8)
    small = torch.ones(1 << 16)  # 256 KiB
    for buf in (small, carved):
        buf.fill_(1)
        with pytest.raises(ValueError, match="may share its pages with other heap allocations"):
            SharedKV().share(buf)
        assert shared_memory_of(buf) is None and bool((buf == 1).all())  # left as it was


def _in_the_brk_heap(buf: torch.Tensor) -> bool:
    """Whether `buf` lies in the process's `[heap]` mapping (glibc carved it from its top)."""
    address = buf.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        start, end = (int(edge, 16) for edge in span.split("-"))
        if start <= address < end:
            return rest[-1] == "[heap]"
    raise AssertionError(f"{address:#x} is in no mapping")


def test_a_worker_whose_buffer_cannot_be_shared_runs_without_kvflow(endpoint: str) -> None:
    worker = WorkerSide(
        _config(endpoint), model_name=MODEL, world_size=1, rank=0, instance_id="heap-rank0"
    )
    try:
        buf = torch.zeros(LAYERS * BLOCKS * HEADS * BLOCK * 2 * HEAD * 4, dtype=torch.int8)
        worker.register({f"model.layers.{i}.self_attn.attn": _manager_view(buf, i)
                         for i in range(LAYERS)}, BLOCK)  # fmt: skip
        assert not worker.registered and shared_memory_of(buf) is None
        worker.load(StepPlan(loads=[LoadSpec("s", list(range(CHUNK)), [4], skip_tokens=0)]))
        assert worker.take_load_errors() == {4}  # vLLM recomputes
    finally:
        worker.shutdown()


# -- both sides against a real server -------------------------------------------------------


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("kvflow-server") / "server.log"
    with running_server(CHUNK, log) as ep:
        yield ep


def _config(endpoint: str, **kw: Any) -> ConnectorConfig:
    return ConnectorConfig(endpoint=endpoint, timeout_s=10.0, lookup_timeout_s=5.0, **kw)


def _request(req_id: str, prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        all_token_ids=list(prompt),
        num_tokens=len(prompt),
        cache_salt=None,
    )


def _blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def _new_step(req: SimpleNamespace, blocks: list[int], computed: int, scheduled: int) -> Any:
    new = SimpleNamespace(req_id=req.request_id, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
    )
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: scheduled},
    )


def _match(side: SchedulerSide, req: SimpleNamespace, computed: int = 0) -> tuple[int | None, bool]:
    """Ask as vLLM does, step after step, until the lookup's answer is in."""
    first = side.get_num_new_matched_tokens(req, computed)
    assert first == (None, False), "the first ask must not wait for the server"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = side.get_num_new_matched_tokens(req, computed)
        if answer[0] is not None:
            return answer
        time.sleep(0.01)
    raise AssertionError("the lookup never answered")


def _wait_chunk_size(side: SchedulerSide) -> None:
    deadline = time.monotonic() + 10
    while side.chunk_size() is None:
        assert time.monotonic() < deadline, "the server's chunk size never came"
        time.sleep(0.01)


def _vllm_cpu_caches() -> dict[str, torch.Tensor]:
    """Caches as vLLM's CPU worker makes them: one zeros buffer, in the connector's context."""
    with SharedZeros():
        buf = torch.zeros(LAYERS * BLOCKS * HEADS * BLOCK * 2 * HEAD * 4, dtype=torch.int8)
    return {f"model.layers.{i}.self_attn.attn": _manager_view(buf, i) for i in range(LAYERS)}


def test_prefix_stored_by_one_request_is_loaded_into_anothers_blocks(endpoint: str) -> None:
    scheduler = SchedulerSide(_config(endpoint), model_name=MODEL, world_size=1, block_size=BLOCK)
    worker = WorkerSide(
        _config(endpoint), model_name=MODEL, world_size=1, rank=0, instance_id="test-rank0"
    )
    try:
        caches = _vllm_cpu_caches()
        worker.register(caches, BLOCK)
        assert worker.registered
        views = kvflow_views(caches, "rows")
        _wait_chunk_size(scheduler)

        prompt = list(range(100, 100 + 2 * CHUNK + 5))  # two whole chunks and 5 tokens
        first = _request("a", prompt)
        assert _match(scheduler, first) == (0, False)  # nothing stored yet
        scheduler.update_state_after_alloc(first, _blocks([]), 0)
        a_blocks = [3, 7, 1, 9, 4]
        for view in views:  # the forward pass writes the prompt's KV
            view[:, a_blocks].copy_(torch.randn_like(view[:, a_blocks]))
        plan = scheduler.build_plan(_new_step(first, a_blocks, 0, len(prompt)))
        assert not plan.loads
        (store,) = plan.stores
        assert store.token_ids.tolist() == prompt[: 2 * CHUNK] and store.block_ids == a_blocks[:4]
        assert plan.allocations == [("a", a_blocks, prompt)]
        worker.save(plan)
        assert worker.stored_tokens == 2 * CHUNK
        # a later step stores nothing new: the prompt's chunks are in
        assert not scheduler.build_plan(_new_step(first, a_blocks, len(prompt), 1)).stores
        # a worker reports block 2 (tokens 32..47, chunk 1) unfilled: once vLLM recomputed
        # it, that chunk is stored again
        scheduler.load_failed({a_blocks[2]})
        (again,) = scheduler.build_plan(_new_step(first, a_blocks, len(prompt), 1)).stores
        assert again.token_ids.tolist() == prompt[: 2 * CHUNK]
        scheduler.load_failed({999})  # no request holds it: nothing changes
        assert not scheduler.build_plan(_new_step(first, a_blocks, len(prompt), 1)).stores

        second = _request("b", [*prompt[: 2 * CHUNK], 1, 2, 3])
        assert _match(scheduler, second) == (2 * CHUNK, False)
        b_blocks = [11, 12, 13, 14, 15]
        scheduler.update_state_after_alloc(second, _blocks(b_blocks), 2 * CHUNK)
        plan = scheduler.build_plan(_new_step(second, b_blocks, 2 * CHUNK, 3))
        (load,) = plan.loads
        assert load.token_ids.tolist() == prompt[: 2 * CHUNK] and load.block_ids == b_blocks[:4]
        assert load.skip_tokens == 0 and not plan.stores  # loaded chunks are not stored again
        worker.load(plan)
        assert worker.take_load_errors() == set()
        for view in views:
            assert torch.equal(view[:, b_blocks[:4]], view[:, a_blocks[:4]])

        # a prompt that is all hits leaves its last token for vLLM to compute
        whole = _request("c", prompt[: 2 * CHUNK])
        assert _match(scheduler, whole) == (2 * CHUNK - 1, False)
        # tokens vLLM has itself (a local prefix-cache hit) are not asked for again
        local = _request("d", second.prompt_token_ids)
        assert _match(scheduler, local, computed=CHUNK) == (CHUNK, False)

        for req in (first, second, whole, local):
            scheduler.request_finished(req)
        assert scheduler.tracked() == []
        assert scheduler.lookups == 4 and scheduler.matched_tokens == 3 * 2 * CHUNK
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.fixture(scope="module")
def second_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("kvflow-server-1") / "server.log"
    with running_server(CHUNK, log) as ep:
        yield ep


def test_a_server_per_rank_hits_what_every_rank_s_server_holds(
    endpoint: str, second_endpoint: str
) -> None:
    """`kvflow.endpoint` listing a server per rank: each rank's worker stores to its own
    server, and the scheduler's lookup asks each server for its own rank and answers the
    shortest hit (rank 1 holding one chunk of two: one chunk)."""
    both = f"{endpoint}, {second_endpoint}"
    scheduler = SchedulerSide(_config(both), model_name=MODEL, world_size=2, block_size=BLOCK)
    workers = [
        WorkerSide(_config(both), model_name=MODEL, world_size=2, rank=r, instance_id=f"pr-{r}")
        for r in range(2)
    ]
    try:
        caches = [_vllm_cpu_caches() for _ in workers]
        for worker, cache in zip(workers, caches, strict=True):
            worker.register(cache, BLOCK)
            assert worker.registered
        _wait_chunk_size(scheduler)
        prompt = list(range(7000, 7000 + 2 * CHUNK + 5))
        first = _request("pr-a", prompt)
        assert _match(scheduler, first) == (0, False)
        scheduler.update_state_after_alloc(first, _blocks([]), 0)
        blocks = [3, 7, 1, 9, 4]
        plan = scheduler.build_plan(_new_step(first, blocks, 0, len(prompt)))
        workers[0].save(plan)
        (store,) = plan.stores  # rank 1 stores only the first chunk
        workers[1].save(
            StepPlan(stores=[StoreSpec("pr-a", store.token_ids[:CHUNK], store.block_ids[:2])])
        )
        with KVFlowClient(endpoint) as one, KVFlowClient(second_endpoint) as two:
            tokens = prompt[: 2 * CHUNK]
            assert one.lookup(tokens, model_name=MODEL, world_size=2, ranks=[0]) == 2 * CHUNK
            assert two.lookup(tokens, model_name=MODEL, world_size=2, ranks=[1]) == CHUNK
            assert one.lookup(tokens, model_name=MODEL, world_size=2, ranks=[1]) == 0
        assert _match(scheduler, _request("pr-b", [*prompt[: 2 * CHUNK], 1])) == (CHUNK, False)
        workers[1].save(plan)
        assert _match(scheduler, _request("pr-c", [*prompt[: 2 * CHUNK], 2])) == (2 * CHUNK, False)
    finally:
        for worker in workers:
            worker.shutdown()
        scheduler.shutdown()


def test_an_endpoint_list_must_have_one_per_rank(endpoint: str) -> None:
    config = _config(f"{endpoint},{endpoint},{endpoint}")
    with pytest.raises(ValueError, match="lists 3 endpoints for a world of 2 ranks"):
        SchedulerSide(config, model_name=MODEL, world_size=2, block_size=BLOCK)
    assert config.endpoint_of(2, 3) == endpoint


def test_each_prompt_is_converted_once(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup and every store plan send slices of one int32 copy of the prompt."""
    converted: list[str] = []
    real = scheduler_module.as_int32_array

    def counting(values: Any, what: str) -> Any:
        converted.append(what)
        return real(values, what)

    monkeypatch.setattr(scheduler_module, "as_int32_array", counting)
    scheduler = SchedulerSide(_config(endpoint), model_name=MODEL, world_size=1, block_size=BLOCK)
    try:
        _wait_chunk_size(scheduler)
        prompt = list(range(700, 700 + 2 * CHUNK + 5))
        req = _request("once", prompt)
        assert _match(scheduler, req) == (0, False)
        scheduler.update_state_after_alloc(req, _blocks([]), 0)
        blocks = [1, 2, 3, 4, 5]
        stored = [
            [s.token_ids.tolist() for s in scheduler.build_plan(step).stores]
            for step in (_new_step(req, blocks, 0, CHUNK), _new_step(req, blocks, CHUNK, 40))
        ]
        assert stored == [[prompt[:CHUNK]], [prompt[: 2 * CHUNK]]]
        assert converted == ["prompt_token_ids"]
        scheduler.request_finished(req)
    finally:
        scheduler.shutdown()


def test_a_load_the_server_cannot_serve_reports_its_blocks(endpoint: str) -> None:
    worker = WorkerSide(
        _config(endpoint), model_name=MODEL, world_size=1, rank=0, instance_id="errors-rank0"
    )
    try:
        worker.register(_vllm_cpu_caches(), BLOCK)
        missing = LoadSpec("x", list(range(9000, 9000 + 2 * CHUNK)), [5, 6, 7, 8], skip_tokens=0)
        worker.load(StepPlan(loads=[missing]))
        assert worker.take_load_errors() == {5, 6, 7, 8}
        assert worker.take_load_errors() == set()  # reported once
        # the blocks vLLM computed itself (skip_tokens) are never reported
        skipped = LoadSpec(
            "y", list(range(9500, 9500 + 2 * CHUNK)), [1, 2, 3, 4], skip_tokens=CHUNK
        )
        worker.load(StepPlan(loads=[skipped]))
        assert worker.take_load_errors() == {3, 4}
    finally:
        worker.shutdown()


def test_an_unregistered_worker_fails_its_loads_so_vllm_recomputes(tmp_path: Path) -> None:
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    worker = WorkerSide(
        ConnectorConfig(endpoint=dead, timeout_s=0.3),
        model_name=MODEL,
        world_size=1,
        rank=0,
        instance_id="dead-rank0",
    )
    try:
        worker.register(_vllm_cpu_caches(), BLOCK)
        assert not worker.registered
        worker.load(StepPlan(loads=[LoadSpec("z", list(range(CHUNK)), [2, 3], skip_tokens=0)]))
        assert worker.take_load_errors() == {2, 3}
        worker.save(StepPlan())  # nothing to do, nothing raised
    finally:
        worker.shutdown()


def test_a_server_that_does_not_answer_never_stalls_the_scheduler() -> None:
    dead = f"tcp://127.0.0.1:{free_port()}"
    side = SchedulerSide(
        ConnectorConfig(endpoint=dead, lookup_timeout_s=0.3),
        model_name=MODEL,
        world_size=1,
        block_size=BLOCK,
    )
    try:
        req = _request("slow", list(range(2 * CHUNK)))
        started = time.monotonic()
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)
        assert time.monotonic() - started < 0.1  # answered at once, not after the timeout
        assert _match_after_first(side, req) == (0, False)  # the timed-out lookup is a miss
        # without the chunk size no store is planned, and the scheduler goes on
        plan = side.build_plan(_new_step(req, [0, 1, 2, 3], 0, 2 * CHUNK))
        assert plan.stores == [] and plan.loads == []
        side.request_finished(req)
    finally:
        side.shutdown()


def _match_after_first(side: SchedulerSide, req: SimpleNamespace) -> tuple[int | None, bool]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        answer = side.get_num_new_matched_tokens(req, 0)
        if answer[0] is not None:
            return answer
        time.sleep(0.02)
    raise AssertionError("the lookup never gave up")


def test_load_and_store_switches(endpoint: str) -> None:
    side = SchedulerSide(
        _config(endpoint, load=False, store=False, report_allocations=False),
        model_name=MODEL,
        world_size=1,
        block_size=BLOCK,
    )
    try:
        _wait_chunk_size(side)
        req = _request("off", list(range(2 * CHUNK)))
        assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # no lookup at all
        plan = side.build_plan(_new_step(req, [0, 1, 2, 3], 0, 2 * CHUNK))
        assert plan == StepPlan()
    finally:
        side.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU and pycuda")
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_cuda_caches_register_by_ipc_and_load_byte_for_byte(endpoint: str, layerwise: bool) -> None:
    """The worker side on CUDA caches laid out as FlashAttention's (NHD memory seen through
    vLLM's [B, H, N, 2*D] manager view, K and V split by channels): registration goes by
    CUDA IPC, and a chunk stored from one request's blocks loads into another's exactly,
    whole or (the default on CUDA) layer by layer, driven as vLLM drives the connector:
    each layer's write marked, each layer's load waited for, then `finish_loads`."""
    scheduler = SchedulerSide(_config(endpoint), model_name=MODEL, world_size=1, block_size=BLOCK)
    worker = WorkerSide(
        _config(endpoint, layerwise=layerwise), model_name=MODEL, world_size=1, rank=0,
        instance_id=f"gpu-{layerwise}-rank0",
    )  # fmt: skip
    try:
        physical = [torch.zeros(BLOCKS, BLOCK, HEADS, 2 * HEAD, device="cuda") for _ in
                    range(LAYERS)]  # fmt: skip
        caches = {
            f"model.layers.{i}.self_attn.attn": layer.permute(0, 2, 1, 3)
            for i, layer in enumerate(physical)
        }
        worker.register(caches, BLOCK)
        assert worker.registered
        _wait_chunk_size(scheduler)
        start = 500 + 1000 * layerwise  # each variant's own prompt: the server is shared
        prompt = list(range(start, start + CHUNK + 3))
        first = _request("gpu-a", prompt)
        assert _match(scheduler, first) == (0, False)
        scheduler.update_state_after_alloc(first, _blocks([]), 0)
        a_blocks = [5, 2, 8]
        plan = scheduler.build_plan(_new_step(first, a_blocks, 0, len(prompt)))
        for name, layer in zip(caches, physical, strict=True):  # the forward pass, layer by layer
            layer[a_blocks] = torch.randn_like(layer[a_blocks])
            worker.layer_written(name, plan)
        worker.save(plan)
        assert worker.stored_tokens == CHUNK

        second = _request("gpu-b", [*prompt[:CHUNK], 7])
        assert _match(scheduler, second) == (CHUNK, False)
        b_blocks = [17, 11, 20]
        scheduler.update_state_after_alloc(second, _blocks(b_blocks), CHUNK)
        worker.load(scheduler.build_plan(_new_step(second, b_blocks, CHUNK, 1)))
        for name in caches:
            worker.wait_layer(name)
        worker.finish_loads()
        assert worker.take_load_errors() == set()
        torch.cuda.synchronize()
        whole = CHUNK // BLOCK
        for layer in physical:
            assert torch.equal(layer[b_blocks[:whole]], layer[a_blocks[:whole]])
        for req in (first, second):
            scheduler.request_finished(req)
    finally:
        worker.shutdown()
        scheduler.shutdown()


@pytest.mark.parametrize("slots", [0, 1], ids=["no-ring", "ring"])
def test_layerwise_loads_are_waited_for_layer_by_layer(endpoint: str, slots: int) -> None:
    """With kvflow.layerwise each layer's blocks hold the prefix once vLLM's wait for that
    layer returns; finish_loads waits for the layers vLLM did not ask for; a layerwise
    miss reports its blocks like any load. With a staging ring of one slot (a layer of
    the prompt), every layer comes through it."""
    writer = WorkerSide(
        _config(endpoint), model_name=MODEL, world_size=1, rank=0,
        instance_id=f"lw-w{slots}-rank0",
    )  # fmt: skip
    ring = {"staging_slots": slots, "staging_slot_mb": 1.0} if slots else {}
    reader = WorkerSide(
        _config(endpoint, layerwise=True, **ring), model_name=MODEL, world_size=1, rank=0,
        instance_id=f"lw-r{slots}-rank0",
    )  # fmt: skip
    try:
        src_caches, dst_caches = _vllm_cpu_caches(), _vllm_cpu_caches()
        writer.register(src_caches, BLOCK)
        reader.register(dst_caches, BLOCK)
        src, dst = kvflow_views(src_caches, "rows"), kvflow_views(dst_caches, "rows")
        prompt = np.arange(4000 + 1000 * slots, 4000 + 1000 * slots + 2 * CHUNK, dtype=np.int32)
        a_blocks, b_blocks = [3, 7, 1, 9], [11, 12, 13, 14]
        for view in src:
            view[:, a_blocks].copy_(torch.randn_like(view[:, a_blocks]))
        writer.save(StepPlan(stores=[StoreSpec("a", prompt, a_blocks)]))
        reader.load(StepPlan(loads=[LoadSpec("b", prompt, b_blocks, skip_tokens=0)]))
        names = list(dst_caches)
        for name, s, d in zip(names[:-1], src, dst, strict=False):
            reader.wait_layer(name)
            assert torch.equal(d[:, b_blocks], s[:, a_blocks]), name
        reader.finish_loads()  # the last layer: vLLM never asked for it here
        assert torch.equal(dst[-1][:, b_blocks], src[-1][:, a_blocks])
        assert reader.take_load_errors() == set()
        assert reader.loaded_tokens == 2 * CHUNK
        assert reader.staged_layers == (len(names) if slots else 0)
        # the load's per-layer waits reach the server (in the background)
        with KVFlowClient(endpoint) as probe:
            deadline = time.monotonic() + 10
            while not probe.status()["activity"]["layer_waits"].get("layers"):
                assert time.monotonic() < deadline, "the layer waits never reached the server"
                time.sleep(0.05)

        absent = np.arange(9000 + 1000 * slots, 9000 + 1000 * slots + CHUNK, dtype=np.int32)
        missing = LoadSpec("m", absent, [5, 6], 0)
        reader.load(StepPlan(loads=[missing]))
        reader.wait_layer(names[0])
        reader.finish_loads()
        assert reader.take_load_errors() == {5, 6}

        # a load the server refuses (its blocks past the cache) fails alone: its first
        # layer's wait raises the server's error, which makes its blocks load errors; the
        # next one lands
        refused = LoadSpec("bad", prompt, [BLOCKS + 1, BLOCKS + 2, BLOCKS + 3, BLOCKS + 4], 0)
        c_blocks = [15, 16, 17, 18]
        reader.load(StepPlan(loads=[refused, LoadSpec("c", prompt, c_blocks, skip_tokens=0)]))
        assert reader.take_load_errors() == set()  # not known before its first wait
        reader.wait_layer(names[0])
        assert reader.take_load_errors() == set(refused.block_ids)
        reader.finish_loads()
        assert all(
            torch.equal(d[:, c_blocks], s[:, a_blocks]) for s, d in zip(src, dst, strict=True)
        )
    finally:
        writer.shutdown()
        reader.shutdown()


def test_layerwise_stores_take_each_layer_as_vllm_writes_it(endpoint: str) -> None:
    """save_kv_layer's layers start the step's layerwise stores and mark each layer;
    wait_for_save only waits: what each layer held when marked is what was stored."""
    writer = WorkerSide(
        _config(endpoint, layerwise=True), model_name=MODEL, world_size=1, rank=0,
        instance_id="lws-w-rank0",
    )  # fmt: skip
    reader = WorkerSide(
        _config(endpoint), model_name=MODEL, world_size=1, rank=0, instance_id="lws-r-rank0"
    )
    try:
        src_caches, dst_caches = _vllm_cpu_caches(), _vllm_cpu_caches()
        writer.register(src_caches, BLOCK)
        reader.register(dst_caches, BLOCK)
        src, dst = kvflow_views(src_caches, "rows"), kvflow_views(dst_caches, "rows")
        prompt = np.arange(7000, 7000 + 2 * CHUNK, dtype=np.int32)
        a_blocks, b_blocks = [2, 5, 8, 6], [16, 17, 18, 19]
        plan = StepPlan(stores=[StoreSpec("a", prompt, a_blocks)])
        written = []
        for name, view in zip(src_caches, src, strict=True):  # the forward pass, layer by layer
            view[:, a_blocks].copy_(torch.randn_like(view[:, a_blocks]))
            written.append(view[:, a_blocks].clone())
            writer.layer_written(name, plan)
        writer.save(plan)
        assert writer.stored_tokens == 2 * CHUNK
        reader.load(StepPlan(loads=[LoadSpec("b", prompt, b_blocks, skip_tokens=0)]))
        assert reader.take_load_errors() == set()
        for layer, view in enumerate(dst):
            assert torch.equal(view[:, b_blocks], written[layer])
    finally:
        writer.shutdown()
        reader.shutdown()
