"""How a sharded server's front splits a request over its rank shards and joins their
replies into the one reply its client expects (docs/SERVER.md, Shards).

Rank r lives on shard r % N. A lookup, prefetch or blend lookup asks each shard for its
own ranks and the answer is what every rank holds: the least prefix, the chunks found on
all. Requests for everyone (heartbeats, session ends, admin operations) go to every
shard; the first failure, in shard order, is the reply. Pure functions: the front's
loop owns the sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvflow.core.server.protocol import (
    BlendFound,
    Done,
    Failed,
    PrefetchStarted,
    Reply,
    StatusResult,
)

#: joins the shards' replies (in shard order, none Failed) into the client's reply
Join = Callable[[Sequence[Reply]], Reply]


def shard_of(rank: int, shards: int) -> int:
    """The shard holding rank `rank`."""
    return rank % shards


def rank_split(world_size: Any, ranks: Any, shards: int) -> dict[int, list[int]] | None:
    """Each shard's part of the ranks a query counts (`ranks`, None: the whole world), in
    shard order; None when either is malformed (a shard refuses it with the reason)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return None
    wanted = range(world_size) if ranks is None else ranks
    if not wanted or any(
        isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size for r in wanted
    ):
        return None
    split: dict[int, list[int]] = {}
    for rank in sorted(set(wanted)):
        split.setdefault(shard_of(rank, shards), []).append(rank)
    return dict(sorted(split.items()))


def first_failure(replies: Sequence[Reply]) -> Failed | None:
    """The first shard's failure, if any shard failed."""
    return next((r for r in replies if isinstance(r, Failed)), None)


def join_done(replies: Sequence[Reply]) -> Reply:
    """Done everywhere (a heartbeat, a session's end)."""
    return Done()


def join_lookup(replies: Sequence[Reply]) -> Reply:
    """The prefix every shard holds: the least of their hits."""
    return Done(value=min(_value(r) for r in replies))


def _value(reply: Reply) -> int:
    if not isinstance(reply, Done) or reply.value is None:
        raise TypeError(f"a lookup's shard answered {type(reply).__name__}, not a count")
    return reply.value


def prefetch_id(parts: dict[int, str]) -> str:
    """A sharded prefetch's id: "SHARD/ID" of each shard's prefetch, comma-separated."""
    return ",".join(f"{shard}/{pid}" for shard, pid in parts.items())


def prefetch_parts(composite: str, shards: int) -> dict[int, str] | None:
    """The shard prefetch ids in a sharded prefetch id; None when it is not one."""
    parts: dict[int, str] = {}
    for part in composite.split(","):
        shard, sep, pid = part.partition("/")
        if not sep or not shard.isdigit() or int(shard) >= shards or not pid:
            return None
        if int(shard) in parts:  # a shard named twice: not an id this server gave
            return None
        parts[int(shard)] = pid
    return parts


def join_prefetch(shards: Sequence[int]) -> Join:
    """A prefetch's id from its shards' ids (for shards `shards`, in that order)."""

    def join(replies: Sequence[Reply]) -> Reply:
        ids = {}
        for shard, reply in zip(shards, replies, strict=True):
            if not isinstance(reply, PrefetchStarted):
                raise TypeError(f"a prefetch's shard answered {type(reply).__name__}")
            ids[shard] = reply.prefetch_id
        return PrefetchStarted(prefetch_id=prefetch_id(ids))

    return join


#: a sharded prefetch's state: these counts add up over shards; the token counts are
#: what every shard has (the least)
_PREFETCH_SUMS = (
    "chunks", "loaded_chunks", "written_back_chunks", "discarded_chunks", "skipped_chunks",
)  # fmt: skip
_PREFETCH_LEAST = ("tokens", "landed_tokens")


def join_prefetch_state(composite: str) -> Join:
    """A sharded prefetch's state: running while any shard's runs; chunk counts summed,
    token counts the least (what every rank has)."""

    def join(replies: Sequence[Reply]) -> Reply:
        states = [_status(r) for r in replies]
        state: dict[str, Any] = dict(states[0])
        state["prefetch_id"] = composite
        state["state"] = "running" if any(s.get("state") == "running" for s in states) else "done"
        for key in _PREFETCH_SUMS:
            state[key] = sum(int(s.get(key, 0)) for s in states)
        for key in _PREFETCH_LEAST:
            state[key] = min(int(s.get(key, 0)) for s in states)
        return StatusResult(status=state)

    return join


def _status(reply: Reply) -> dict[str, Any]:
    if not isinstance(reply, StatusResult):
        raise TypeError(f"a shard answered {type(reply).__name__}, not a status")
    return reply.status


def join_blend(replies: Sequence[Reply]) -> Reply:
    """What every shard found: the least prefix, and the segments all of them report
    (in the first shard's order; each reports segments past its own prefix only, so
    these lie past the least)."""
    found = []
    for reply in replies:
        if not isinstance(reply, BlendFound):
            raise TypeError(f"a blend lookup's shard answered {type(reply).__name__}")
        found.append(reply)
    prefix = min(f.prefix_tokens for f in found)
    common = set.intersection(*(set(f.segments) for f in found))
    segments = [s for s in found[0].segments if s in common]
    return BlendFound(prefix_tokens=prefix, segments=segments)


def join_admin(replies: Sequence[Reply]) -> Reply:
    """An admin operation's results, one per shard."""
    return StatusResult(status={"shards": [_status(r) for r in replies]})
