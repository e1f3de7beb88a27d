"""`KVEventStream`: a client's subscription to the KV-event log that keeps its position.

Each `poll` returns the records since the last one. When the server no longer holds
the subscription (the client was silent past the heartbeat timeout) the stream
subscribes again and resumes from its position, so the bounded log replays what it
missed, or says how much it lost; when the server restarted (its epoch changed)
the batch says so and the stream starts over at the new server's log.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Literal, NamedTuple

from kvflow.core.errors import UnknownSubscriptionError
from kvflow.core.server.client import KVFlowClient
from kvflow.subscribers.kv_events import KVRecord

__all__ = ["KVEventStream", "KVRecord", "StreamBatch"]  # KVRecord: what a batch holds

log = logging.getLogger("kvflow.kv_events")


class StreamBatch(NamedTuple):
    """Records since the last poll, numbered on from it (`KVRecord.seq`).

    `lost`: log records dropped before they could be read (the log is bounded); `reset`:
    "restart" when the server restarted (everything known of it is stale: L1 is empty,
    L2 tiers may have kept their objects), else None. Either means a consumer's view
    may have diverged.
    """

    records: list[KVRecord]
    lost: int
    reset: Literal["restart"] | None


class KVEventStream:
    """A subscription with a filter (None fields match every owner) and its position.

    Subscribes at construction: records from then on are delivered (what the log held
    before is history, not news).
    """

    def __init__(
        self,
        client: KVFlowClient,
        *,
        model_name: str | None = None,
        world_size: int | None = None,
        cache_salt: str | None = None,
        match_salt: bool = False,
        rank: int | None = None,
        max_records: int = 1024,
    ) -> None:
        self._client = client
        self._filter = {
            "model_name": model_name,
            "world_size": world_size,
            "cache_salt": cache_salt,
            "match_salt": match_salt,
            "rank": rank,
        }
        self._max = max_records
        self.subscription: str | None = None
        self.epoch: str | None = None
        #: the last record's seq and the log position reached
        self.seq = 0
        self.log_seq = 0
        self._subscribe()

    def _subscribe(self) -> Literal["restart"] | None:
        """(Re)subscribe; "restart" when the server is not the one of the last subscription."""
        sub = self._client.subscribe_kv_events(**self._filter)  # type: ignore[arg-type]
        previous, self.subscription, self.epoch = self.epoch, sub.subscription, sub.epoch
        if previous is None:
            self.log_seq = sub.log_seq
            return None
        if previous != sub.epoch:
            log.warning(
                "kvflow server restarted (epoch %s -> %s): the chunks it held in L1 are gone"
                " and KV-event records start over",
                previous,
                sub.epoch,
            )
            self.log_seq = sub.log_seq
            return "restart"
        log.info("KV-event subscription expired; resubscribed at log position %d", self.log_seq)
        return None

    def poll(self) -> StreamBatch:
        """What happened since the last poll (at most `max_records` records; poll again
        while more wait). Errors other than a lost subscription propagate."""
        reset = self._subscribe() if self.subscription is None else None
        assert self.subscription is not None
        try:
            poll = self._client.poll_kv_events(
                self.subscription, after_seq=self.seq, after_log_seq=self.log_seq,
                max_records=self._max,
            )  # fmt: skip
        except UnknownSubscriptionError:
            reset = self._subscribe() or reset
            poll = self._client.poll_kv_events(
                self.subscription, after_seq=self.seq, after_log_seq=self.log_seq,
                max_records=self._max,
            )  # fmt: skip
        if poll.records:
            self.seq = poll.records[-1].seq
        self.log_seq = poll.next_log_seq
        if poll.lost:
            log.warning("KV events: %d log record(s) were dropped before this poll", poll.lost)
        return StreamBatch(poll.records, poll.lost, reset)

    def close(self) -> None:
        """Unsubscribe (best effort: an expired subscription needs nothing)."""
        if self.subscription is not None:
            with contextlib.suppress(UnknownSubscriptionError):
                self._client.unsubscribe_kv_events(self.subscription)
            self.subscription = None
