"""The connector's scheduler side: lookups, load and store plans, block reports, sessions.

Written against the few attributes of vLLM's objects it reads (`Request`:
request_id, prompt_token_ids, all_token_ids, num_tokens, cache_salt;
`KVCacheBlocks.get_block_ids()`; `SchedulerOutput`: scheduled_new_reqs,
scheduled_cached_reqs, num_scheduled_tokens), so it runs without vLLM too.

One lookup per request, over its prompt's whole chunks, runs on a background
thread: until its answer is in, `get_num_new_matched_tokens` returns None (vLLM
asks again next step), so a slow server never stalls a scheduler step. A lookup
that fails or times out (`kvflow.lookup_timeout_s`) counts as a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kvflow.core import KVFlowClient
from kvflow.core.arrays import as_int32_array
from kvflow.integrations.vllm.config import ConnectorConfig
from kvflow.integrations.vllm.plan import LoadSpec, StepPlan, StoreSpec

log = logging.getLogger("kvflow.integrations.vllm")

#: threads running lookups, chunk-size queries and end_session calls
LOOKUP_THREADS = 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Tracked:
    """What the scheduler side knows of one request."""

    request: Any
    #: the prompt's token ids as int32, converted once (by the lookup, else the first plan)
    prompt: np.ndarray | None = None
    lookup: Future[int] | None = None
    #: the local (block-aligned) computed tokens and vLLM's external tokens of a pending load
    load: tuple[int, int] | None = None
    #: the request's block table (KV cache group 0)
    blocks: list[int] = field(default_factory=list)
    #: prompt tokens already in kvflow (loaded from it, or stored)
    stored: int = 0
    #: tokens the lookup found (whole chunks); None until known
    hit: int | None = None
    #: vLLM's own (block-aligned) computed tokens when it last asked for a match
    local: int = 0


class SchedulerSide:
    """Everything `KVFlowConnector` does in vLLM's scheduler process."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        model_name: str,
        world_size: int,
        block_size: int,
        client_factory: Callable[[str], KVFlowClient] | None = None,
        block_hashes: Callable[[Any, int], list[Any]] | None = None,
    ) -> None:
        """`client_factory(endpoint)` makes the clients (default: KVFlowClient with the
        config's lookup timeout and keys): one, or one per rank when the config lists a
        server per rank, each then asked for its own rank (`ranks=[r]`)."""
        self.config = config
        self.model_name = model_name
        self.world_size = world_size
        self.block_size = block_size
        #: (request, n) -> vLLM's hashes of its first n blocks, for the KV events (None: off)
        self._block_hashes = block_hashes
        factory = client_factory or (
            lambda endpoint: KVFlowClient(
                endpoint,
                timeout_s=config.lookup_timeout_s,
                curve_server_key=config.curve_server_key,
                curve_key=config.curve_key,
            )
        )
        self._clients = [factory(endpoint) for endpoint in config.rank_endpoints(world_size)]
        self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvflow-lookup")
        self._requests: dict[str, _Tracked] = {}
        self._chunk_size: Future[int] = self._pool.submit(self._ask_chunk_size)
        #: lookups answered, and the tokens they matched (what get_num_new_matched_tokens saw)
        self.lookups = 0
        self.matched_tokens = 0

    # -- the chunk size (stores are planned in whole chunks) ---------------------------------

    def _ask_chunk_size(self) -> int:
        sizes = {int(client.status()["chunk_size"]) for client in self._clients}
        if len(sizes) > 1:
            raise ValueError(f"the ranks' servers have different chunk sizes {sorted(sizes)}")
        (size,) = sizes
        if size % self.block_size:
            log.error(
                "kvflow: the server's chunk size %d is not a multiple of vLLM's block size %d:"
                " nothing can be stored (start kvflow server with --chunk-size a multiple of it)",
                size,
                self.block_size,
            )
        return size

    def chunk_size(self) -> int | None:
        """The server's chunk size once known; a failed query is asked again."""
        future = self._chunk_size
        if not future.done():
            return None
        if future.exception() is not None:
            log.warning(
                "kvflow: no chunk size from %s: %s", self.config.endpoint, future.exception()
            )
            self._chunk_size = self._pool.submit(self._ask_chunk_size)
            return None
        size = future.result()
        return size if size % self.block_size == 0 else None

    # -- vLLM's scheduler hooks ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens vLLM may load beyond its own `num_computed_tokens`; None = ask again."""
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(request)
            self._requests[request.request_id] = tracked
            if self.config.load:
                tracked.lookup = self._pool.submit(self._lookup, tracked)
                return None, False  # always: the answer comes on a later step
        tracked.request = request
        if tracked.lookup is None:
            return 0, False
        if tracked.hit is None:
            if not tracked.lookup.done():
                return None, False
            tracked.hit = self._answer(tracked.lookup, request.request_id)
            self.lookups += 1
            self.matched_tokens += tracked.hit
            log.info(
                "kvflow lookup: request %s matched %d of %d prompt tokens",
                request.request_id,
                tracked.hit,
                len(request.prompt_token_ids),
            )
        # vLLM must compute at least one token itself (the last one gives the logits)
        usable = min(tracked.hit, request.num_tokens - 1)
        need = usable - num_computed_tokens
        tracked.local = num_computed_tokens
        return (need, False) if need > 0 else (0, False)

    @staticmethod
    def _prompt(tracked: _Tracked) -> np.ndarray:
        """The request's prompt as an int32 array, converted on first use only: the lookup,
        the loads and the stores all send slices of it (vLLM's prompt is a list)."""
        if tracked.prompt is None:
            tracked.prompt = as_int32_array(tracked.request.prompt_token_ids, "prompt_token_ids")
        return tracked.prompt

    def _lookup(self, tracked: _Tracked) -> int:
        """Hit tokens every rank holds: one server's answer, or with a server per rank
        the shortest of theirs (each asked for its own rank; a miss stops the round)."""
        request = tracked.request
        ask = partial(
            KVFlowClient.lookup,
            token_ids=self._prompt(tracked),
            model_name=self.model_name,
            world_size=self.world_size,
            cache_salt=self._salt(request),
            request_id=request.request_id,
        )
        if len(self._clients) == 1:
            return ask(self._clients[0])
        hit = -1
        for rank, client in enumerate(self._clients):
            got = ask(client, ranks=[rank])
            hit = got if hit < 0 else min(hit, got)
            if not hit:
                break
        return hit

    @staticmethod
    def _answer(lookup: Future[int], req_id: str) -> int:
        try:
            return lookup.result()
        except Exception as exc:
            log.warning("kvflow: lookup for %s failed, running it as a miss: %s", req_id, exc)
            return 0

    def _salt(self, request: Any) -> str | None:
        return getattr(request, "cache_salt", None) or self.config.cache_salt

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember a load vLLM agreed to; it is planned when the request is scheduled."""
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            return
        if num_external_tokens <= 0 or tracked.hit is None:
            tracked.load = None
            return
        tracked.load = (tracked.local, num_external_tokens)
        if blocks is not None:
            tracked.blocks = list(blocks.get_block_ids()[0])

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's loads, stores and block reports."""
        plan = StepPlan()
        chunk = self.chunk_size()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:
                continue
            blocks = list(new.block_ids[0]) if new.block_ids else []
            self._allocated(plan, tracked, 0, blocks)
            tracked.blocks = blocks
            end = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._plan_load(plan, tracked)
            self._plan_store(plan, tracked, end, chunk)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            added = list(new_ids[0]) if new_ids else []
            if req_id in resumed:
                tracked.blocks = []
            self._allocated(plan, tracked, len(tracked.blocks), added)
            tracked.blocks.extend(added)
            end = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._plan_load(plan, tracked)
            self._plan_store(plan, tracked, end, chunk)
        return plan

    def _allocated(self, plan: StepPlan, tracked: _Tracked, first: int, blocks: list[int]) -> None:
        if not blocks or not self.config.report_allocations:
            return
        bs = self.block_size
        held = list(tracked.request.all_token_ids[first * bs : (first + len(blocks)) * bs])
        plan.allocations.append((tracked.request.request_id, blocks, held))

    def _plan_load(self, plan: StepPlan, tracked: _Tracked) -> None:
        if tracked.load is None or tracked.hit is None:
            return
        local, _external = tracked.load
        tracked.load = None
        prompt = self._prompt(tracked)
        # whole chunks only, and only as far as the allocated blocks reach
        end = min(tracked.hit, len(tracked.blocks) * self.block_size)
        if end <= local:
            return
        plan.loads.append(
            LoadSpec(
                req_id=tracked.request.request_id,
                token_ids=prompt[:end],
                block_ids=tracked.blocks[: _ceil_div(end, self.block_size)],
                skip_tokens=local,
                cache_salt=self._salt(tracked.request),
                block_hashes=self._hashes(tracked.request, end),
            )
        )
        tracked.stored = max(tracked.stored, end)

    def _plan_store(self, plan: StepPlan, tracked: _Tracked, end: int, chunk: int | None) -> None:
        if not self.config.store or chunk is None:
            return
        prompt = self._prompt(tracked)
        full = min(end, len(prompt), len(tracked.blocks) * self.block_size)
        full -= full % chunk
        if full <= tracked.stored:
            return
        plan.stores.append(
            StoreSpec(
                req_id=tracked.request.request_id,
                token_ids=prompt[:full],
                block_ids=tracked.blocks[: _ceil_div(full, self.block_size)],
                cache_salt=self._salt(tracked.request),
                block_hashes=self._hashes(tracked.request, full),
            )
        )
        tracked.stored = full

    def _hashes(self, request: Any, tokens: int) -> list[Any]:
        """vLLM's hashes of the full blocks of the first `tokens` (KV events only)."""
        if self._block_hashes is None:
            return []
        return self._block_hashes(request, tokens // self.block_size)

    def load_failed(self, block_ids: set[int]) -> None:
        """Workers could not fill these blocks: vLLM recomputes them, and the chunks they
        hold are stored again once recomputed (the server may have lost them)."""
        if not block_ids or not self._chunk_size.done():
            return
        chunk = self.chunk_size() or 0
        for tracked in self._requests.values():
            hit = next((i for i, b in enumerate(tracked.blocks) if b in block_ids), None)
            if hit is not None and chunk:
                first_lost = hit * self.block_size
                tracked.stored = min(tracked.stored, first_lost - first_lost % chunk)

    def request_finished(self, request: Any) -> None:
        """Forget the request and end its kvflow session (in the background)."""
        tracked = self._requests.pop(request.request_id, None)
        if tracked is not None and tracked.lookup is not None:
            self._pool.submit(self._end_session, request.request_id)

    def _end_session(self, req_id: str) -> None:
        for client in self._clients:  # every server a lookup may have asked
            try:
                client.end_session(req_id)
            except Exception as exc:
                log.warning("kvflow: end_session for %s failed: %s", req_id, exc)

    def tracked(self) -> Sequence[str]:
        """Request ids the scheduler side holds state for (tests)."""
        return list(self._requests)

    def shutdown(self) -> None:
        """Let queued end_session calls finish, then close the client."""
        self._pool.shutdown(wait=True, cancel_futures=False)
        for client in self._clients:
            client.close()
