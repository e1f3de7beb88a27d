"""A synthetic inference engine driving a CacheEngine the way vLLM's connector would.

It owns a paged KV cache with a block allocator and its own prefix cache (freed
full blocks keep their contents until reused, least recently freed first). Per
request it reports block allocations, looks up and retrieves external hits
beyond its local prefix, "computes" the rest, stores the whole sequence and ends
the session. Block contents are a pure function of the block's prefix hash, so
every retrieved block is checked bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflow.core.demo.workload import SimRequest
from kvflow.core.engine.cache_engine import CacheEngine
from kvflow.core.engine.keys import chain_hashes
from kvflow.events import BlockAllocation
from kvflow.kernels import KVFormat, KVLayout, transfer_blocks
from kvflow.kernels.synthetic import make_kv_caches


@dataclass(frozen=True)
class ModelShape:
    """The synthetic model's KV geometry (small by default so the demo runs on a CPU)."""

    num_layers: int = 4
    num_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    num_blocks: int = 320


def kv_bytes_per_token(kv_format: KVFormat | str, shape: ModelShape) -> int:
    """Bytes one token's KV takes in `kv_format` at `shape` (measured on a one-block
    CPU cache), so the demo can size L1 before any engine exists."""
    caches, kwargs = make_kv_caches(
        kv_format, num_layers=shape.num_layers, num_blocks=1, block_size=shape.block_size,
        num_heads=shape.num_heads, head_size=shape.head_size, dtype=shape.dtype,
    )  # fmt: skip
    layout = KVLayout.from_kv_caches(caches, **kwargs)
    return layout.chunk_nbytes(shape.block_size) // shape.block_size


@dataclass
class RequestOutcome:
    """What one request saw: local and external hits, what it moved, what it verified."""

    prompt_tokens: int
    local_hit_tokens: int
    lookup_hit_tokens: int
    retrieved_tokens: int
    stored_tokens: int
    verified_blocks: int


@dataclass
class _Blocks:
    """The allocator: free blocks in LRU order and the prefix cache over full blocks."""

    free: OrderedDict[int, None]
    owner_hash: dict[int, bytes] = field(default_factory=dict)
    by_hash: dict[bytes, int] = field(default_factory=dict)
    refs: dict[int, int] = field(default_factory=dict)


