"""`kvflow replay DIR`: a recorded run's events through the server's own subscribers.

The subscribers are built by `build_subscribers` from an `ObservabilityConfig`, as
in a server, with a MeterProvider of two readers in place of the exporters: the
Prometheus reader (its text is the `--format prometheus` dump) and an in-memory
one (`--format json`), plus the server's OTLP reader with `--otlp-endpoint`. Every
subscriber computes from event timestamps, so the counters and histograms equal
the live run's for the same settings; the L0 sampling rate and seed may differ
(`--l0-sample-rate`, `--sample-seed`). Gauges read from the live process (L1/L2
occupancy, bus statistics) are not in a log and are absent from a replay.

With `--traces FILE` or `--otlp-endpoint` the tracing subscriber runs too (spans to
a JSON-lines file and/or the collector: see spans.py). Spans and log lines carry
wall times: the events they get are shifted so that the subscribers' conversion
gives the recorded time plus the log's own epoch offset (the run's clock, not the
replaying process's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import msgspec
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricReader,
    NumberDataPoint,
)
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import generate_latest

from kvflow.core.config import ObservabilityConfig
from kvflow.core.replay.spans import FLUSH_EVERY_EVENTS, replay_tracer_provider
from kvflow.core.replay.usage import Parser, UsageError
from kvflow.core.replay.window import parse_time
from kvflow.events import Event, monotonic_to_epoch_ns
from kvflow.subscribers import (
    ObservabilityPipeline,
    PrometheusEndpoint,
    build_subscribers,
    make_meter_provider,
    otlp_metric_reader,
)
from kvflow.subscribers.eventlog_format import SegmentHeader
from kvflow.subscribers.eventlog_read import EventLogError, LogReader
from kvflow.subscribers.providers import OTLP_PROTOCOLS

DEFAULT_L0_SAMPLE_RATE = ObservabilityConfig().l0_sample_rate
#: subscribers that turn event times into wall times (with this process's epoch offset)
_WALL_CLOCK_SUBSCRIBERS = frozenset({"tracing", "logging"})


@dataclass
class ReplayResult:
    """What a replay fed through the subscribers and what they made of it."""

    reader: LogReader
    events: int
    first_ts_ns: int | None
    last_ts_ns: int | None
    l0_sample_rate: float
    sample_seed: int


def replay(
    reader: LogReader,
    meter_provider: MeterProvider,
    *,
    l0_sample_rate: float | None = None,
    sample_seed: int | None = None,
    start_ns: int | None = None,
    end_ns: int | None = None,
    log_stream: IO[str] | None = None,
    log_level: str = "info",
    tracer_provider: TracerProvider | None = None,
) -> ReplayResult:
    """Feed the log's events in [start_ns, end_ns) through metrics, L0 and (with
    `log_stream`) logging subscribers recording into `meter_provider`, and (with
    `tracer_provider`) the tracing subscriber, batch by batch as the bus delivered them.
    Sampling defaults to the run's, as its log recorded.

    Every subscriber is shut down at the end, as the bus does when a server stops (the
    tracing subscriber ends its pending operations and open requests then), and the
    providers are flushed; `tracer_provider` is flushed but not shut down.
    """
    header = reader.first_header
    rate, seed = _sampling(header, l0_sample_rate, sample_seed)
    try:
        config = ObservabilityConfig(
            prometheus_port=0,
            logging_enabled=log_stream is not None,
            l0_sample_rate=rate,
            sample_seed=seed,
            log_level=log_level,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    pipeline = build_subscribers(
        config,
        meter_provider=meter_provider,
        configure_root_logging=log_stream is not None,
        log_stream=log_stream,
    )
    if tracer_provider is not None:
        # its own provider, so spans carry the recorded times (no OTLP endpoint needed)
        pipeline.add_tracing(tracer_provider, config.tracing_ttl_s)
    here = monotonic_to_epoch_ns(0)
    shift = (header.epoch_offset_ns - here) if header is not None else 0
    try:
        count, first, last = _feed(reader, pipeline, shift, start_ns, end_ns, tracer_provider)
    finally:
        for sub in pipeline.subscribers:
            sub.shutdown()
        pipeline.shutdown(timeout=30.0)
    return ReplayResult(reader, count, first, last, rate, seed)


def _sampling(
    header: SegmentHeader | None, l0_sample_rate: float | None, sample_seed: int | None
) -> tuple[float, int]:
    """The L0 sample rate and seed: as given, else as the log's header recorded them,
    else the defaults."""
    rate = l0_sample_rate
    if rate is None:
        rate = header.l0_sample_rate if header and header.l0_sample_rate is not None else None
    rate = DEFAULT_L0_SAMPLE_RATE if rate is None else rate
    seed = sample_seed
    if seed is None:
        seed = header.sample_seed if header and header.sample_seed is not None else 0
    return rate, seed


def _feed(
    reader: LogReader,
    pipeline: ObservabilityPipeline,
    shift: int,
    start_ns: int | None,
    end_ns: int | None,
    tracer_provider: TracerProvider | None,
) -> tuple[int, int | None, int | None]:
    """Each batch's events in [start_ns, end_ns) to every subscriber that wants them
    (shifted by `shift` for those that make wall times), flushing spans every
    FLUSH_EVERY_EVENTS; the events fed and the first and last one's time."""
    count, first, last, traced = 0, None, None, 0
    for batch in reader.batches_of_events():
        events: Sequence[Event] = batch
        if start_ns is not None or end_ns is not None:
            lo = -1 if start_ns is None else start_ns
            hi = 1 << 64 if end_ns is None else end_ns
            events = [ev for ev in batch if lo <= ev.ts_ns < hi]
        if not events:
            continue
        shifted: Sequence[Event] | None = None if shift else events
        for sub in pipeline.subscribers:
            given = events
            if sub.name in _WALL_CLOCK_SUBSCRIBERS:
                if shifted is None:
                    shifted = [_shifted(ev, shift) for ev in events]
                given = shifted
            wanted = sub.event_types
            mine = given if wanted is None else [e for e in given if e.type in wanted]
            if mine:
                sub.on_events(mine)
                if sub.name == "tracing":
                    traced += len(mine)
        if tracer_provider is not None and traced >= FLUSH_EVERY_EVENTS:
            tracer_provider.force_flush()
            traced = 0
        count += len(events)
        first = events[0].ts_ns if first is None else first
        last = events[-1].ts_ns
    return count, first, last


