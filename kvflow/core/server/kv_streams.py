"""Subscriptions to the server's KV-event log (docs/EVENTS.md, KV events).

A client subscribes with a filter (model, world size, salt) and then polls with the
position it reached: its own last sequence number and the log's. Each subscription
numbers the records it delivers 1, 2, 3, ... (`seq`); a poll whose position the
bounded log has dropped past is told how many log records it lost. A subscription
belongs to the client that made it and expires when that client has been silent for
the heartbeat timeout. `epoch` names the server's lifetime: after a restart every
subscription is unknown and the epoch differs, so a subscriber can never mistake a
fresh server for the one whose records it holds.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from kvflow.core.errors import (
    CapacityError,
    InvalidRequestError,
    PermissionDeniedError,
    UnknownSubscriptionError,
)
from kvflow.subscribers.kv_events import KVEventLog, KVRecord, RecordFilter

#: subscriptions one server holds at most (each costs a dict entry; polls cost the reads)
MAX_SUBSCRIPTIONS = 256
#: records one poll returns at most (a poll asking for more gets this many)
MAX_POLL_RECORDS = 4096


def check_poll(after_seq: int, after_log_seq: int, max_records: int) -> None:
    """InvalidRequestError naming the first of a poll's numbers out of range."""
    for name, value in (("after_seq", after_seq), ("after_log_seq", after_log_seq)):
        if value < 0:
            raise InvalidRequestError(f"{name} must be >= 0, got {value}")
    if max_records < 1:
        raise InvalidRequestError(f"max_records must be >= 1, got {max_records}")


def unknown_subscription(sub_id: str, epoch: str) -> UnknownSubscriptionError:
    """The error for a poll of a subscription this server (of `epoch`) does not hold."""
    return UnknownSubscriptionError(
        f"KV-event subscription {sub_id!r} is not held by this server (epoch {epoch}): it"
        " expired with its client, or the server restarted; subscribe again and treat"
        " what you knew of this server as stale"
    )


@dataclass(frozen=True)
class _Subscription:
    client: str
    wanted: RecordFilter


class KVPoll(msgspec.Struct, frozen=True):
    """One poll's answer: records numbered for the subscription, and what was lost."""

    epoch: str
    records: list[KVRecord]
    #: log records dropped between the poll's position and the oldest one kept
    lost: int
    #: the log position to poll from next (with the last record's seq, or the poll's)
    next_log_seq: int
    #: more records wait: poll again at once
    more: bool


class KVSubscriptions:
    """The server's subscriptions to one `KVEventLog` (thread-safe)."""

    def __init__(self, log: KVEventLog, *, max_subscriptions: int = MAX_SUBSCRIPTIONS) -> None:
        self.log = log
        self.epoch = secrets.token_hex(8)
        self._max = max_subscriptions
        self._lock = threading.Lock()
        self._subs: dict[str, _Subscription] = {}

    def subscribe(self, client: str, wanted: RecordFilter) -> tuple[str, int]:
        """A new subscription's id and the log position it starts from (the log's end:
        what is already logged is history, not news)."""
        with self._lock:
            if len(self._subs) >= self._max:
                raise CapacityError(
                    f"the server already holds {len(self._subs)} KV-event subscriptions, its "
                    "limit: unsubscribe or let idle clients' subscriptions expire"
                )
            sub_id = secrets.token_hex(8)
            self._subs[sub_id] = _Subscription(client, wanted)
        return sub_id, self.log.stats()["next_log_seq"] - 1

    def unsubscribe(self, client: str, sub_id: str) -> None:
        with self._lock:
            self._owned(client, sub_id)
            del self._subs[sub_id]

    def poll(
        self, client: str, sub_id: str, after_seq: int, after_log_seq: int, limit: int
    ) -> KVPoll:
        """Records after `after_log_seq` for the subscription, numbered from after_seq + 1."""
        check_poll(after_seq, after_log_seq, limit)
        with self._lock:
            sub = self._owned(client, sub_id)
        found = self.log.read(after_log_seq, sub.wanted, min(limit, MAX_POLL_RECORDS))
        records = [
            msgspec.structs.replace(r, seq=after_seq + i)
            for i, r in enumerate(found.records, start=1)
        ]
        return KVPoll(self.epoch, records, found.lost, found.next_log_seq, found.more)

    def _owned(self, client: str, sub_id: str) -> _Subscription:
        sub = self._subs.get(sub_id)
        if sub is None:
            raise unknown_subscription(sub_id, self.epoch)
        if sub.client != client:
            raise PermissionDeniedError(
                f"KV-event subscription {sub_id!r} belongs to another client"
            )
        return sub

    def expire(self, last_seen: Mapping[str, float], limit: float) -> int:
        """Drop the subscriptions of clients not seen since `limit`; returns how many."""
        with self._lock:
            gone = [s for s, sub in self._subs.items() if last_seen.get(sub.client, 0.0) < limit]
            for sub_id in gone:
                del self._subs[sub_id]
        return len(gone)

    def status(self) -> dict[str, object]:
        """The epoch, subscriptions held and the log's own stats."""
        with self._lock:
            held = len(self._subs)
        return {"epoch": self.epoch, "subscriptions": held, "log": self.log.stats()}
