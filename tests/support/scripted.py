"""A scripted kvflow server for client tests: a ZMQ ROUTER on a free loopback port whose
thread decodes each request and sends back whatever the test's function answers."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import zmq

from kvflow.core.server.protocol import Reply, Request, decode_request, encode_reply


@contextlib.contextmanager
def scripted_server(
    answer: Callable[[bytes, Request], Reply | None], *, requests: int | None = None
) -> Iterator[str]:
    """The endpoint of a server that calls `answer(peer identity, request)` for each
    request and sends the reply it returns (None: no reply), for the first `requests`
    requests (None: all) until the block exits."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        served = 0
        while not stop.is_set() and (requests is None or served < requests):
            if not router.poll(50):
                continue
            identity, *frames = router.recv_multipart()
            request, _ = decode_request(frames)
            served += 1
            reply = answer(identity, request)
            if reply is not None:
                router.send_multipart([identity, encode_reply(reply)])

    serving = threading.Thread(target=serve)
    serving.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        serving.join(10)
        router.close(0)
        ctx.term()