def _shifted(ev: Event, shift: int) -> Event:
    """A copy of `ev` whose time, converted with this process's epoch offset, gives the
    recorded time converted with the run's."""
    return msgspec.structs.replace(ev, ts_ns=ev.ts_ns + shift)


def _points_json(reader: InMemoryMetricReader) -> list[dict[str, Any]]:
    """Every data point as a plain dict: metric name, labels, and its value(s)."""
    out: list[dict[str, Any]] = []
    data = reader.get_metrics_data()
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    row: dict[str, Any] = {"name": metric.name, "labels": dict(p.attributes or {})}
                    if isinstance(p, HistogramDataPoint):
                        row.update(count=p.count, sum=p.sum, bucket_counts=list(p.bucket_counts),
                                   explicit_bounds=list(p.explicit_bounds))  # fmt: skip
                    elif isinstance(p, NumberDataPoint):
                        row["value"] = p.value
                    out.append(row)
    return sorted(out, key=lambda r: (r["name"], sorted(r["labels"].items())))


def _summary(result: ReplayResult) -> list[str]:
    reader = result.reader
    span = "no events in the window"
    if result.first_ts_ns is not None and result.last_ts_ns is not None:
        span = f"{(result.last_ts_ns - result.first_ts_ns) / 1e9:.3f} s of events"
        if reader.first_header is not None:
            off = reader.first_header.epoch_offset_ns
            start = (result.first_ts_ns + off) / 1e9
            span += f" from unix time {start:.3f}"
    readable = sum(1 for s in reader.segments if s.header is not None)
    return [
        f"replayed {result.events} events ({reader.batches} batches, {readable} of "
        f"{len(reader.segments)} segments) from {reader.directory}",
        span,
        f"L0 sample rate {result.l0_sample_rate:g}, seed {result.sample_seed}",
        *(f"skipped: {p}" for p in reader.problems),
    ]


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvflow replay",
        description="Feed a recorded event log through the server's subscribers and print"
        " the metrics they compute (docs/EVENTLOG.md).",
    )
    p.add_argument("directory", metavar="DIR", help="the --event-log directory of a run")
    p.add_argument("--from", dest="start", metavar="T",
                   help="first time replayed: seconds after the log's first event, or an"
                        " ISO-8601 time (UTC unless zoned)")  # fmt: skip
    p.add_argument("--to", dest="end", metavar="T", help="end of the window (exclusive), as --from")
    p.add_argument("--l0-sample-rate", type=float, metavar="R",
                   help="L0 lifecycle sampling rate (default: the run's)")  # fmt: skip
    p.add_argument(
        "--sample-seed", type=int, metavar="N", help="L0 sampler seed (default: the run's)"
    )
    p.add_argument("--format", choices=("prometheus", "json"), default="prometheus",
                   help="metrics as Prometheus text (default) or JSON data points")  # fmt: skip
    p.add_argument("--logs", metavar="FILE",
                   help="also run the logging subscriber, writing its lines to FILE")  # fmt: skip
    p.add_argument("--log-level", default="info", help="level of those log lines (default info)")
    p.add_argument("--traces", metavar="FILE",
                   help="also run the tracing subscriber, writing its spans to FILE as JSON"
                        " lines")  # fmt: skip
    p.add_argument("--otlp-endpoint", metavar="URL",
                   help="also export the metrics and spans to this OTLP collector")  # fmt: skip
    p.add_argument("--otlp-protocol", choices=OTLP_PROTOCOLS,
                   help="OTLP transport: grpc (default) or http (protobuf)")  # fmt: skip
    return p