class SimEngine:
    """One engine instance with a paged KV cache in `kv_format` on `device`."""

    def __init__(
        self,
        cache: CacheEngine,
        *,
        instance_id: str = "sim-engine-0",
        model_name: str = "sim-model",
        kv_format: KVFormat | str = KVFormat.VLLM_FLASH_ATTN,
        shape: ModelShape | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cache = cache
        self.instance_id = instance_id
        self.model_name = model_name
        self.shape = shape or ModelShape()
        s = self.shape
        self.kv_caches, kwargs = make_kv_caches(
            kv_format, num_layers=s.num_layers, num_blocks=s.num_blocks,
            block_size=s.block_size, num_heads=s.num_heads, head_size=s.head_size,
            dtype=s.dtype, device=device,
        )  # fmt: skip
        self.layout = KVLayout.from_kv_caches(self.kv_caches, **kwargs)
        self.block_nbytes = self.layout.chunk_nbytes(s.block_size)
        self.blocks = _Blocks(free=OrderedDict.fromkeys(range(s.num_blocks)))
        cache.register_kv_caches(
            instance_id, self.kv_caches, model_name=model_name,
            block_size=s.block_size, kv_format=str(KVFormat(kv_format).value),
        )  # fmt: skip

    # -- block contents -------------------------------------------------------------

    def _contents(self, hashes: list[bytes]) -> torch.Tensor:
        """The bytes each block with these prefix hashes holds: the hash, tiled."""
        reps = -(-self.block_nbytes // len(hashes[0]))
        rows = [np.frombuffer(h * reps, dtype=np.uint8)[: self.block_nbytes] for h in hashes]
        return torch.from_numpy(np.stack(rows)).to(self.layout.device)

    def _write_blocks(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """ "Compute" blocks: write their contents into the KV cache."""
        if block_ids:
            ids = torch.tensor(block_ids, dtype=torch.int64).view(-1, 1)
            transfer_blocks(self.layout, self._contents(hashes), ids, direction="scatter")

    def _check_blocks(self, block_ids: list[int], hashes: list[bytes]) -> int:
        """Gather blocks and compare them with their expected contents; returns how many."""
        if not block_ids:
            return 0
        ids = torch.tensor(block_ids, dtype=torch.int64).view(-1, 1)
        got = torch.empty((len(block_ids), self.block_nbytes), dtype=torch.uint8,
                          device=self.layout.device)  # fmt: skip
        transfer_blocks(self.layout, got, ids, direction="gather")
        if not torch.equal(got, self._contents(hashes)):
            raise AssertionError(f"retrieved KV blocks {block_ids} differ from what was stored")
        return len(block_ids)

    # -- allocator ----------------------------------------------------------------------

    def _take_cached(self, h: bytes) -> int | None:
        b = self.blocks
        block = b.by_hash.get(h)
        if block is None:
            return None
        b.free.pop(block, None)
        b.refs[block] = b.refs.get(block, 0) + 1
        return block

    def _allocate(self) -> int:
        b = self.blocks
        if not b.free:
            raise RuntimeError("the synthetic engine ran out of KV blocks; raise num_blocks")
        block, _ = b.free.popitem(last=False)
        old = b.owner_hash.pop(block, None)
        if old is not None:
            del b.by_hash[old]
        b.refs[block] = 1
        return block

    def _cache_block(self, block: int, h: bytes) -> None:
        b = self.blocks
        if h not in b.by_hash:
            b.by_hash[h] = block
            b.owner_hash[block] = h

    def _release(self, table: list[int]) -> None:
        b = self.blocks
        for block in table:
            b.refs[block] -= 1
            if b.refs[block] == 0:
                del b.refs[block]
                b.free[block] = None
                if block not in b.owner_hash:
                    b.free.move_to_end(block, last=False)  # contentless blocks are reused first

    # -- one request ------------------------------------------------------------------------

    def serve(self, req: SimRequest) -> RequestOutcome:
        """Prefill (local hits, external hits, compute), decode, store, release, end session."""
        bs = self.shape.block_size
        rid = req.request_id
        prompt = req.prompt
        full = np.concatenate([prompt, req.output])
        hashes = chain_hashes(full, bs)
        n_prompt_full = len(prompt) // bs
        table: list[int] = []
        for h in hashes[:n_prompt_full]:
            block = self._take_cached(h)
            if block is None:
                break
            table.append(block)
        local = len(table)
        while len(table) * bs < len(prompt):
            table.append(self._allocate())
        self.cache.report_block_allocations(
            self.instance_id,
            [BlockAllocation(rid, table[:n_prompt_full], prompt[: n_prompt_full * bs].tolist())],
        )
        hit = self.cache.lookup(prompt, model_name=self.model_name, request_id=rid)
        computed = local * bs
        retrieved = verified = 0
        if hit > computed:
            retrieved = self.cache.retrieve(
                self.instance_id, prompt, table, request_id=rid, skip_first_n_tokens=computed
            )
            got = retrieved // bs
            verified = self._check_blocks(table[local:got], hashes[local:got])
            computed = max(computed, retrieved)
        first_new = computed // bs
        self._write_blocks(table[first_new:n_prompt_full], hashes[first_new:n_prompt_full])
        for j in range(n_prompt_full):
            self._cache_block(table[j], hashes[j])
        # decode: blocks are reported (and cached) once they are full
        while len(table) * bs < len(full):
            table.append(self._allocate())
        n_full = len(full) // bs
        self._write_blocks(table[n_prompt_full:n_full], hashes[n_prompt_full:n_full])
        if n_full > n_prompt_full:
            self.cache.report_block_allocations(
                self.instance_id,
                [
                    BlockAllocation(
                        rid,
                        table[n_prompt_full:n_full],
                        full[n_prompt_full * bs : n_full * bs].tolist(),
                    )
                ],
            )
        for j in range(n_prompt_full, n_full):
            self._cache_block(table[j], hashes[j])
        stored = self.cache.store(self.instance_id, full, table, request_id=rid)
        self._release(table)
        self.cache.end_session(rid)
        return RequestOutcome(len(prompt), local * bs, hit, retrieved, stored, verified)

    def close(self) -> None:
        self.cache.unregister(self.instance_id)
