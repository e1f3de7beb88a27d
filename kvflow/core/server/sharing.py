"""Describe registered KV tensors for another process, and rebuild them there.

The client turns `kv_caches` (a tensor, a list of tensors, or a (K list, V list)
pair) into a `KVCachesDesc` naming each tensor's memory, shape, strides and
dtype; the server maps that memory and rebuilds tensors of the same nesting that
view it. Every description is bounds-checked against the memory it names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow.core.errors import InvalidRequestError
from kvflow.core.server.protocol import (
    CudaIpcMemory,
    FdMemory,
    KVCachesDesc,
    ShmMemory,
    TensorDesc,
)
from kvflow.core.server.shm import (
    Segment,
    map_memfd,
    map_segment,
    release_segment,
    shared_memory_of,
)

log = logging.getLogger("kvflow.server")

#: The dtypes KV caches may have (docs/KERNELS.md, KV cache formats).
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_TENSORS = 4096
MAX_DIMS = 8


def describe_kv_caches(kv_caches: Any) -> KVCachesDesc:
    """The wire description of `kv_caches`; InvalidRequestError for what cannot be shared."""
    if isinstance(kv_caches, torch.Tensor):
        return KVCachesDesc(kind="tensor", tensors=[describe_tensor(kv_caches, "kv_caches")])
    if isinstance(kv_caches, Sequence) and not isinstance(kv_caches, (str, bytes)):
        if len(kv_caches) == 2 and all(
            isinstance(half, Sequence) and not isinstance(half, torch.Tensor) for half in kv_caches
        ):
            keys, values = kv_caches
            tensors = [_describe_item(t, f"kv_caches[0][{i}]") for i, t in enumerate(keys)]
            tensors += [_describe_item(t, f"kv_caches[1][{i}]") for i, t in enumerate(values)]
            return KVCachesDesc(kind="pair", tensors=tensors, split=len(keys))
        tensors = [_describe_item(t, f"kv_caches[{i}]") for i, t in enumerate(kv_caches)]
        return KVCachesDesc(kind="list", tensors=tensors)
    raise InvalidRequestError(
        "kv_caches must be a tensor, a list of tensors or a (K list, V list) pair,"
        f" got {type(kv_caches).__name__}"
    )


def _describe_item(item: Any, where: str) -> TensorDesc:
    if not isinstance(item, torch.Tensor):
        raise InvalidRequestError(f"{where} must be a torch.Tensor, got {type(item).__name__}")
    return describe_tensor(item, where)


def describe_tensor(tensor: torch.Tensor, where: str) -> TensorDesc:
    """Describe one tensor's memory; CPU tensors must come from `empty_shared`."""
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise InvalidRequestError(
            f"{where} has dtype {tensor.dtype}, expected one of {', '.join(DTYPES)}"
        )
    memory: ShmMemory | FdMemory | CudaIpcMemory
    if tensor.device.type == "cpu":
        shm = shared_memory_of(tensor)
        if shm is None:
            raise InvalidRequestError(
                f"{where} is a CPU tensor not in shared memory, so a server process cannot"
                " see it: allocate it with kvflow.core.empty_shared(shape, dtype)"
            )
        memory = shm
    elif tensor.device.type == "cuda":
        from kvflow.core.server.ipc import cuda_ipc_memory_of

        memory = cuda_ipc_memory_of(tensor)
    else:
        raise InvalidRequestError(f"{where} is on {tensor.device}, expected a CPU or CUDA tensor")
    return TensorDesc(
        dtype=name, shape=tuple(tensor.shape), strides=tuple(tensor.stride()), memory=memory
    )


@dataclass
class OpenedKVCaches:
    """Rebuilt KV tensors (same nesting as the client's) and the GPU they live on, if any.

    `release()` drops the tensors, unmaps the shared-memory segments and closes
    the CUDA IPC mappings at once, so an unregistered instance holds no memory
    until a garbage collection.
    """

    kv_caches: Any
    cuda_device: int | None = None
    segments: list[Segment] = field(default_factory=list)
    #: the CUDA IPC mappings (ipc.CudaMapping) the tensors view, one entry per tensor
    cuda_mappings: list[Any] = field(default_factory=list)

    def release(self) -> bool:
        """Drop the tensors and unmap everything; False if a view elsewhere kept a segment."""
        self.kv_caches = None
        _close_cuda(self.cuda_mappings)
        return _release_all(self.segments)


def _close_cuda(mappings: list[Any]) -> None:
    if mappings:
        from kvflow.core.server.ipc import release_cuda_ipc

        while mappings:
            release_cuda_ipc(mappings.pop())


def _release_all(segments: list[Segment]) -> bool:
    ok = True
    while segments:
        segment = segments.pop()
        if not release_segment(segment):
            ok = False
            log.warning("a shared-memory segment is still viewed: unmapped once that view dies")
        del segment
    return ok


