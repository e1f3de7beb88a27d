"""The server's worker threads: an ordered queue of jobs each, and one place for errors.

A `Worker` runs the `Job`s the main loop submits to it in order on one thread and
hands their replies back through an inproc socket the loop forwards (kvflow.core.server
.jobs has the job kinds). Whatever a job raises, the worker counts and turns into a
Failed reply through `ErrorReplies`, the one place that does both, which the main loop
uses for its own errors too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import zmq

from kvflow.core.errors import KVFlowError
from kvflow.core.server.admin import DrainState
from kvflow.core.server.protocol import Failed, Reply, encode_reply

#: the server's logger: these lines are the server's
log = logging.getLogger("kvflow.server")


def since(started_ns: int) -> int:
    """Nanoseconds since `started_ns` (a `time.perf_counter_ns()`): a reply's server_ns."""
    return time.perf_counter_ns() - started_ns


class Job(ABC):
    """One queued request's work, run on a worker's thread.

    `run` returns the reply, or None once it sent the reply itself through
    `Worker.answer` (and set `answered`). It raises its errors: the worker answers them.
    """

    def __init__(self, request_id: int, started: int) -> None:
        self.request_id = request_id
        #: when the request arrived (`time.perf_counter_ns()`), for the reply's server_ns
        self.started = started
        self.answered = False

    @abstractmethod
    def run(self) -> Reply | None:
        """Do the request's work and return its reply (None: already sent)."""

    def __str__(self) -> str:
        return f"request {self.request_id}"


class ErrorReplies:
    """Counts requests' errors and turns each into its Failed reply: the one place for
    both, used by the main loop and every worker. Lock rule: the count is read and
    written under the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        """Errors so far."""
        with self._lock:
            return self._count

    def failed(self, request_id: int, exc: BaseException, started: int) -> Failed:
        """Count `exc` and make its reply: a kvflow error's code and message, else an
        internal error (logged with its traceback: call this in the `except` block)."""
        self._add()
        if isinstance(exc, KVFlowError):
            code, message = exc.code, str(exc)
        else:
            log.exception("internal error while serving a request")
            code, message = KVFlowError.code, f"internal server error: {type(exc).__name__}: {exc}"
        return Failed(id=request_id, code=code, message=message, server_ns=since(started))

    def of_job(self, job: Job, exc: Exception) -> Failed | None:
        """`failed` for what `job` raised; None when the job had already replied (too late
        to tell the client: the error is counted and logged)."""
        if not job.answered:
            return self.failed(job.request_id, exc, job.started)
        self._add()
        log.error("%s failed after its reply: %s", job, exc)
        return None

    def _add(self) -> None:
        with self._lock:
            self._count += 1


#: a queued job: who waits for its reply, the job, and what runs it (`job.run`, or that
#: counted in flight by a drain)
_Queued = tuple[bytes | None, Job, Callable[[], Reply | None]]


class Worker:
    """An ordered job queue and the thread that drains it, sending each job's reply
    through an inproc PUSH socket the main loop forwards to the client."""

    def __init__(
        self, ctx: zmq.Context[Any], results: str, name: str, errors: ErrorReplies
    ) -> None:
        self._ctx = ctx
        self._results = results
        self._errors = errors
        self._jobs: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._push: zmq.Socket[Any]  # made by the worker thread, used only there
        self.name = name
        self._thread = threading.Thread(target=self._run, name=f"kvflow-{name}", daemon=True)
        self._thread.start()

    def submit(self, identity: bytes | None, job: Job, drain: DrainState | None = None) -> None:
        """Queue `job`; its reply goes to `identity` (None: nobody waits for it). With
        `drain`, the job counts as in flight (what a drain waits for) until it has run."""
        run = job.run if drain is None else drain.track(job.run)
        self._jobs.put((identity, job, run))

    def answer(self, identity: bytes, reply: Reply) -> None:
        """Send a job's reply now, from the job itself (on this worker's thread), so the
        client goes on while the job finishes."""
        try:
            self._push.send_multipart([identity, encode_reply(reply)])
        except zmq.Again:
            log.warning("reply dropped: the server stopped without waiting for it")

    def finish(self) -> None:
        """Stop after the jobs already queued."""
        self._jobs.put(None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.linger = 1000
        push.sndtimeo = 1000  # only blocks once the main loop is gone (a forced stop)
        push.connect(self._results)
        self._push = push
        try:
            while (item := self._jobs.get()) is not None:
                self._run_one(*item)
                del item  # hold no finished job (and what it references) while idle
        finally:
            push.close()

    def _run_one(self, identity: bytes | None, job: Job, run: Callable[[], Reply | None]) -> None:
        """Run `job` and send its reply, or the error reply for what it raised."""
        try:
            reply = run()
        except Exception as exc:  # never lose the thread
            reply = self._errors.of_job(job, exc)
        if identity is not None and reply is not None:
            self.answer(identity, reply)
