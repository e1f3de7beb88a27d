"""The query path: `lookup` and `prefetch`, which ask the tiers what prefix of a request
every rank holds, and start loading its L2 part into L1.

Neither touches an instance's KV: a lookup keys the request (`keys.KeyCache`, or the
request's own chunk keys), finds the longest prefix every rank of the model holds in L1,
then in the L2 tiers, and may start a prefetch of the L2 part; a prefetch loads that
part into L1 objects sized from the layout descs recorded at registration. The work
follows the ranks that hold chunks, not world_size (`rank_groups`). A lookup may count
only some ranks (`ranks`): a server that serves one rank of an engine whose other ranks
have servers of their own answers for that rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvflow.core.arrays import as_int32_array
from kvflow.core.engine.instances import LayoutDesc
from kvflow.core.engine.keys import KeyCache
from kvflow.core.engine.loads import Residency
from kvflow.core.engine.ops import Op
from kvflow.core.engine.tiering import Tiering
from kvflow.core.engine.validation import (
    check_bool,
    check_ranks,
    check_salt,
    check_str,
    check_tokens,
    check_world,
    keyed,
    requested_tokens,
)
from kvflow.core.errors import InvalidRequestError, UnknownInstanceError
from kvflow.core.tiers.base import HostTier, ObjectKey
from kvflow.core.tiers.quota import TenantQuotas
from kvflow.events import EventBus, EventType

#: the layout desc recorded for each rank of (model_name, world_size), None where none was
RankLayouts = Callable[[str, int], list[LayoutDesc | None]]


def rank_groups(ranks: Sequence[int]) -> Iterator[Sequence[int]]:
    """The ranks in groups of doubling size: [0], [1], [2, 3], [4..7], ... of `ranks`.

    A prefix is narrowed group by group, so ranks that hold nothing cost at most
    about as much as the ranks before them that do, whatever the world_size.
    """
    start = 0
    while start < len(ranks):
        stop = min(len(ranks), max(start + 1, 2 * start))
        yield ranks[start:stop]
        start = stop


def desc_nbytes(desc: LayoutDesc) -> int:
    """Bytes of one chunk object laid out as `desc` (its layer groups back to back)."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in desc)


def _held_rows(where: Residency, keys: Sequence[ObjectKey], width: int) -> int:
    """Leading rows of `width` keys each (one per rank) every key of which a tier holds."""
    rows = len(keys) // width
    for i in range(rows):
        if any(where[k] is None for k in keys[i * width : (i + 1) * width]):
            return i
    return rows