def open_kv_caches(desc: KVCachesDesc) -> OpenedKVCaches:
    """Map every described tensor's memory and rebuild the nesting (server side)."""
    if not 1 <= len(desc.tensors) <= MAX_TENSORS:
        raise InvalidRequestError(
            f"kv_caches must hold 1..{MAX_TENSORS} tensors, got {len(desc.tensors)}"
        )
    shm_cache: dict[str, torch.Tensor] = {}
    segments: list[Segment] = []
    devices: set[int] = set()
    tensors: list[torch.Tensor] = []
    cuda: list[Any] = []
    try:
        kv_caches, device = _open(desc, shm_cache, segments, devices, tensors, cuda)
    except BaseException:
        # the traceback still holds views: the mappings go when it does (no cycle)
        del tensors[:]
        shm_cache.clear()
        segments.clear()
        _close_cuda(cuda)
        raise
    return OpenedKVCaches(kv_caches, device, segments, cuda)


def _open(
    desc: KVCachesDesc,
    shm_cache: dict[str, torch.Tensor],
    segments: list[Segment],
    devices: set[int],
    tensors: list[torch.Tensor],
    cuda: list[Any],
) -> tuple[Any, int | None]:
    """open_kv_caches' work; what it maps goes into the caller's containers."""
    for i, tdesc in enumerate(desc.tensors):
        memory = tdesc.memory
        raw: torch.Tensor
        if isinstance(memory, (ShmMemory, FdMemory)):
            name = memory.name if isinstance(memory, ShmMemory) else f"fd:{memory.pid}:{memory.fd}"
            if name not in shm_cache:
                if isinstance(memory, ShmMemory):
                    shm_cache[name], segment = map_segment(memory)
                else:
                    shm_cache[name], segment = map_memfd(memory)
                segments.append(segment)
                del segment
            raw = shm_cache[name]
        else:
            from kvflow.core.server.ipc import open_cuda_ipc

            raw, mapping = open_cuda_ipc(memory)
            cuda.append(mapping)
            devices.add(raw.device.index or 0)
        tensors.append(view_described(raw, tdesc, f"kv_caches tensor {i}"))
    if desc.kind == "tensor":
        if len(tensors) != 1:
            raise InvalidRequestError(f"kind 'tensor' needs one tensor, got {len(tensors)}")
        kv_caches: Any = tensors[0]
    elif desc.kind == "list":
        kv_caches = tensors
    else:
        if not 0 <= desc.split <= len(tensors):
            raise InvalidRequestError(f"pair split {desc.split} outside 0..{len(tensors)}")
        kv_caches = (tensors[: desc.split], tensors[desc.split :])
    if len(devices) > 1:
        raise InvalidRequestError(f"kv_caches span several GPUs {sorted(devices)}, expected one")
    shm_cache.clear()
    return kv_caches, next(iter(devices), None)


def view_described(raw: torch.Tensor, tdesc: TensorDesc, where: str) -> torch.Tensor:
    """View `raw` (uint8 bytes of a whole segment/allocation) as the described tensor.

    Raises InvalidRequestError when the dtype is unknown, the shape or strides are
    malformed, the offset is misaligned, or the view would reach outside `raw`.
    """
    dtype = DTYPES.get(tdesc.dtype)
    if dtype is None:
        raise InvalidRequestError(
            f"{where} has dtype {tdesc.dtype!r}, expected one of {', '.join(DTYPES)}"
        )
    shape, strides = tdesc.shape, tdesc.strides
    if len(shape) != len(strides) or not 1 <= len(shape) <= MAX_DIMS:
        raise InvalidRequestError(
            f"{where}: shape {shape} and strides {strides} must have the same 1..{MAX_DIMS} dims"
        )
    if any(d < 0 for d in shape) or any(s < 0 for s in strides):
        raise InvalidRequestError(f"{where}: negative size or stride in {shape} / {strides}")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    offset = tdesc.memory.offset
    if offset < 0 or offset % itemsize:
        raise InvalidRequestError(f"{where}: byte offset {offset} is not a multiple of {itemsize}")
    extent = (
        0
        if 0 in shape
        else (sum((d - 1) * s for d, s in zip(shape, strides, strict=True)) + 1) * itemsize
    )
    nbytes = raw.numel()
    if offset + extent > nbytes:
        raise InvalidRequestError(
            f"{where}: shape {shape} strides {strides} {tdesc.dtype} at offset {offset} needs"
            f" {offset + extent} bytes, its memory has {nbytes}"
        )
    usable = nbytes - nbytes % itemsize
    elements = raw[:usable].view(dtype)
    return elements.as_strided(shape, strides, offset // itemsize)
