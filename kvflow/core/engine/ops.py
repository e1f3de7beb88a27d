"""START/END event pairs: one op_id, and exactly one END whatever happens."""

from __future__ import annotations

from typing import Any

from kvflow.core.errors import KVFlowError
from kvflow.events import START_TO_END, Event, EventBus, EventType, next_op_id, now_ns


def error_code(exc: BaseException) -> str:
    """The short, low-cardinality error name put in END events (`KVFlowError.code`)."""
    return exc.code if isinstance(exc, KVFlowError) else "internal"


class Op:
    """A START/END pair: START stamped at creation; `end` or `fail` publishes both, once.

    START is published together with its END, after the op's work is enqueued, so
    the subscriber threads the publish wakes run while the GPU works rather than
    contending for the GIL with the op's own set-up; its timestamp is still the
    op's start. A successful END may be stamped on the CUDA stream where the op's
    last step runs: its stamp then always follows START's, and the bus delivers
    START first.
    """

    __slots__ = ("attrs", "bus", "end_type", "ended", "op_id", "session_id", "start", "started")

    def __init__(
        self,
        bus: EventBus,
        start_type: EventType,
        session_id: str | None,
        attrs: dict[str, Any],
    ) -> None:
        self.bus = bus
        self.end_type = START_TO_END[start_type]
        self.session_id = session_id
        self.attrs = attrs
        self.op_id = next_op_id()
        self.ended = False
        self.started = False
        self.start = Event(start_type, now_ns(), session_id, self.op_id, attrs)

    def publish_start(self) -> None:
        """Publish START now: for background work (L2 I/O), so in-flight gauges see it."""
        if not self.started:
            self.started = True
            self.bus.publish(self.start)

    def end(self, stream: Any = None, **result: Any) -> None:
        """Publish START and the successful END (on `stream` when the work runs on one:
        the END then also says, as `queued_ns`, how long the host took from START to have
        that work queued, so what follows is the device's)."""
        if self.ended:
            return
        self.ended = True
        self.publish_start()
        attrs = {**self.attrs, **result, "ok": True, "error": None}
        if stream is not None:
            attrs["queued_ns"] = max(now_ns() - self.start.ts_ns, 0)
        self.bus.publish_on_stream(
            stream, Event(self.end_type, 0, self.session_id, self.op_id, attrs)
        )

    def fail(self, exc: BaseException, **result: Any) -> None:
        """Publish START and the failed END, stamped now, naming the error."""
        if self.ended:
            return
        self.ended = True
        self.publish_start()
        attrs = {
            **self.attrs,
            **result,
            "ok": False,
            "error": error_code(exc),
            "error_message": str(exc),
        }
        self.bus.publish(Event(self.end_type, 0, self.session_id, self.op_id, attrs))
