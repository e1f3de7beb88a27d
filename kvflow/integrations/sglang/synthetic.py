"""SGLang host pools on CPU, filled with random bytes, and the backend over them, as
SGLang's HiCache builds them: for kvflow's checks and benchmarks, and for users' own.

`mha_pool` / `mla_pool` build SGLang's own `MHATokenToKVPoolHost` /
`MLATokenToKVPoolHost` over CPU "device" buffers, in a memfd (SGLang's `shm`
allocator, which kvflow needs); `fill` makes every byte random; `page_keys` names
pages; `extra_config` is the `--hicache-storage-backend-extra-config` a user passes and
`build_backend` makes `KVFlowHiCacheStorage` through SGLang's `StorageBackendFactory`,
then hands it the host pool, as SGLang's HiCache controller does. Like
`kvflow.kernels.synthetic` it is no testing utility: benchmarks import it too.

SGLang is imported inside the functions: on the CPU test venv (docs/SGLANG.md)
`allow_torchvision_without_its_operators` must run before SGLang, hence torchvision,
is first imported.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvflow.integrations.sglang.storage import KVFlowHiCacheStorage

#: the two operators torchvision's Python package registers fake kernels for at import
TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_torchvision_library: torch.library.Library | None = None


def _torchvision_operators_load() -> bool:
    """Whether torchvision's C operators load beside this torch (or there is no
    torchvision to import): then nothing needs declaring."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            library = Path(folder) / f"_C{suffix}"
            if library.exists():
                try:
                    torch.ops.load_library(str(library))
                except (OSError, RuntimeError):
                    return False
                return True
    return False


def allow_torchvision_without_its_operators() -> None:
    """Let SGLang import where torchvision's C operators cannot load (a CUDA build of
    torchvision beside a CPU torch, as in kvflow's SGLang test venv).

    SGLang 0.5.23 imports torchvision on every path to its memory pools, and torchvision's
    import fails at `register_fake("torchvision::nms")` (also `qnms`) when its operators
    are missing. This declares those two schemas, with no kernel, so the pure-Python package
    imports; calling either operator then fails loudly. Where torchvision's operators load
    (or it is not installed) it declares nothing. Call it before SGLang is first imported;
    later calls do nothing.
    """
    global _torchvision_library
    if _torchvision_library is not None or _torchvision_operators_load():
        return
    _torchvision_library = torch.library.Library("torchvision", "DEF")
    for schema in TORCHVISION_SCHEMAS:
        _torchvision_library.define(schema)


def _data_ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    *,
    heads: int = 2,
    head_dim: int = 8,
    page_size: int = 4,
    device_tokens: int = 64,
    layers: int = 2,
) -> Any:
    """SGLang's MHA host pool (`MHATokenToKVPoolHost`, float16) in `layout`, on CPU in a
    memfd, twice the size of the CPU "device" buffers of `device_tokens` tokens it backs."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    shape = (device_tokens, heads, head_dim)
    k = tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(layers))
    v = tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_data_ptrs(k), v_data_ptrs=_data_ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
        dtype=torch.float16, device=torch.device("cpu"),
    )  # fmt: skip
    return MHATokenToKVPoolHost(
        info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu", allocator_type="shm",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
    )  # fmt: skip


def mla_pool(
    layout: str,
    *,
    kv_lora_rank: int = 12,
    rope_dim: int = 4,
    page_size: int = 4,
    device_tokens: int = 64,
    layers: int = 2,
) -> Any:
    """SGLang's MLA host pool (`MLATokenToKVPoolHost`, bfloat16, rows of `kv_lora_rank +
    rope_dim` values: 16 or a multiple of 8 for `page_unified`) in `layout`, on CPU in a memfd."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dim = kv_lora_rank + rope_dim
    rows = tuple(torch.zeros(device_tokens, 1, dim, dtype=torch.bfloat16) for _ in range(layers))
    info = MLABufferInfo(
        buffers=rows, data_ptrs=_data_ptrs(rows), layer_indices=tuple(range(layers)),
        device_layer_num=layers, page_size=page_size, kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim, kv_cache_dim=dim, dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )  # fmt: skip
    return MLATokenToKVPoolHost(
        info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu", allocator_type="shm",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=layers,
        target_layer_num=layers,
    )  # fmt: skip


def fill(pool: Any, seed: int) -> None:
    """Make every byte of `pool`'s buffer random (any bit pattern, NaNs included)."""
    gen = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_keys(n: int, tag: str = "chain") -> list[str]:
    """`n` distinct page keys of SGLang's length (64 characters), told apart by `tag`."""
    return [f"{tag}-{i:04d}".ljust(64, "0") for i in range(n)]


def extra_config(endpoint: str, **kvflow: Any) -> dict[str, Any]:
    """The `--hicache-storage-backend-extra-config` a user passes for kvflow at `endpoint`;
    keyword arguments become `kvflow.<name>` keys (`timeout_s=1` -> `"kvflow.timeout_s": 1`)."""
    config: dict[str, Any] = {
        "backend_name": "kvflow",
        "module_path": "kvflow.integrations.sglang",
        "class_name": "KVFlowHiCacheStorage",
        "interface_v1": 1,
        "allocator": "shm",
        "kvflow.endpoint": endpoint,
    }
    config.update({f"kvflow.{k}": v for k, v in kvflow.items()})
    return config


def storage_config(
    extra: dict[str, Any],
    *,
    mla: bool = False,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    model: str = "tiny-model",
) -> Any:
    """SGLang's `HiCacheStorageConfig` of one rank (storage metrics on) with `extra`."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
        is_page_first_layout=False, model_name=model, extra_config=extra,
    )  # fmt: skip


def build_backend(
    pool: Any,
    endpoint: str,
    *,
    mla: bool = False,
    tp_size: int = 1,
    tp_rank: int = 0,
    pp_size: int = 1,
    pp_rank: int = 0,
    model: str = "tiny-model",
    **kvflow: Any,
) -> KVFlowHiCacheStorage:
    """`KVFlowHiCacheStorage` as SGLang's HiCache controller builds it: through
    `StorageBackendFactory` from `extra_config(endpoint, **kvflow)`, then given `pool`
    (`register_mem_pool_host`)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvflow.integrations.sglang.storage import KVFlowHiCacheStorage

    config = storage_config(
        extra_config(endpoint, **kvflow), mla=mla, tp_size=tp_size, tp_rank=tp_rank,
        pp_size=pp_size, pp_rank=pp_rank, model=model,
    )  # fmt: skip
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    if not isinstance(made, KVFlowHiCacheStorage):
        raise TypeError(f"SGLang's factory built a {type(made).__name__}")
    made.register_mem_pool_host(pool)
    return made
