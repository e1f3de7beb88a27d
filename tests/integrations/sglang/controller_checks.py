"""SGLang's own HiCache controller driving KVFlowHiCacheStorage on CPU, run inside .venv-sglang.

tests/integrations/sglang/checks.py runs them (after sglang_checks.py's) in one process;
tests/integrations/sglang/test_sglang_controller.py reports each as a test. Every check
starts its own real `kvflow server` subprocess.

Each engine is what SGLang 0.5.23's scheduler builds for an MHA or MLA model with
`--enable-hierarchical-cache --hicache-storage-backend dynamic`: `ServerArgs` published
(`runtime_context.publish`, a tiny Llama config for the model), a CPU device pool
(`MHATokenToKVPool` / `MLATokenToKVPool`) with its paged allocator, and
`build_kv_only_stack`, which makes the host pool (`build_kv_host_pool`, its allocator
resolved from the extra-config JSON: `shm`), its `HostPoolGroup` and the
`HybridCacheController` that `UnifiedRadixCache` drives, which attaches kvflow through
`StorageBackendFactory` and starts its prefetch / backup threads. The test plays the
radix tree's part only: it hands the controller device rows and page hashes, and
allocates host rows for a storage hit, as `UnifiedRadixCache` does.

Two GPU-only pieces get CPU stand-ins (`use_cpu_stand_ins`, installed by `build_engine`;
the storage checks never reach them), nothing else is patched:
`cudaHostRegister` of the host pool (pinning for DMA) and sgl-kernel's
`transfer_kv_direct` (the device <-> host page copy of `--hicache-io-backend direct`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import Queue
from typing import Any

from kvflow.integrations.sglang import synthetic
from tests.integrations.sglang.checks import check, kvflow_server

synthetic.allow_torchvision_without_its_operators()  # before SGLang imports torchvision

import torch  # noqa: E402

import sglang.srt.mem_cache.pool_host.common as pool_host_common  # noqa: E402
import sglang.srt.mem_cache.pool_host.mha as pool_host_mha  # noqa: E402
import sglang.srt.mem_cache.pool_host.mla as pool_host_mla  # noqa: E402
from kvflow.integrations.sglang import KVFlowHiCacheStorage  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (  # noqa: E402
    build_kv_only_stack,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, publish  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

PAGE = 4
LAYERS = 2
DEVICE_TOKENS = 1024
WAIT_S = 30.0  # longest wait for one of the controller's queues
#: a tiny Llama for ServerArgs (read for its config only; no weights are loaded)
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
    "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 8, "num_hidden_layers": LAYERS, "vocab_size": 256,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16",
}  # fmt: skip
#: the controller's storage threads (its attributes)
STORAGE_THREADS = (
    "prefetch_thread",
    "prefetch_io_aux_thread",
    "prefetch_sync_thread",
    "backup_thread",
)


# -- CPU stand-ins for the GPU-only pieces ----------------------------------------------------


def cpu_transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """sgl-kernel's `transfer_kv_direct` (a CUDA op) on CPU tensors: token rows
    `src_indices` of each source layer into rows `dst_indices` of its destination."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


def no_host_register(buffer: torch.Tensor, granularity: int | None = None) -> None:
    """`cudaHostRegister` (page-locking the host pool for DMA) has nothing to do on CPU."""


def use_cpu_stand_ins() -> None:
    """Install the two CPU stand-ins into SGLang's host pool modules. On a CPU host
    they import no copy kernel at all (sgl-kernel only under CUDA/ROCm, its XPU build
    under XPU), and registering the pool calls `torch.cuda.cudart()`."""
    pool_host_mha.transfer_kv_direct = cpu_transfer_kv_direct
    pool_host_mla.transfer_kv_direct = cpu_transfer_kv_direct
    pool_host_common._cuda_host_register = no_host_register


# -- engines ---------------------------------------------------------------------------------


def kv_buffers(device: Any) -> list[torch.Tensor]:
    """A device pool's per-layer buffers: MLA's rows, or MHA's K then V."""
    if isinstance(device, MLATokenToKVPool):
        return list(device.kv_buffer)
    return list(device.k_buffer) + list(device.v_buffer)


