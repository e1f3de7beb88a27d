"""TCP peers for tests: a relay that drops its first connections (as a server turning a
handshake away does) and pipes the later ones to an upstream server, and a peer that
greets every connection as a ZMQ server without CURVE."""

from __future__ import annotations

import contextlib
import socket
import threading


class _Listener:
    """Listens on (`host`, a free port) and hands each connection to `_serve` on the
    accepting thread (a daemon) until `close()`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._listener = socket.create_server((host, 0))
        self.host, self.port = host, self._listener.getsockname()[1]
        self.endpoint = f"tcp://{host}:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()


class TcpRelay(_Listener):
    """Closes its first `drops` connections at once and pipes each later one to `upstream`
    (host, port); with no upstream it drops every connection. `cut(drops)` closes the
    connections piped so far and drops the next `drops`."""

    def __init__(
        self, drops: int = 0, upstream: tuple[str, int] | None = None, host: str = "127.0.0.1"
    ) -> None:
        self._drops, self._upstream = drops, upstream
        self._lock = threading.Lock()
        self._piped: list[socket.socket] = []
        super().__init__(host)

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            drop = self._drops > 0 or self._upstream is None
            self._drops -= 1
        if drop or self._upstream is None:
            conn.close()
            return
        far = socket.create_connection(self._upstream)
        with self._lock:
            self._piped += (conn, far)
        for src, dst in ((conn, far), (far, conn)):
            threading.Thread(target=_pipe, args=(src, dst), daemon=True).start()

    def cut(self, drops: int) -> None:
        """Close every connection piped so far (both ends) and drop the next `drops`."""
        with self._lock:
            self._drops, piped, self._piped = drops, self._piped, []
        for sock in piped:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class NullGreeter(_Listener):
    """Answers each connection with a ZMTP 3.0 greeting for the NULL mechanism (what a
    server without CURVE sends), then only reads: a CURVE client sees a mechanism
    mismatch every time, never a dropped connection."""

    GREETING = (
        b"\xff" + bytes(8) + b"\x7f"  # signature
        + b"\x03\x00"  # version 3.0
        + b"NULL".ljust(20, b"\0")  # mechanism
        + b"\x01"  # as-server
        + bytes(31)  # filler
    )  # fmt: skip

    def _serve(self, conn: socket.socket) -> None:
        threading.Thread(target=self._greet, args=(conn,), daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.sendall(self.GREETING)
            while conn.recv(65536):
                pass