class Queries:
    """An engine's lookup, prefetch and prefetch_state.

    Lock rule: no lock and no mutable state of its own. Every field is set at
    construction and names a thread-safe object (L1, the key cache, the tiering, the
    tenant quotas, the bus); the engine's own state is read through `check_open` and
    `layouts`, which take the engine's lock.
    """

    def __init__(
        self, *, l1: HostTier, keys: KeyCache, tiering: Tiering | None, tenants: TenantQuotas,
        bus: EventBus, chunk_size: int, check_open: Callable[[], None], layouts: RankLayouts,
    ) -> None:  # fmt: skip
        self.l1 = l1
        self.keys = keys
        self.tiering = tiering
        self.tenants = tenants
        self.bus = bus
        self.chunk_size = chunk_size
        self.check_open = check_open
        self.layouts = layouts

    def lookup(
        self, token_ids: Any, *, model_name: str, world_size: int, cache_salt: str | None,
        request_id: str | None, prefetch: bool, chunk_keys: Sequence[bytes] | None,
        ranks: Sequence[int] | None = None,
    ) -> int:  # fmt: skip
        """Tokens of the longest prefix of full chunks every rank (of `ranks`, default
        all) has in some tier (`CacheEngine.lookup`); one LOOKUP_START/END pair."""
        token_ids, named = keyed(token_ids, chunk_keys, self.chunk_size)
        n_req = requested_tokens(token_ids)
        op = Op(self.bus, EventType.LOOKUP_START, request_id,
                {"model_name": model_name, "tokens": n_req})  # fmt: skip
        try:
            salt = self._check(token_ids, model_name, world_size, cache_salt, request_id)
            counted = check_ranks(ranks, world_size)
            check_bool("prefetch", prefetch)
            hashes = named if named is not None else self._hashes(token_ids, request_id)
            hit, by_tier = self._hits(
                hashes, model_name, world_size, counted, salt, request_id, prefetch
            )
        except BaseException as exc:
            op.fail(exc, requested_tokens=n_req, hit_tokens=0)
            raise
        hit_tokens = hit * self.chunk_size
        self.tenants.record_lookup(model_name, salt, n_req, hit_tokens)
        # chunk_hashes: the list the key cache returned (no copy), for kvflow whatif
        op.end(
            requested_tokens=n_req, hit_tokens=hit_tokens, hit_tokens_by_tier=by_tier,
            chunk_hashes=hashes, chunk_size=self.chunk_size, world_size=world_size,
        )  # fmt: skip
        return hit_tokens

    def prefetch(
        self, token_ids: Any, *, model_name: str, world_size: int, cache_salt: str | None,
        request_id: str | None, ranks: Sequence[int] | None = None,
    ) -> str:  # fmt: skip
        """Start loading the request's L2-resident prefix of every rank (of `ranks`,
        default all) into L1 (`CacheEngine.prefetch`); returns the prefetch id."""
        salt = self._check(token_ids, model_name, world_size, cache_salt, request_id)
        counted = check_ranks(ranks, world_size)
        tiering = self.tiering
        if tiering is None:
            raise InvalidRequestError(
                "prefetch needs an L2 tier; none is configured (start the server with --l2-disk)"
            )
        nbytes, missing = self.rank_nbytes(model_name, world_size, counted)
        if missing:
            raise UnknownInstanceError(
                f"model {model_name!r} world_size {world_size} rank(s) {missing} never registered "
                "KV caches: prefetch needs their layout"
            )
        hashes = self._hashes(token_ids, request_id)
        rows = self._tier_rows(hashes, model_name, world_size, counted, salt)
        hit, _, where = tiering.hit_rows(rows)
        return tiering.prefetch(
            rows[:hit], nbytes, model_name=model_name, trigger="api", session_id=request_id,
            residency=where,
        )  # fmt: skip

    def prefetch_state(self, prefetch_id: str) -> dict[str, Any]:
        """A prefetch's progress (`CacheEngine.prefetch_state`)."""
        check_str("prefetch_id", prefetch_id)
        state = self.tiering.prefetch_state(prefetch_id) if self.tiering is not None else None
        if state is None:
            raise UnknownInstanceError(f"prefetch {prefetch_id!r} is unknown (or long finished)")
        return state

    # -- steps ------------------------------------------------------------------------------

    def _check(
        self, token_ids: Any, model_name: Any, world_size: Any, cache_salt: Any, request_id: Any
    ) -> str | None:
        """A lookup's or prefetch's arguments, checked before any work; returns the salt."""
        self.check_open()
        check_str("model_name", model_name)
        check_world(world_size)
        salt = check_salt(cache_salt)
        if request_id is not None:
            check_str("request_id", request_id)
        check_tokens(token_ids)
        return salt

    def _hashes(self, token_ids: Any, request_id: str | None) -> Sequence[bytes]:
        """The chunk hashes of the request's tokens (its session's chain when it has one)."""
        return self.keys.hashes(as_int32_array(token_ids, "token_ids"), request_id)

    def _hits(
        self, hashes: Sequence[bytes], model_name: str, world_size: int, ranks: Sequence[int],
        salt: str | None, session_id: str | None, prefetch: bool,
    ) -> tuple[int, dict[str, int]]:  # fmt: skip
        """(chunks hit from 0, hit tokens per tier) for `ranks`: L1's prefix, then the
        tiers' past it, starting a prefetch of an L2 part when `prefetch` and every counted
        rank's layout is known."""
        in_l1 = self._l1_prefix(hashes, model_name, world_size, ranks, salt)
        by_tier = {"l1": in_l1 * self.chunk_size}
        tiering = self.tiering
        if tiering is None or in_l1 == len(hashes):
            return in_l1, by_tier
        rows = self._tier_rows(hashes[in_l1:], model_name, world_size, ranks, salt)
        more, tiers, where = tiering.hit_rows(rows)
        for name, n in tiers.items():
            by_tier[name] = by_tier.get(name, 0) + n * self.chunk_size
        if prefetch and more and len(tiers) > ("l1" in tiers):
            nbytes, missing = self.rank_nbytes(model_name, world_size, ranks)
            if not missing:
                tiering.prefetch(
                    rows[:more], nbytes, model_name=model_name, trigger="lookup",
                    session_id=session_id, residency=where,
                )  # fmt: skip
        return in_l1 + more, by_tier

    def _l1_prefix(
        self, hashes: Sequence[bytes], model_name: str, world_size: int,
        counted: Sequence[int], salt: str | None,
    ) -> int:  # fmt: skip
        """Chunks from 0 every counted rank holds in L1, narrowed rank group by rank group,
        the lowest rank first (`rank_groups`)."""
        n = len(hashes)
        for ranks in rank_groups(counted):
            if not n:
                break
            # plain tuples hash and compare equal to ObjectKey, at a fraction of the cost
            n = self.l1.count_prefix(
                [(h, model_name, world_size, r, salt) for r in ranks] for h in hashes[:n]
            )
        return n

    def _tier_rows(
        self, hashes: Sequence[bytes], model_name: str, world_size: int,
        counted: Sequence[int], salt: str | None,
    ) -> list[list[ObjectKey]]:  # fmt: skip
        """Key rows (one key per counted rank) of the chunks some tier may hold for every
        counted rank.

        The chunks are narrowed rank group by rank group (`rank_groups`) on the keys'
        residency before the last group, so that the rows handed to `hit_rows` never
        reach far beyond the chunks that ranks really hold: the work follows the ranks
        that exist, not world_size. The rows returned may still miss (the last group).
        """
        assert self.tiering is not None
        residency = self.tiering.loader.residency
        n = len(hashes)
        for ranks in list(rank_groups(counted))[:-1]:
            if not n:
                break
            keys = [
                ObjectKey(h, model_name, world_size, r, salt) for h in hashes[:n] for r in ranks
            ]
            n = _held_rows(residency(keys), keys, len(ranks))
        return [
            [ObjectKey(h, model_name, world_size, r, salt) for r in counted] for h in hashes[:n]
        ]

    def rank_nbytes(
        self, model_name: str, world_size: int, ranks: Sequence[int] | None = None
    ) -> tuple[list[int], list[int]]:
        """(chunk bytes of each registered rank of `ranks` (default: the model's world),
        from the layout descs recorded at registration; the ranks never registered)."""
        descs = self.layouts(model_name, world_size)
        wanted = range(world_size) if ranks is None else ranks
        missing = [r for r in wanted if descs[r] is None]
        return [desc_nbytes(d) for r in wanted if (d := descs[r]) is not None], missing
