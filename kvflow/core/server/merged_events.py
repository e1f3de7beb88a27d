"""A sharded server's KV-event subscriptions to every rank at once (docs/SERVER.md, Shards).

Each shard keeps its own KV-event log, and a poll's position is one log's position. A
subscription without a rank subscribes on every shard; the front hands the client
positions of its own, each standing for the shards' positions it was made of (the last
KEEP_POSITIONS of them, enough for a client that polls again after a lost reply), and
merges each poll's records in time order, numbered for the subscription as a one-process
server numbers them. The epoch is the front's: a restarted server is a new one. The
loop's thread owns it all.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from kvflow.core.errors import InvalidRequestError
from kvflow.core.server.kv_streams import MAX_SUBSCRIPTIONS, KVPoll, unknown_subscription

#: what a merged subscription's id starts with (a rank's starts with "SHARD:")
PREFIX = "all:"
#: positions a merged subscription keeps (a client polls from one of its last few)
KEEP_POSITIONS = 16


@dataclass
class MergedSubscription:
    """The shards' subscriptions behind one of the front's, and its positions so far."""

    parts: dict[int, str]
    positions: OrderedDict[int, dict[int, int]] = field(default_factory=OrderedDict)


class MergedStreams:
    """The front's merged subscriptions (at most MAX_SUBSCRIPTIONS, the oldest out)."""

    def __init__(self) -> None:
        self.epoch = secrets.token_hex(8)
        self._subs: OrderedDict[str, MergedSubscription] = OrderedDict()
        self._next_position = 1

    def add(self, parts: dict[int, str], starts: Mapping[int, int]) -> tuple[str, int]:
        """A new merged subscription over `parts` from the shards' `starts`: its id and
        its first position."""
        sub_id = PREFIX + secrets.token_hex(8)
        self._subs[sub_id] = MergedSubscription(dict(parts))
        while len(self._subs) > MAX_SUBSCRIPTIONS:
            self._subs.popitem(last=False)
        return sub_id, self._remember(self._subs[sub_id], starts)

    def get(self, sub_id: str) -> MergedSubscription:
        """The merged subscription `sub_id`; UnknownSubscriptionError when there is none."""
        sub = self._subs.get(sub_id)
        if sub is None:
            raise unknown_subscription(sub_id, self.epoch)
        return sub

    def remove(self, sub_id: str) -> None:
        self._subs.pop(sub_id, None)

    def starts(self, sub: MergedSubscription, position: int) -> dict[int, int]:
        """Each shard's log position behind `position` (0: every log's oldest record)."""
        if position == 0:
            return dict.fromkeys(sub.parts, 0)
        found = sub.positions.get(position)
        if found is None:
            raise InvalidRequestError(
                f"after_log_seq {position} is not a position this subscription was given"
                f" (it keeps its last {KEEP_POSITIONS}): poll from the last next_log_seq,"
                " or from 0 for the oldest records kept"
            )
        return found

    def joined(
        self, sub: MergedSubscription, after_seq: int, polls: Mapping[int, KVPoll]
    ) -> KVPoll:
        """One poll of the shards' `polls`: their records in time order, numbered from
        after_seq + 1, the records they lost added up, and a position for what is next."""
        records = sorted(
            (r for poll in polls.values() for r in poll.records), key=lambda r: r.ts_ns
        )
        numbered = [msgspec.structs.replace(r, seq=after_seq + i) for i, r in enumerate(records, 1)]
        nexts = {shard: poll.next_log_seq for shard, poll in polls.items()}
        return KVPoll(
            self.epoch, numbered, sum(p.lost for p in polls.values()),
            self._remember(sub, nexts), any(p.more for p in polls.values()),
        )  # fmt: skip

    def _remember(self, sub: MergedSubscription, shard_positions: Mapping[int, int]) -> int:
        position = self._next_position
        self._next_position += 1
        sub.positions[position] = dict(shard_positions)
        while len(sub.positions) > KEEP_POSITIONS:
            sub.positions.popitem(last=False)
        return position
