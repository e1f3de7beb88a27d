"""How a sharded server's front splits queries by rank and joins the shards' replies
(kvflow.core.server.fanout), and what each shard is given (kvflow.core.server.shards)."""

from __future__ import annotations

import pytest

from kvflow.core.config import ObservabilityConfig, ServerConfig
from kvflow.core.errors import InvalidRequestError, UnknownSubscriptionError
from kvflow.core.observe.snapshot import Snapshot
from kvflow.core.server import fanout
from kvflow.core.server.kv_streams import KVPoll
from kvflow.core.server.merged_events import KEEP_POSITIONS, PREFIX, MergedStreams
from kvflow.core.server.protocol import (
    BlendFound,
    Done,
    Failed,
    PrefetchStarted,
    SegmentFound,
    StatusResult,
)
from kvflow.core.server.shards import shard_config


def test_ranks_split_by_shard_and_malformed_ones_are_left_to_a_shard() -> None:
    assert fanout.rank_split(4, None, 2) == {0: [0, 2], 1: [1, 3]}
    assert fanout.rank_split(4, [3, 1, 3], 2) == {1: [1, 3]}
    assert fanout.rank_split(1, None, 2) == {0: [0]}
    assert fanout.rank_split(3, None, 4) == {0: [0], 1: [1], 2: [2]}
    for world, ranks in ((0, None), (2, [2]), (2, []), (2, [-1]), ("2", None), (True, None)):
        assert fanout.rank_split(world, ranks, 2) is None, (world, ranks)
    assert fanout.rank_split(2, [True], 2) is None


def test_a_lookup_is_the_least_prefix_and_a_failure_wins() -> None:
    assert fanout.join_lookup([Done(value=512), Done(value=256)]) == Done(value=256)
    failed = Failed(code="invalid_request", message="no")
    assert fanout.first_failure([Done(value=1), failed, Failed(code="x", message="y")]) is failed
    assert fanout.first_failure([Done(value=1)]) is None


def test_a_blend_lookup_keeps_what_every_shard_found_past_the_least_prefix() -> None:
    a, b, c = (SegmentFound(o, 256, bytes([o % 256]) * 32, 0) for o in (300, 600, 900))
    joined = fanout.join_blend(
        [BlendFound(prefix_tokens=256, segments=[a, b, c]),
         BlendFound(prefix_tokens=512, segments=[b, c])]
    )  # fmt: skip
    assert isinstance(joined, BlendFound)
    assert joined.prefix_tokens == 256 and joined.segments == [b, c]


def test_prefetch_ids_and_states_cross_the_shards() -> None:
    started = fanout.join_prefetch([0, 1])(
        [PrefetchStarted(prefetch_id="aa"), PrefetchStarted(prefetch_id="bb")]
    )
    assert isinstance(started, PrefetchStarted) and started.prefetch_id == "0/aa,1/bb"
    assert fanout.prefetch_parts("0/aa,1/bb", 2) == {0: "aa", 1: "bb"}
    for bad in ("aa", "2/aa", "0/", "x/aa", "0/aa,", "", "0/aa,0/bb"):
        assert fanout.prefetch_parts(bad, 2) is None, bad
    assert fanout.prefetch_parts("0/a/b", 2) == {0: "a/b"}
    # a shard's state without a count (an older shard) counts 0 there
    state = {"state": "done", "chunks": 2, "tokens": 512, "landed_tokens": 512, "loaded_chunks": 2}
    joined = fanout.join_prefetch_state("0/aa,1/bb")(
        [StatusResult(status=state),
         StatusResult(status={**state, "state": "running", "landed_tokens": 256,
                              "skipped_chunks": 3})]
    )  # fmt: skip
    assert isinstance(joined, StatusResult)
    assert joined.status["prefetch_id"] == "0/aa,1/bb" and joined.status["state"] == "running"
    assert joined.status["chunks"] == 4 and joined.status["loaded_chunks"] == 4
    assert joined.status["tokens"] == 512 and joined.status["landed_tokens"] == 256
    assert joined.status["skipped_chunks"] == 3 and joined.status["discarded_chunks"] == 0
    without = {k: v for k, v in state.items() if k != "landed_tokens"}
    least = fanout.join_prefetch_state("x")([StatusResult(status=without)] * 2)
    assert isinstance(least, StatusResult) and least.status["landed_tokens"] == 0