@dataclass
class Engine:
    """One rank's device pool, allocator and HiCache controller (with kvflow attached)."""

    device: Any
    allocator: PagedTokenToKVPoolAllocator
    controller: HybridCacheController

    def device_rows(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """The device rows at `indices`, every layer (K and V for MHA), as raw bits."""
        return [b[indices].view(torch.int16).clone() for b in kv_buffers(self.device)]


def build_engine(endpoint: str, model_dir: Path, *, mla: bool, seed: int) -> Engine:
    """Publish an engine's ServerArgs and build its device pool (random bits) and the
    HiCache stack over it, as SGLang's scheduler does at start (the CPU stand-ins first)."""
    use_cpu_stand_ins()
    extra = synthetic.extra_config(endpoint, timeout_s=1)
    args = ServerArgs(
        model_path=str(model_dir), device="cpu", page_size=PAGE,
        enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_io_backend="direct",
        hicache_mem_layout="layer_first", hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )  # fmt: skip
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    if mla:
        device: Any = MLATokenToKVPool(
            DEVICE_TOKENS, PAGE, torch.bfloat16, kv_lora_rank=12, qk_rope_head_dim=4,
            layer_num=LAYERS, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
    else:
        device = MHATokenToKVPool(
            DEVICE_TOKENS, PAGE, torch.float16, head_num=2, head_dim=8, layer_num=LAYERS,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for buffer in kv_buffers(device):
        raw = buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, device.dtype, "cpu", device, False)
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
        page_size=PAGE,
    )  # fmt: skip
    _, controller = build_kv_only_stack(
        params=params, kv_pool=device, full_layer_mapping={i: i for i in range(LAYERS)},
        load_cache_event=threading.Event(), storage_backend="dynamic", use_mla=mla,
        model_name="tiny-llama", storage_backend_extra_config=extra,
    )  # fmt: skip
    assert isinstance(controller.storage_backend, KVFlowHiCacheStorage)
    assert controller.page_set_func == controller._page_set_zero_copy
    return Engine(device, allocator, controller)


@contextlib.contextmanager
def model_dir() -> Iterator[Path]:
    """A folder holding the tiny model's config.json."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(MODEL_CONFIG))
        yield Path(tmp)


# -- what the radix tree does ----------------------------------------------------------------


def tokens_of(pages: int, first: int) -> list[int]:
    """The token ids of a prompt of `pages` whole pages, `first` first."""
    return list(range(first, first + pages * PAGE))


def back_up(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """Write `tokens`' device rows through to the host pool (the controller's `write`),
    then to storage (`write_storage` -> its backup thread); the device rows and the
    tokens the backup thread reports stored."""
    cc = engine.controller
    device_indices = engine.allocator.alloc(len(tokens))
    host_indices = cc.write(device_indices)
    assert host_indices is not None, "host pool full"
    cc.ack_write_queue.pop(0).finish_event.synchronize()
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    op_id = cc.write_storage(host_indices, tokens, hash_value=hashes)
    done = cc.ack_backup_queue.get(timeout=WAIT_S)
    assert done.id == op_id
    return device_indices, int(done.completed_tokens)


def query(engine: Engine, tokens: list[int], rid: str) -> Any:
    """Start a storage prefetch of `tokens` and take its hit query's result (the
    controller's prefetch thread: `batch_exists` per batch of pages)."""
    started = engine.controller.prefetch(CacheRequestHandle(rid, 0), tokens)
    hit = engine.controller.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is started
    return hit


def fetch(engine: Engine, hit: Any) -> tuple[torch.Tensor, list[Any]]:
    """Give a hit host rows and hand it to the controller's I/O thread (`batch_get_v1`
    per batch), as the tree does; the host rows and the acks up to `completed_req`."""
    cc = engine.controller
    host_indices = cc.alloc_prefetch_host_buffers(hit, hit.storage_hit_count)
    hit.host_indices = host_indices
    cc.prefetch_buffer.put(hit)
    acks = []
    while not acks or not acks[-1].completed_req:
        acks.append(cc.ack_prefetch_queue.get(timeout=WAIT_S))
    return host_indices, acks


def load(engine: Engine, host_indices: torch.Tensor) -> torch.Tensor:
    """Load host rows onto fresh device rows (the controller's `load` + `start_loading`)."""
    cc = engine.controller
    device_indices = cc.load(host_indices)
    assert device_indices is not None, "device pool full"
    cc.start_loading()
    cc.ack_load_queue.pop(0).finish_event.synchronize()
    return device_indices


