"""A worker answers what its jobs raise, in one place (kvflow/core/server/worker.py).

No server: a `Worker` sends to an inproc PULL socket the test reads, as the main
loop would. A kvflow error becomes its own code, anything else an internal error,
every error is counted once, and an error after a job's early reply is logged only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvflow.core.errors import UnknownInstanceError
from kvflow.core.server.protocol import Done, Failed, Reply, decode_reply
from kvflow.core.server.worker import ErrorReplies, Job, Worker


class _Raises(Job):
    def __init__(self, request_id: int, exc: Exception) -> None:
        super().__init__(request_id, time.perf_counter_ns())
        self._exc = exc

    def run(self) -> Reply:
        raise self._exc


class _AnswersThenRaises(Job):
    def __init__(self, worker: Worker, identity: bytes) -> None:
        super().__init__(7, time.perf_counter_ns())
        self._worker, self._identity = worker, identity

    def run(self) -> Reply | None:
        self._worker.answer(self._identity, Done(id=self.request_id, value=1))
        self.answered = True
        raise RuntimeError("copy failed")


@pytest.fixture
def worker() -> Iterator[tuple[Worker, zmq.Socket[Any], ErrorReplies]]:
    """A worker answering on an inproc PULL socket. The socket and the context are closed
    even when making the worker fails: a context left with an open socket blocks the
    process at exit (its finalizer waits for the socket)."""
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    try:
        pull.rcvtimeo = 5000
        pull.bind("inproc://jobs-test")
        errors = ErrorReplies()
        w = Worker(ctx, "inproc://jobs-test", "test", errors)
        try:
            yield w, pull, errors
        finally:
            w.finish()
            while w.alive:
                time.sleep(0.01)
    finally:
        pull.close(0)
        ctx.term()


def _reply(pull: zmq.Socket[Any]) -> tuple[bytes, Reply]:
    identity, header = pull.recv_multipart()
    return identity, decode_reply(header)


def test_errors_become_failed_replies_and_are_counted(
    worker: tuple[Worker, zmq.Socket[Any], ErrorReplies], caplog: pytest.LogCaptureFixture
) -> None:
    w, pull, errors = worker
    w.submit(b"a", _Raises(1, UnknownInstanceError("instance 'x' is not registered")))
    w.submit(b"b", _Raises(2, ValueError("bad")))
    with caplog.at_level(logging.ERROR, logger="kvflow.server"):
        identity, known = _reply(pull)
        assert identity == b"a" and isinstance(known, Failed) and known.id == 1
        assert (known.code, known.message) == ("not_found", "instance 'x' is not registered")
        identity, internal = _reply(pull)
    assert identity == b"b" and isinstance(internal, Failed) and internal.id == 2
    assert internal.message == "internal server error: ValueError: bad"
    assert errors.count == 2
    assert "internal error while serving a request" in caplog.messages  # the whole line


def test_an_error_after_the_early_reply_is_counted_and_logged_only(
    worker: tuple[Worker, zmq.Socket[Any], ErrorReplies], caplog: pytest.LogCaptureFixture
) -> None:
    w, pull, errors = worker
    with caplog.at_level(logging.ERROR, logger="kvflow.server"):
        w.submit(b"c", _AnswersThenRaises(w, b"c"))
        w.submit(b"d", _Raises(8, ValueError("next")))  # replies in order after it
        assert _reply(pull) == (b"c", Done(id=7, value=1))
        identity, after = _reply(pull)
    assert identity == b"d" and isinstance(after, Failed) and after.id == 8
    assert errors.count == 2
    assert "request 7 failed after its reply: copy failed" in caplog.messages  # the whole line


class _Answers(Job):
    def __init__(self, request_id: int) -> None:
        super().__init__(request_id, time.perf_counter_ns())
        self.ran = threading.Event()

    def run(self) -> Reply:
        self.ran.set()
        return Done(id=self.request_id, value=3)


def test_a_reply_nobody_takes_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """With the main loop gone (nothing takes the worker's replies), a reply is dropped
    once its send times out, with a warning; the worker goes on to its next job."""
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://jobs-nobody")
    w = Worker(ctx, "inproc://jobs-nobody", "test", ErrorReplies())
    try:
        first = _Answers(8)
        w.submit(None, first)  # nobody waits for its reply: it shows the worker connected
        assert first.ran.wait(10)
        pull.close(0)  # the main loop is gone
        dropped = "reply dropped: the server stopped without waiting for it"
        deadline = time.monotonic() + 30
        request_id = 9
        with caplog.at_level(logging.WARNING, logger="kvflow.server"):
            # a reply sent while ZMQ still tears the closed pipe down may go into it
            # unseen; one sent after times out: answer until two were dropped
            while (drops := caplog.messages.count(dropped)) < 2:
                assert time.monotonic() < deadline, caplog.messages
                job = _Answers(request_id)
                w.submit(b"e", job)
                assert job.ran.wait(10)
                settled = time.monotonic() + 1.5  # its send times out after 1 s
                while caplog.messages.count(dropped) == drops and time.monotonic() < settled:
                    time.sleep(0.02)
                request_id += 1
        assert w.alive
    finally:
        w.finish()
        while w.alive:
            time.sleep(0.01)
        ctx.term()