def test_a_shard_answering_out_of_turn_is_an_error_naming_the_query() -> None:
    """A reply of the wrong kind (a shard that lies) fails the client's call with what
    was asked (the front turns the TypeError into an error reply)."""
    cases = [
        (fanout.join_lookup, [Done(value=None)], "lookup"),
        (fanout.join_lookup, [StatusResult(status={})], "lookup"),
        (fanout.join_blend, [Done(value=1)], "blend lookup"),
        (fanout.join_prefetch([0]), [Done(value=1)], "prefetch"),
        (fanout.join_prefetch_state("0/a"), [Done(value=1)], "not a status"),
        (fanout.join_admin, [Done(value=1)], "not a status"),
    ]
    for join, replies, what in cases:
        with pytest.raises(TypeError, match=what):
            join(replies)


def test_each_shard_gets_its_share_and_its_own_places() -> None:
    config = ServerConfig(
        shards=2, l1_size_gb=8.0, l2_disk_paths=("/d1", "/d2"), l2_disk_size_gb=100.0,
        l1_quotas=("model:m=2", "salt:s=1"), port=6000, probe_port=7000,
        observability=ObservabilityConfig(prometheus_port=9500, event_log_dir="/log"),
    )  # fmt: skip
    one = shard_config(config, 1, "/run/front")
    assert one.shards == 1 and one.shard_endpoint == "ipc:///run/front/shard-1"
    assert one.l1_size_gb == 4.0 and one.l2_disk_size_gb == 50.0
    assert one.l2_disk_paths == ("/d1/shard-1", "/d2/shard-1")
    assert one.l1_quotas == ("model:m=1", "salt:s=0.5")
    assert one.probe_port == 0 and one.curve_secret_key is None
    assert one.observability.prometheus_port == 9501
    assert one.observability.event_log_dir == "/log/shard-1"
    off = ServerConfig(shards=2, observability=ObservabilityConfig(prometheus_port=0))
    assert shard_config(off, 1, "/x").observability.prometheus_port == 0


def test_distributions_of_shards_join_to_an_upper_bound() -> None:
    joined = Snapshot.joined(
        [Snapshot.of({"activity": {"layer_waits": {"count": 2, "sum_s": 0.5, "max_s": 0.4,
                                                   "p99_s": 0.3, "p50_s": None}}}),
         Snapshot.of({"activity": {"layer_waits": {"count": 1, "sum_s": 0.1, "max_s": 0.1,
                                                   "p99_s": 0.1, "p50_s": None}}})],
        {"endpoint": "tcp://front:1"},
    )  # fmt: skip
    assert joined.layer_waits == {
        "count": 3, "sum_s": 0.6, "max_s": 0.4, "p99_s": 0.3, "p50_s": None
    }  # fmt: skip
    assert joined.endpoint == "tcp://front:1"


def test_a_merged_subscription_keeps_its_last_positions() -> None:
    """Each poll's position stands for the shards' positions it came from; the last
    KEEP_POSITIONS are kept, 0 is every log's start, and an older one is refused."""
    streams = MergedStreams()
    sub_id, first = streams.add({0: "a", 1: "b"}, {0: 7, 1: 9})
    sub = streams.get(sub_id)
    assert sub_id.startswith(PREFIX) and streams.starts(sub, first) == {0: 7, 1: 9}
    assert streams.starts(sub, 0) == {0: 0, 1: 0}
    positions = [first]
    for n in range(KEEP_POSITIONS):
        poll = KVPoll(epoch="e", records=[], lost=n, next_log_seq=10 + n, more=False)
        joined = streams.joined(sub, 0, {0: poll, 1: poll})
        assert joined.lost == 2 * n and joined.epoch == streams.epoch
        positions.append(joined.next_log_seq)
    assert streams.starts(sub, positions[-1]) == {0: 10 + KEEP_POSITIONS - 1} | {
        1: 10 + KEEP_POSITIONS - 1
    }
    with pytest.raises(InvalidRequestError, match="keeps its last"):
        streams.starts(sub, first)
    streams.remove(sub_id)
    with pytest.raises(UnknownSubscriptionError):
        streams.get(sub_id)
