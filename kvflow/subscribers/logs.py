"""Structured logs of the event stream, and one rendering for every library's logs.

`configure_logging` puts a structlog `ProcessorFormatter` on the root logger, so
kvflow's lines and foreign ones (OpenTelemetry, grpc, ...) come out as the same
JSON or console lines. `LoggingSubscriber` logs through the standard library and
never touches structlog's global configuration.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

import structlog

from kvflow.events import END_TO_START, EventBus, EventType, monotonic_to_epoch_ns
from kvflow.events import Event as KVEvent

LOG_FORMATS = ("json", "console")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}  # fmt: skip
_SHARED: list[Any] = [
    structlog.stdlib.add_logger_name,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]
_INFO_TYPES = frozenset({EventType.REGISTER, EventType.UNREGISTER})
_SCALARS = (str, bool, int, float)
_RESERVED = frozenset({"event", "level", "logger", "timestamp"})


class LoggingSetup:
    """The handler `configure_logging` installed; `close()` removes it and restores the level."""

    def __init__(self, handler: logging.Handler, root: logging.Logger, level: int) -> None:
        self.handler = handler
        self._root = root
        self._previous_level = level

    def close(self) -> None:
        """Remove the handler (idempotent)."""
        if self.handler in self._root.handlers:
            self._root.removeHandler(self.handler)
            self._root.setLevel(self._previous_level)
        self.handler.flush()


def configure_logging(
    level: str = "info", fmt: str = "json", *, stream: IO[str] | None = None
) -> LoggingSetup:
    """Render all logs at `level` and above as `fmt` ("json" or "console") lines on `stream`."""
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, got {level!r}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    processors: list[Any] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if fmt == "json":
        # exc_info becomes "exception": the formatted traceback (else JSON shows its reprs)
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        # the traceback below the line, plain: never rich's dump of local variables,
        # which may hold credentials
        processors.append(
            structlog.dev.ConsoleRenderer(
                colors=False, exception_formatter=structlog.dev.plain_traceback
            )
        )
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=_SHARED, processors=processors)
    )
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    return LoggingSetup(handler, root, previous)


class _RateLimit:
    """A token bucket per key, refilled by event time: at most `rate` lines/s, `burst` at once."""

    __slots__ = ("_buckets", "burst", "rate", "suppressed")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[Any, list[float]] = {}
        self.suppressed: dict[Any, int] = {}

    def allow(self, key: Any, ts_ns: int) -> int | None:
        """None if the line is suppressed, else how many lines of `key` were suppressed before."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = [self.burst, ts_ns]
        tokens = min(self.burst, bucket[0] + max(ts_ns - bucket[1], 0) * 1e-9 * self.rate)
        bucket[1] = max(bucket[1], ts_ns)
        if tokens < 1.0:
            bucket[0] = tokens
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return None
        bucket[0] = tokens - 1.0
        return self.suppressed.pop(key, 0)