class _Failures(logging.Handler):
    """Collects ERROR records with a traceback (the controller's `logger.exception`)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@contextlib.contextmanager
def nothing_raises_in_threads(engines: list[Engine]) -> Iterator[None]:
    """Fail if a thread dies of an exception, or the controller catches one from the
    backend and logs it (`HiCache storage query/prefetch transfer/backup failed`), or a
    storage thread of `engines` (those listed by the end of the block) is gone."""
    died: Queue[threading.ExceptHookArgs] = Queue()
    previous_hook = threading.excepthook
    threading.excepthook = died.put
    failures = _Failures()
    logging.getLogger("sglang").addHandler(failures)
    try:
        yield
    finally:
        threading.excepthook = previous_hook
        logging.getLogger("sglang").removeHandler(failures)
    assert died.empty(), f"a thread raised: {died.get().exc_value!r}"
    assert not failures.records, [r.getMessage() for r in failures.records]
    for engine in engines:
        for name in STORAGE_THREADS:
            assert getattr(engine.controller, name).is_alive(), f"{name} ended"


def detach(engines: list[Engine]) -> None:
    """Stop each controller's storage threads and close its backend (SGLang's detach,
    which raises if a thread does not stop)."""
    for engine in engines:
        engine.controller.detach_storage_backend()


# -- checks ---------------------------------------------------------------------------------


def round_trip(*, mla: bool) -> None:
    """Controller A backs up 130 pages (two storage batches of SGLang's 128); controller
    B, with a fresh host pool, finds exactly those pages for the prompt plus one page
    more, prefetches them and loads them to its device rows bit for bit."""
    pages = 130
    tokens = tokens_of(pages, first=1000)
    engines: list[Engine] = []
    with model_dir() as config, kvflow_server(PAGE) as ep:
        with nothing_raises_in_threads(engines):
            a = build_engine(ep, config, mla=mla, seed=1)
            engines.append(a)
            rows_a, stored = back_up(a, tokens)
            assert stored == len(tokens), stored
            b = build_engine(ep, config, mla=mla, seed=2)
            engines.append(b)
            b.allocator.alloc(3 * PAGE)  # B's rows differ from A's
            b.controller.mem_pool_host.alloc(5 * PAGE)
            hit = query(b, tokens + tokens_of(1, first=99_000), "r-b")
            assert hit.storage_hit_count == len(tokens), hit.storage_hit_count
            assert hit.hash_value == get_storage_hash_str(tokens, None, page_size=PAGE)
            host_b, acks = fetch(b, hit)
            progress = [ack.completed_tokens for ack in acks if ack.completed_tokens is not None]
            assert progress == [128 * PAGE, len(tokens)], progress
            rows_b = load(b, host_b)
            assert not torch.equal(rows_a, rows_b)
            for layer_a, layer_b in zip(a.device_rows(rows_a), b.device_rows(rows_b), strict=True):
                assert torch.equal(layer_a, layer_b)
        detach(engines)


@check
def mha_controller_backs_up_and_a_second_one_prefetches_bit_exact() -> None:
    """MHA (float16, 2 layers, 2 KV heads x 8, pages of 4 tokens): see `round_trip`."""
    round_trip(mla=False)


@check
def mla_controller_backs_up_and_a_second_one_prefetches_bit_exact() -> None:
    """MLA (bfloat16 rows of 12 + 4): see `round_trip`."""
    round_trip(mla=True)


@check
def a_server_that_is_down_fails_the_controllers_operations_without_raising() -> None:
    """The server stopped: a prefetch whose hit query succeeded gets 0 tokens and
    completes, a backup reports 0 tokens stored, a new query hits nothing; a controller
    started while no server runs attaches kvflow and does the same. No thread raises,
    none ends, and each controller detaches cleanly. The server asks for a heartbeat a
    second (a 4 s timeout): closing a client waits out the heartbeat call in flight to
    the stopped server, 7.5 s at the default 30 s."""
    stored_tokens = tokens_of(3, first=2000)
    engines: list[Engine] = []
    with model_dir() as config, nothing_raises_in_threads(engines):
        with kvflow_server(PAGE, "--heartbeat-timeout-s", "4") as ep:
            a = build_engine(ep, config, mla=False, seed=1)
            engines.append(a)
            assert back_up(a, stored_tokens)[1] == len(stored_tokens)
            b = build_engine(ep, config, mla=False, seed=2)
            engines.append(b)
            hit = query(b, stored_tokens, "r-before")
            assert hit.storage_hit_count == len(stored_tokens)
        # the server is gone from here on
        _, acks = fetch(b, hit)
        assert [ack.completed_tokens for ack in acks[:-1]] == [0], acks
        assert back_up(a, tokens_of(3, first=3000))[1] == 0
        assert query(b, stored_tokens, "r-after").storage_hit_count == 0
        c = build_engine(ep, config, mla=False, seed=3)
        engines.append(c)
        assert query(c, stored_tokens, "r-never").storage_hit_count == 0
        assert back_up(c, tokens_of(2, first=4000))[1] == 0
    detach(engines)
