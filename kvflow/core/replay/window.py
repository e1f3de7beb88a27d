"""`--from` / `--to`: a time in a log, as seconds from its first event or a wall time."""

from __future__ import annotations

import datetime as dt
import math


def parse_time(text: str, flag: str, *, first_ts_ns: int, epoch_offset_ns: int) -> int:
    """A window bound as a monotonic event timestamp (ns).

    `text` is either seconds after the log's first event (`30`, `+30`, `90.5`) or
    an ISO-8601 wall time (`2026-11-23T23:59:00`, UTC unless it names a zone),
    converted with the log's recorded epoch offset. ValueError names `flag`.
    """
    body = text.strip()
    try:
        seconds = float(body)
    except ValueError:
        seconds = math.nan
    if math.isfinite(seconds):
        return first_ts_ns + int(seconds * 1e9)
    try:
        when = dt.datetime.fromisoformat(body)
    except ValueError:
        raise ValueError(
            f"{flag} must be seconds after the log's first event (e.g. 30) or an ISO-8601"
            f" time (e.g. 2026-11-23T23:59:00), got {text!r}"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1e9) - epoch_offset_ns
