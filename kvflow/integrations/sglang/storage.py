"""`KVFlowHiCacheStorage`: SGLang's HiCache storage tier (`HiCacheStorage`) over a kvflow server.

SGLang builds it through its `StorageBackendFactory` (`--hicache-storage-backend
dynamic`) and calls it from its prefetch and backup threads with page keys (hash
chains) and host-pool indices. The host pool lives in a memfd (SGLang's `shm`
allocator), which this rank registers with the server as its KV cache, one kvflow
block per page: `batch_get_v1` / `batch_set_v1` are one retrieve / store each, the
server copying between its L1 and the pool's pages, so a page moves once and never
through a Python object; `batch_exists` is one lookup. Every failure (server down,
restarted, slow, a page evicted) is a False or a shorter prefix, logged, never an
exception into SGLang's threads. docs/SGLANG.md says how to run it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import blake3
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvflow.core import KVFlowClient
from kvflow.core.errors import KVFlowError, UnknownInstanceError
from kvflow.core.server.shm import forget_memfd, share_memfd
from kvflow.integrations.sglang.config import StorageConfig
from kvflow.integrations.sglang.identity import RankIdentity, rank_identity
from kvflow.integrations.sglang.layout import HostPoolViews, host_pool_views, is_mla_pool, page_ids

log = logging.getLogger("kvflow.sglang")

#: separates SGLang's page names from kvflow's token-chain keys (chunk_keys.py)
KEY_LABEL = b"kvflow/sglang-page/v1\0"
#: at most this many measurements wait for get_stats (SGLang reads them every few seconds)
STATS_KEPT = 4096

T = TypeVar("T")


def chunk_key(page_key: str) -> bytes:
    """kvflow's 32-byte chunk key for one SGLang page key."""
    return blake3.blake3(KEY_LABEL + page_key.encode()).digest()


