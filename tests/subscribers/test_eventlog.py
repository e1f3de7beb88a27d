"""The event log: what is written reads back in order, rotation and the size budget hold,
and damage (torn, corrupted, foreign, unknown version, empty) is skipped with a note."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from kvflow.core.config import ObservabilityConfig
from kvflow.core.server.cli import UsageError, resolve
from kvflow.events import BlockAllocation, Event, EventBus, EventType
from kvflow.subscribers import build_subscribers
from kvflow.subscribers.eventlog import EventLogSubscriber
from kvflow.subscribers.eventlog_format import (
    FRAME_HEAD,
    SegmentHeader,
    decode_header,
    decode_index,
    encode_batch,
    encode_batch_v1,
    encode_header,
    frame,
    new_header,
    segment_name,
)
from kvflow.subscribers.eventlog_read import EventLogError, LogReader


def _events(n: int, first: int = 0) -> list[Event]:
    return [
        Event(EventType.STORE_END, 1000 + i, f"req-{i}", i, {"tokens": i, "ok": True})
        for i in range(first, first + n)
    ]


def _write(path: Path, batches: list[list[Event]], **kw: object) -> EventLogSubscriber:
    sub = EventLogSubscriber(path, **kw)  # type: ignore[arg-type]
    for batch in batches:
        sub.on_events(batch)
    sub.shutdown()
    return sub


def _read(path: Path) -> tuple[list[Event], LogReader]:
    reader = LogReader.open(path)
    return list(reader), reader


def test_round_trip_keeps_order_attrs_and_records(tmp_path: Path) -> None:
    alloc = Event(
        EventType.BLOCK_ALLOCATION, 5, None, None,
        {"instance_id": "gpu0", "block_size": 16,
         "records": [BlockAllocation("r1", [1, 2], list(range(20)))]},
    )  # fmt: skip
    lookup = Event(EventType.LOOKUP_END, 7, "r1", 3, {"chunk_hashes": [b"a" * 32, b"b" * 32]})
    batches = [_events(3), [alloc, lookup], _events(2, first=3)]
    _write(tmp_path, batches)
    got, reader = _read(tmp_path)
    assert reader.problems == []
    assert [e.op_id for e in got] == [0, 1, 2, None, 3, 3, 4]
    assert got[0] == batches[0][0]
    rec = got[3].attrs["records"][0]
    assert isinstance(rec, BlockAllocation) and rec.req_id == "r1" and list(rec[1]) == [1, 2]
    # 32-byte chunk hashes are kept as their first 8 bytes, one blob
    assert got[4].attrs == {"chunk_keys": b"a" * 8 + b"b" * 8}


def _whatif_batch() -> list[Event]:
    """A register, a lookup, a store and a failed retrieve, with chunk hashes."""
    hashes = [bytes([i]) * 32 for i in range(1, 4)]
    inst = {"instance_id": "gpu0", "model_name": "m"}
    return [
        Event(EventType.REGISTER, 1, None, None,
              {**inst, "world_size": 1, "rank": 0}),
        Event(EventType.LOOKUP_START, 2, "r", 1, {"model_name": "m", "tokens": 700}),
        Event(EventType.LOOKUP_END, 3, "r", 1,
              {"model_name": "m", "requested_tokens": 700, "hit_tokens": 256, "ok": True,
               "hit_tokens_by_tier": {"l1": 256}, "chunk_hashes": hashes, "chunk_size": 256,
               "world_size": 1}),
        Event(EventType.STORE_END, 4, "r", 2,
              {**inst, "ok": True, "chunk_hashes": hashes, "chunk_bytes": 4096}),
        Event(EventType.RETRIEVE_END, 5, "r", 3, {**inst, "ok": False, "error": "boom"}),
    ]  # fmt: skip


def test_format_2_batches_carry_an_index_and_format_1_is_still_read(tmp_path: Path) -> None:
    """A batch's index holds whatif's records and keys (the events do not repeat the
    keys); a log of format-1 segments (an older kvflow's) reads back the same."""
    from kvflow.core.replay.trace import read_trace

    batch = _whatif_batch()
    index = decode_index(encode_batch(batch))
    assert index.events == 5 and index.names == ["gpu0", "m", ""]  # a lookup has no instance
    assert index.keys == b"".join(bytes([i]) * 8 for i in range(1, 4)) * 2
    assert len(index.ops) == 4 * 50  # register, lookup, store, retrieve (no hashes)
    new, old = tmp_path / "v2", tmp_path / "v1"
    _write(new, [batch, _events(2)])
    old.mkdir()
    header = SegmentHeader(format_version=1, schema_version=1, kvflow_version="0.1",
                           sequence=1, created_unix_ns=0, epoch_offset_ns=0)  # fmt: skip
    (old / segment_name(1)).write_bytes(
        frame(encode_header(header)) + frame(encode_batch_v1(batch))
        + frame(encode_batch_v1(_events(2)))
    )  # fmt: skip
    (got_new, r_new), (got_old, r_old) = _read(new), _read(old)
    assert r_new.problems == r_old.problems == []
    assert got_new == got_old and len(got_new) == 7
    assert got_new[2].attrs["chunk_keys"] == index.keys[:24]
    assert "chunk_keys" not in got_new[4].attrs
    a, b = read_trace(LogReader.open(new)), read_trace(LogReader.open(old))
    assert a.keys.tolist() == b.keys.tolist() and len(a.keys) == 6
    assert a.kind.tolist() == b.kind.tolist() == [0, 1, 1, 1]  # and _events' two stores
    for t in (a, b):
        assert (t.requested_tokens, t.live_l1_hit_tokens, t.chunk_size) == (700, 256, 256)
        assert t.space_bytes == {0: 4096} and t.spaces == {("m", 1, 0): 0, ("", 1, 0): 1}
        assert t.unknown_instances == 2  # _events' stores name no registered instance


def test_segments_rotate_and_oldest_go_past_the_budget(tmp_path: Path) -> None:
    batches = [_events(50, first=50 * i) for i in range(200)]
    sub = _write(tmp_path, batches, segment_mb=16 / 1024, max_mb=64 / 1024)  # 16 KiB, 64 KiB
    files = sorted(os.listdir(tmp_path))
    assert sub.segments_deleted > 0 and len(files) >= 3
    assert sum((tmp_path / f).stat().st_size for f in files) <= 64 * 1024 + 16 * 1024
    got, reader = _read(tmp_path)
    assert reader.problems == []
    ids = [e.op_id for e in got]
    assert ids == list(range(ids[0], 10_000)), "the newest events, contiguous, in order"
    # a restart appends new segments after the old ones
    _write(tmp_path, [_events(1, first=10_000)], segment_mb=16 / 1024, max_mb=64 / 1024)
    assert [e.op_id for e in _read(tmp_path)[0]][-2:] == [9_999, 10_000]


@pytest.mark.parametrize("fsync", ["none", "segment", "batch"])
def test_every_fsync_policy_writes_the_same_log(tmp_path: Path, fsync: str) -> None:
    _write(tmp_path, [_events(5), _events(5, first=5)], fsync=fsync)
    assert [e.op_id for e in _read(tmp_path)[0]] == list(range(10))


def test_a_torn_last_record_is_skipped_not_fatal(tmp_path: Path) -> None:
    _write(tmp_path, [_events(5), _events(5, first=5)])
    seg = tmp_path / segment_name(1)
    seg.write_bytes(seg.read_bytes()[:-7])  # the crash cut the last write short
    got, reader = _read(tmp_path)
    assert [e.op_id for e in got] == list(range(5))
    assert len(reader.problems) == 1 and "torn last record" in reader.problems[0]


def test_a_corrupted_record_is_skipped_and_the_rest_read(tmp_path: Path) -> None:
    _write(tmp_path, [_events(5), _events(5, first=5), _events(5, first=10)])
    seg = tmp_path / segment_name(1)
    data = bytearray(seg.read_bytes())
    header_end = FRAME_HEAD.size + FRAME_HEAD.unpack_from(data, 0)[1]
    second = header_end + FRAME_HEAD.size + FRAME_HEAD.unpack_from(data, header_end)[1]
    data[second + FRAME_HEAD.size + 3] ^= 0xFF  # one flipped bit inside the second batch
    seg.write_bytes(bytes(data))
    got, reader = _read(tmp_path)
    assert [e.op_id for e in got] == [*range(5), *range(10, 15)]
    assert len(reader.problems) == 1 and "corrupted record" in reader.problems[0]


def _foreign_segment(path: Path, sequence: int, **changes: object) -> None:
    fields = dict(format_version=1, schema_version=1, kvflow_version="9.9", sequence=sequence,
                  created_unix_ns=0, epoch_offset_ns=0)  # fmt: skip
    fields.update(changes)
    header = SegmentHeader(**fields)  # type: ignore[arg-type]
    body = frame(msgspec.msgpack.encode([]))
    (path / segment_name(sequence)).write_bytes(frame(encode_header(header)) + body)


def test_unknown_schema_version_skips_that_segment_with_a_message(tmp_path: Path) -> None:
    _write(tmp_path, [_events(3)])
    _foreign_segment(tmp_path, 7, schema_version=99)
    got, reader = _read(tmp_path)
    assert len(got) == 3
    assert reader.problems == [
        f"{segment_name(7)}: event schema version 99 (written by kvflow 9.9); this kvflow"
        " reads schema 1, skipped"
    ]
    for f in tmp_path.iterdir():
        if f.name != segment_name(7):
            f.unlink()
    with pytest.raises(EventLogError, match=r"no segment kvflow can read: .*schema version 99"):
        LogReader.open(tmp_path)


def test_a_directory_that_is_not_a_log(tmp_path: Path) -> None:
    with pytest.raises(EventLogError, match="not a directory"):
        LogReader.open(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(EventLogError, match=r"not an event log \(no events-NNNNNNNN.kvlog"):
        LogReader.open(tmp_path)
    (tmp_path / segment_name(1)).write_bytes(b"GIF89a" + bytes(40))
    with pytest.raises(EventLogError, match="not a kvflow event log segment"):
        LogReader.open(tmp_path)


def test_an_empty_log_reads_as_no_events(tmp_path: Path) -> None:
    EventLogSubscriber(tmp_path).shutdown()  # a run that published nothing
    got, reader = _read(tmp_path)
    assert got == [] and reader.problems == []
    (tmp_path / segment_name(2)).write_bytes(b"")  # a segment created, then the crash
    got, reader = _read(tmp_path)
    assert got == [] and reader.problems == [
        f"{segment_name(2)}: empty or truncated header, skipped"
    ]


def test_build_subscribers_adds_the_log_and_the_bus_feeds_it(tmp_path: Path) -> None:
    config = ObservabilityConfig(
        prometheus_port=0, logging_enabled=False, event_log_dir=str(tmp_path / "log")
    )
    bus = EventBus()
    pipeline = build_subscribers(config, bus=bus)
    assert pipeline.subscriber("event_log") is not None
    bus.start()
    for ev in _events(100):
        bus.publish(ev)
    assert pipeline.shutdown(5.0)
    got, _ = _read(tmp_path / "log")
    assert [e.op_id for e in got] == list(range(100))
    assert LogReader.open(tmp_path / "log").first_header.l0_sample_rate == 0.01  # type: ignore[union-attr]
    off = build_subscribers(ObservabilityConfig(prometheus_port=0, logging_enabled=False))
    assert off.subscriber("event_log") is None


def test_header_records_the_disk_tier_capacity_when_known(tmp_path: Path) -> None:
    """`l2_disk_bytes`, an optional header key: the pipeline takes it from the tier
    stats' "disk" entry; without one it is None, and a header written without the key
    (an older writer's) reads as None."""
    config = ObservabilityConfig(prometheus_port=0, logging_enabled=False,
                                 event_log_dir=str(tmp_path / "log"))  # fmt: skip
    stats = {"disk": {"capacity_bytes": 3 << 20, "used_bytes": 0}}
    assert build_subscribers(config, tier_stats=lambda: stats).shutdown(5.0)
    assert LogReader.open(tmp_path / "log").first_header.l2_disk_bytes == 3 << 20  # type: ignore[union-attr]
    config = ObservabilityConfig(prometheus_port=0, logging_enabled=False,
                                 event_log_dir=str(tmp_path / "log2"))  # fmt: skip
    assert build_subscribers(config, tier_stats=lambda: {"redis": {}}).shutdown(5.0)
    assert LogReader.open(tmp_path / "log2").first_header.l2_disk_bytes is None  # type: ignore[union-attr]
    old = msgspec.msgpack.encode(
        {"type": "kvflow-event-log", "format_version": 2, "schema_version": 1,
         "kvflow_version": "0", "sequence": 1, "created_unix_ns": 0, "epoch_offset_ns": 0}
    )  # fmt: skip
    assert decode_header(old).l2_disk_bytes is None
    assert decode_header(encode_header(new_header(1, 0, 0, l2_disk_bytes=5))).l2_disk_bytes == 5


def test_settings_are_checked_and_named_by_flag(tmp_path: Path) -> None:
    cfg = resolve(["--event-log", str(tmp_path), "--event-log-max-mb", "10",
                   "--event-log-fsync", "batch"]).observability  # fmt: skip
    assert (cfg.event_log_dir, cfg.event_log_max_mb, cfg.event_log_fsync) == (
        str(tmp_path), 10.0, "batch")  # fmt: skip
    assert resolve([]).observability.event_log_dir is None
    for argv, message in [
        (["--event-log-fsync", "always"], "--event-log-fsync must be one of none, segment, batch"),
        (["--event-log-max-mb", "0"], r"--event-log-max-mb must be a finite number in \[1,"),
        (["--event-log-segment-mb", "nan"], "--event-log-segment-mb must be a finite number"),
    ]:
        with pytest.raises(UsageError, match=message):
            resolve(argv)