class LoggingSubscriber:
    """One log line per event: DEBUG normally, INFO for register/unregister, WARNING on errors.

    An END is an error when it has `ok=False` or an `error`, or when some of its
    objects failed (`failed_chunks` > 0: an L2 tier refused part of a call that
    itself succeeded, e.g. disk full). An error END with `drop_burst` >= 2 repeats a
    burst its publisher logs once (L2 writes dropped under backpressure): no line.

    With `bus`, also warns (at most once per `check_interval_s` of event time and
    at shutdown) when the bus dropped events or a subscriber raised. Lines are
    rate-limited per (level, event type) to `max_lines_per_s`; a line that follows
    suppressed ones carries `suppressed=N`.
    """

    name = "logging"
    event_types: frozenset[EventType] | None = None

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        bus: EventBus | None = None,
        max_lines_per_s: float = 200.0,
        check_interval_s: float = 1.0,
    ) -> None:
        if not max_lines_per_s > 0:
            raise ValueError(f"max_lines_per_s must be > 0, got {max_lines_per_s!r}")
        self._stdlib = logger if logger is not None else logging.getLogger("kvflow.events")
        self._log = structlog.wrap_logger(
            self._stdlib,
            processors=[*_SHARED, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
            wrapper_class=structlog.stdlib.BoundLogger,
        )
        self._bus = bus
        self._limit = _RateLimit(max_lines_per_s, max_lines_per_s)
        self._check_ns = int(check_interval_s * 1e9)
        self._next_check = 0
        self._seen_dropped: Mapping[EventType, int] = {}
        self._seen_errors: Mapping[str, int] = {}

    def on_events(self, events: Sequence[KVEvent]) -> None:
        """Log the batch; the DEBUG path is skipped entirely unless DEBUG is enabled."""
        debug = self._stdlib.isEnabledFor(logging.DEBUG)
        latest = 0
        for ev in events:
            etype = ev.type
            if ev.ts_ns > latest:
                latest = ev.ts_ns
            if etype in END_TO_START:
                attrs = ev.attrs
                if (
                    attrs.get("error") is not None
                    or attrs.get("ok") is False
                    or attrs.get("failed_chunks")
                ):
                    if attrs.get("drop_burst", 1) < 2:
                        self._emit(logging.WARNING, ev)
                    continue
            if etype in _INFO_TYPES:
                self._emit(logging.INFO, ev)
            elif debug:
                self._emit(logging.DEBUG, ev)
        if self._bus is not None and latest >= self._next_check:
            self._next_check = latest + self._check_ns
            self._check_bus()

    def _emit(self, level: int, ev: KVEvent) -> None:
        suppressed = self._limit.allow((level, ev.type), ev.ts_ns)
        if suppressed is None:
            return
        fields = _event_fields(ev)
        if suppressed:
            fields["suppressed"] = suppressed
        self._log.log(level, ev.type.label, **fields)

    def _check_bus(self) -> None:
        """Warn about drops and subscriber errors that appeared since the last check."""
        assert self._bus is not None
        stats = self._bus.stats()
        dropped = {
            t.label: n - self._seen_dropped.get(t, 0)
            for t, n in stats.dropped.items()
            if n > self._seen_dropped.get(t, 0)
        }
        if dropped:
            self._log.warning("events_dropped", dropped=dropped, capacity=stats.capacity)
        errors = {
            name: n - self._seen_errors.get(name, 0)
            for name, n in stats.subscriber_errors.items()
            if n > self._seen_errors.get(name, 0)
        }
        if errors:
            self._log.warning("subscriber_errors", errors=errors)
        self._seen_dropped = dict(stats.dropped)
        self._seen_errors = dict(stats.subscriber_errors)

    def shutdown(self) -> None:
        """Report what the rate limit suppressed and any drops not yet reported."""
        if self._limit.suppressed:
            summary = {
                f"{logging.getLevelName(level).lower()}:{etype.label}": n
                for (level, etype), n in self._limit.suppressed.items()
            }
            self._log.warning("log_lines_suppressed", suppressed=summary)
            self._limit.suppressed.clear()
        if self._bus is not None:
            self._check_bus()


def _event_fields(ev: KVEvent) -> dict[str, Any]:
    """The event's fields as log keys: identity, epoch time, every scalar attr, and
    mappings of scalars (LOOKUP_END `hit_tokens_by_tier`) as nested objects."""
    fields: dict[str, Any] = {
        "event_type": ev.type.label,
        "event_time": monotonic_to_epoch_ns(ev.ts_ns) / 1e9,
    }
    if ev.session_id is not None:
        fields["session_id"] = ev.session_id
    if ev.op_id is not None:
        fields["op_id"] = ev.op_id
    for key, value in ev.attrs.items():
        if key in _RESERVED:
            fields[f"attr_{key}"] = value if isinstance(value, _SCALARS) else repr(value)
        elif value is None or isinstance(value, _SCALARS):
            fields[key] = value
        elif key == "records" and isinstance(value, Sequence):
            fields["records"] = len(value)
            fields["blocks"] = sum(len(r[1]) for r in value)
        elif isinstance(value, Mapping):
            fields[key] = {
                str(k): v for k, v in value.items() if v is None or isinstance(v, _SCALARS)
            }
    return fields