class _Stats:
    """Pages per batch and GB/s of gets and sets since the last `get_stats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics = StorageMetrics()

    def add(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            counts = getattr(self._metrics, f"{kind}_pgs")
            rates = getattr(self._metrics, f"{kind}_bandwidth")
            if len(counts) < STATS_KEPT:
                counts.append(pages)
                rates.append(nbytes / max(seconds, 1e-9) / 1e9)

    def take(self) -> StorageMetrics:
        with self._lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        return metrics


class KVFlowHiCacheStorage(HiCacheStorage):
    """SGLang's storage tier over a `kvflow server` (docs/SGLANG.md)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.config = StorageConfig.from_extra_config(storage_config.extra_config)
        #: the server this rank talks to: the endpoint's first until the rank is known
        #: (`register_mem_pool_host`), then, with a server per rank, the rank's own
        self.endpoint = self.config.endpoints[0]
        self.client = self._client_of(self.endpoint)
        #: the ranks a lookup counts: all of the world's (None), or with a server per
        #: rank only this one, which is all its server holds
        self._ranks: list[int] | None = None
        self.identity: RankIdentity | None = None
        self.views: HostPoolViews | None = None
        self.page_bytes = 0
        self._registered = False
        self._state = threading.Lock()  # guards _registered (never held over a call)
        self._ids = itertools.count()
        self._stats = _Stats()
        self._shared: torch.Tensor | None = None

    def _client_of(self, endpoint: str) -> KVFlowClient:
        return KVFlowClient(
            endpoint,
            timeout_s=self.config.timeout_s,
            curve_server_key=self.config.curve_server_key,
            curve_key=self.config.curve_key,
        )

    # -- the host pool ---------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Describe the pool's pages to kvflow and register them with the server.

        Raises ValueError when the pool cannot be shared (not in a memfd, an unsupported
        layout) or the server's chunks are not SGLang's pages: configuration errors SGLang
        reports at attach. A server that does not answer is not one: registration is
        retried by the first batch that needs it.
        """
        super().register_mem_pool_host(mem_pool_host)
        views = host_pool_views(mem_pool_host)
        fd = getattr(mem_pool_host, "fd", None)
        if fd is None:
            raise ValueError(
                'SGLang\'s host pool is not in shared memory: add "allocator": "shm" to'
                " --hicache-storage-backend-extra-config"
            )
        share_memfd(mem_pool_host.kv_buffer, fd)
        self._shared = mem_pool_host.kv_buffer
        self.views = views
        self.identity = rank_identity(
            self.storage_config, self.config, mem_pool_host.dtype, is_mla_pool(mem_pool_host)
        )
        endpoint, own = self.config.server_of(self.identity.world_size, self.identity.rank)
        if own:
            self._ranks = [self.identity.rank]
        if endpoint != self.endpoint:
            self.client.close()
            self.endpoint, self.client = endpoint, self._client_of(endpoint)
        self.page_bytes = views.page_size * int(mem_pool_host.get_size_per_token())
        try:
            self._register()
        except ValueError:
            raise
        except Exception as exc:  # the server may come later: the batches retry
            log.warning(
                "kvflow: registering %s failed (%s); will retry", self.identity.instance_id, exc
            )

    def _register(self) -> None:
        """Register the pool; ValueError if the server's chunk is not one page."""
        assert self.views is not None and self.identity is not None
        ident, page = self.identity, self.views.page_size
        chunk = self.client.status().get("chunk_size")
        if chunk != page:
            raise ValueError(
                f"the kvflow server at {self.endpoint} stores chunks of {chunk} tokens"
                f" but SGLang's pages hold {page}: start it with --chunk-size {page}"
            )
        self.client.register_kv_caches(
            ident.instance_id, self.views.layers, model_name=ident.model_name,
            world_size=ident.world_size, rank=ident.rank, block_size=self.views.page_size,
            kv_format=self.views.kv_format,
        )  # fmt: skip
        with self._state:
            self._registered = True
        log.info(
            "kvflow: %s registered (%s, world %d rank %d, %s pages of %d tokens)",
            ident.instance_id, ident.model_name, ident.world_size, ident.rank,
            self.views.num_pages, self.views.page_size,
        )  # fmt: skip

    def _transfer(self, call: Callable[[], T]) -> T:
        """Run a store/retrieve, registering first if needed and once more if the server
        forgot this rank (it restarted, or reaped it while the engine was idle)."""
        with self._state:
            registered = self._registered
        if not registered:
            self._register()
        try:
            return call()
        except UnknownInstanceError:
            with self._state:
                self._registered = False
            self._register()
            return call()

    # -- existence ------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """Pages of the longest prefix of `keys` every rank of this world holds (one lookup;
        with a server per rank, this rank alone: SGLang takes the least of its TP ranks'
        answers); 0 when the server cannot say."""
        if not keys or self.identity is None:
            return 0
        ident = self.identity
        try:
            hit = self.client.lookup(
                None, model_name=ident.model_name, world_size=ident.world_size,
                cache_salt=self.config.cache_salt, chunk_keys=[chunk_key(k) for k in keys],
                ranks=self._ranks,
            )  # fmt: skip
        except Exception as exc:
            log.warning("kvflow: lookup of %d pages failed: %s", len(keys), exc)
            return 0
        return min(len(keys), hit // self._page_size)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV prefix as in `batch_exists`; pools beside KV (Mamba, SWA, indexer) are not
        stored by kvflow, so a request that needs one has no hit."""
        if any(t.name != PoolName.KV for t in pool_transfers or []):
            return PoolTransferResult(0, {})
        pages = self.batch_exists(keys, extra_info)
        return PoolTransferResult(pages, {PoolName.KV: pages} if pages else {})

    # -- zero-copy gets and sets ----------------------------------------------------------

    @property
    def _page_size(self) -> int:
        return self.views.page_size if self.views is not None else 1

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load the pages of `keys` into the host pool at `host_indices`: True for each page
        of the prefix that landed, False from the first that did not."""
        return self._move("prefetch", keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the pages at `host_indices` under `keys`: True for each page of the prefix
        the server now holds."""
        return self._move("backup", keys, host_indices)

    def _move(self, kind: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        if self.identity is None:
            log.warning("kvflow: %s before a host pool was registered", kind)
            return [False] * len(keys)
        ident, page = self.identity, self._page_size
        started = time.perf_counter()
        try:
            blocks = page_ids(host_indices, page, len(keys)).numpy()
            names = [chunk_key(k) for k in keys]
            rid = f"{ident.instance_id}-{kind}-{next(self._ids)}"
            salt = self.config.cache_salt
            move = self.client.store if kind == "backup" else self.client.retrieve
            call = functools.partial(
                move, ident.instance_id, None, blocks, request_id=rid, cache_salt=salt,
                chunk_keys=names,
            )  # fmt: skip
            done = self._transfer(call)
        except (KVFlowError, ValueError, OSError) as exc:
            log.warning("kvflow: %s of %d pages failed: %s", kind, len(keys), exc)
            return [False] * len(keys)
        except Exception:  # never into SGLang's threads
            log.exception("kvflow: %s of %d pages failed", kind, len(keys))
            return [False] * len(keys)
        pages = min(len(keys), done // page)
        self._stats.add(kind, pages, pages * self.page_bytes, time.perf_counter() - started)
        return [True] * pages + [False] * (len(keys) - pages)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """The KV pool's transfer as `batch_get_v1`; other pools are not stored (False)."""
        return {t.name: self._pool_transfer(t, self.batch_get_v1) for t in transfers}

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """The KV pool's transfer as `batch_set_v1`; other pools are not stored (False)."""
        return {t.name: self._pool_transfer(t, self.batch_set_v1) for t in transfers}

    @staticmethod
    def _pool_transfer(
        transfer: PoolTransfer, move: Callable[[list[str], torch.Tensor], list[bool]]
    ) -> list[bool]:
        keys = transfer.keys or []
        if transfer.name != PoolName.KV or transfer.host_indices is None:
            return [False] * len(keys)
        return move(keys, transfer.host_indices)

    # -- the copying interface, which this backend does not offer --------------------------
    # SGLang uses it only without "interface_v1", which StorageConfig refuses at start.

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        log.error('kvflow: get() copies through Python; set "interface_v1": 1')
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[None]:
        log.error('kvflow: batch_get() copies through Python; set "interface_v1": 1')
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        log.error('kvflow: set() copies through Python; set "interface_v1": 1')
        return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:  # fmt: skip
        log.error('kvflow: batch_set() copies through Python; set "interface_v1": 1')
        return False

    # -- metrics and shutdown ---------------------------------------------------------------

    def get_stats(self) -> StorageMetrics:
        """Pages per batch and GB/s of the gets (prefetch) and sets (backup) since the last
        call, for SGLang's storage metrics."""
        return self._stats.take()

    def close(self) -> None:
        """Unregister this rank (best effort) and close the client."""
        ident = self.identity
        with self._state:
            registered, self._registered = self._registered, False
        if registered and ident is not None:
            try:
                self.client.unregister(ident.instance_id)
            except Exception as exc:
                log.warning("kvflow: unregistering %s failed: %s", ident.instance_id, exc)
        if self._shared is not None:
            forget_memfd(self._shared)
            self._shared = None
        self.client.close()