def _first_ts(reader: LogReader) -> int:
    for batch in reader.batches_of_events():
        if batch:
            return batch[0].ts_ns
    return 0


def run(argv: list[str], out: IO[str]) -> int:
    """Parse, replay, print the summary (as comments) and the metrics; the exit status."""
    args = _parser().parse_args(argv)
    try:
        reader = LogReader.open(args.directory)
    except EventLogError as exc:
        print(f"kvflow replay: error: {exc}", file=sys.stderr)
        return 1
    start, end = _window(args, reader)
    if args.otlp_protocol is not None and args.otlp_endpoint is None:
        raise UsageError("--otlp-protocol needs --otlp-endpoint")
    protocol = args.otlp_protocol or "grpc"
    endpoint = PrometheusEndpoint(port=0)  # never started: its reader renders the text
    memory = InMemoryMetricReader()
    provider = make_meter_provider(_metric_readers(args, protocol, endpoint, memory))
    log_file = open(args.logs, "w") if args.logs else None  # noqa: SIM115 - closed below
    trace_file = open(args.traces, "w") if args.traces else None  # noqa: SIM115 - closed below
    tracer_provider = None
    if trace_file is not None or args.otlp_endpoint is not None:
        tracer_provider = replay_tracer_provider(trace_file, args.otlp_endpoint, protocol)
    try:
        result = replay(
            reader, provider, l0_sample_rate=args.l0_sample_rate, sample_seed=args.sample_seed,
            start_ns=start, end_ns=end, log_stream=log_file, log_level=args.log_level,
            tracer_provider=tracer_provider,
        )  # fmt: skip
        _print_result(result, args.format, endpoint, memory, out)
    finally:
        provider.shutdown()
        if tracer_provider is not None:
            tracer_provider.shutdown()
        for file in (log_file, trace_file):
            if file is not None:
                file.close()
    for problem in reader.problems:
        print(f"kvflow replay: skipped: {problem}", file=sys.stderr)
    return 0


def _window(args: argparse.Namespace, reader: LogReader) -> tuple[int | None, int | None]:
    """--from and --to as event times (None: not given)."""
    start = end = None
    if args.start is not None or args.end is not None:
        first = _first_ts(LogReader.open(args.directory))
        offset = reader.first_header.epoch_offset_ns if reader.first_header else 0
        try:
            if args.start is not None:
                start = parse_time(args.start, "--from", first_ts_ns=first, epoch_offset_ns=offset)
            if args.end is not None:
                end = parse_time(args.end, "--to", first_ts_ns=first, epoch_offset_ns=offset)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return start, end


def _metric_readers(
    args: argparse.Namespace,
    protocol: str,
    endpoint: PrometheusEndpoint,
    memory: InMemoryMetricReader,
) -> list[MetricReader]:
    """The Prometheus text reader, the in-memory one, and the OTLP one when asked."""
    readers: list[MetricReader] = [endpoint.reader, memory]
    if args.otlp_endpoint is not None:
        try:  # no periodic push: the one export is the flush at the end
            readers.append(otlp_metric_reader(args.otlp_endpoint, protocol, math.inf))
        except ValueError as exc:
            raise UsageError(f"--otlp-endpoint: {exc}") from None
    return readers


def _print_result(
    result: ReplayResult,
    fmt: str,
    endpoint: PrometheusEndpoint,
    memory: InMemoryMetricReader,
    out: IO[str],
) -> None:
    """The summary and the metrics, as JSON or as comments and Prometheus text."""
    summary = _summary(result)
    if result.events == 0 and not result.reader.problems:
        summary.append("the log holds no events (an empty log: the run published none)")
    if fmt == "json":
        doc = {"summary": summary, "metrics": _points_json(memory)}
        out.write(json.dumps(doc, indent=1, default=str) + "\n")
    else:
        out.write("".join(f"# {line}\n" for line in summary))
        out.write(generate_latest(endpoint.registry).decode())


def main(command: str, argv: list[str]) -> int:
    """Entry point of `kvflow replay` (see `kvflow replay --help`)."""
    try:
        return run(argv, sys.stdout)
    except UsageError as exc:
        print(f"kvflow {command}: error: {exc}", file=sys.stderr)
        return 2
