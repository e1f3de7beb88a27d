"""`kvflow` command processes for tests, started by forking a launcher that has already
imported kvflow's server (and so torch), instead of a fresh `python -m kvflow.cli`.

A fresh interpreter spends ~3 s of CPU importing torch, zmq, OpenTelemetry and the server
before it serves; a test suite starts about a hundred servers on a 2-core box. Each
process here is still a separate process running `kvflow.cli.main(argv)` with the
caller's environment, working directory and standard streams, and it exits through the
interpreter (its threads joined, its exit code from `main`), as the command would; only
the imports happened earlier, in the launcher. `kvflow_process` hands back a
`LaunchedProcess`, which answers like `subprocess.Popen` (pid, poll, wait, send_signal,
terminate, kill, stdout, stderr, returncode). The tests of the command line itself (start-up
errors, `--help`) run the real command; `KVFLOW_TEST_EXEC=1` makes every caller here do so.

One launcher per test process, started on first use (its own imports take those ~3 s
once). It forks only from its single thread; a child's exit status goes back on a socket
of its own, which the launcher writes once it has reaped the child.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

#: preloaded by the launcher: what `kvflow server` imports before it serves
PRELOAD = ("kvflow.cli", "kvflow.core.server.cli", "kvflow.core.server.server")
_STATUS = struct.Struct("!i")
ROOT = Path(__file__).resolve().parents[2]
_MAX_REQUEST = 1 << 20


class LaunchedProcess:
    """A forked `kvflow` process, with the parts of `subprocess.Popen` tests use."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        text: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.args = list(args)
        self.returncode: int | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        theirs: list[int] = []  # fds the child gets, closed here once it has them
        in_fd = self._fd(stdin, 0, os.O_RDONLY, theirs)
        out_fd, self.stdout = self._sink(stdout, 1, text, theirs)
        if stderr == subprocess.STDOUT:
            err_fd = out_fd
        else:
            err_fd, self.stderr = self._sink(stderr, 2, text, theirs)
        try:
            self.pid, self._status = _launcher().spawn(
                self.args, dict(os.environ if env is None else env),
                os.fspath(cwd) if cwd is not None else os.getcwd(), (in_fd, out_fd, err_fd),
            )  # fmt: skip
        finally:
            for fd in theirs:
                os.close(fd)

    @staticmethod
    def _fd(spec: int | IO[Any] | None, default: int, flags: int, theirs: list[int]) -> int:
        """The descriptor the child gets for `spec`: this process's own stream `default`
        for None, /dev/null opened with `flags` for DEVNULL, else the descriptor given."""
        if spec is None:
            return default
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, flags)
            theirs.append(fd)
            return fd
        return spec if isinstance(spec, int) else spec.fileno()

    @classmethod
    def _sink(
        cls, spec: int | IO[Any] | None, default: int, text: bool, theirs: list[int]
    ) -> tuple[int, IO[Any] | None]:
        """An output's descriptor for the child, and the stream this side reads (PIPE)."""
        if spec == subprocess.PIPE:
            read, write = os.pipe()
            theirs.append(write)
            return write, open(read, "r" if text else "rb")
        return cls._fd(spec, default, os.O_WRONLY, theirs), None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Everything the process writes to its piped stdout and stderr, once it exited
        (TimeoutExpired, the process killed, if it runs longer than `timeout`)."""
        outputs: dict[str, Any] = {}

        def read(name: str, stream: IO[Any]) -> None:
            outputs[name] = stream.read()
            stream.close()

        readers = [
            threading.Thread(target=read, args=(name, stream), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        for reader in readers:
            reader.join()
        return outputs.get("out"), outputs.get("err")

    def _read_status(self) -> None:
        data = b""
        while len(data) < _STATUS.size:
            chunk = self._status.recv(_STATUS.size - len(data))
            if not chunk:  # the launcher died before it reaped this child
                raise RuntimeError(f"the test launcher went away; process {self.pid} unknown")
            data += chunk
        self.returncode = os.waitstatus_to_exitcode(_STATUS.unpack(data)[0])
        self._status.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Launcher:
    """The test process's side of the launcher: one request (and reply) at a time."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(  # from the checkout's root, where `tests` is found
            [sys.executable, "-m", "tests.support.launcher", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd=ROOT,
        )  # fmt: skip
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str, fds: tuple[int, int, int]
    ) -> tuple[int, socket.socket]:
        status_ours, status_theirs = socket.socketpair()
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        try:
            with self._lock:
                socket.send_fds(self._sock, [request], [*fds, status_theirs.fileno()])
                reply = self._sock.recv(64)
        except OSError as exc:
            raise RuntimeError(
                f"the test launcher is not running ({exc}); see its output"
            ) from None
        finally:
            status_theirs.close()
        if not reply:
            raise RuntimeError("the test launcher went away; see its output")
        return int(reply), status_ours


_instance: _Launcher | None = None
_instance_lock = threading.Lock()


def _launcher() -> _Launcher:
    global _instance
    with _instance_lock:
        if _instance is None or _instance._proc.poll() is not None:
            _instance = _Launcher()
        return _instance


def kvflow_process(args: Sequence[str], **popen: Any) -> LaunchedProcess | subprocess.Popen[Any]:
    """`kvflow ARGS...` as a process: forked by the launcher, or with KVFLOW_TEST_EXEC=1
    the real `python -m kvflow.cli` (Popen keywords: stdin, stdout, stderr, text, env, cwd)."""
    if os.environ.get("KVFLOW_TEST_EXEC") == "1":
        return subprocess.Popen([sys.executable, "-m", "kvflow.cli", *args], **popen)
    return LaunchedProcess(args, **popen)


def kvflow_run(
    args: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """`kvflow ARGS...` run to its end, output captured as text, like `subprocess.run(...,
    capture_output=True, text=True, timeout=timeout)`."""
    proc = kvflow_process(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )  # fmt: skip
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


# --- the launcher process ---------------------------------------------------------------


def _serve(control: socket.socket) -> None:
    """Fork a child per request; report each child's wait status once it is reaped."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    statuses: dict[int, socket.socket] = {}
    while True:
        readable = select.select([control.fileno(), wake_read], [], [])[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(statuses)
        if control.fileno() not in readable:
            continue
        message, fds, _flags, _addr = socket.recv_fds(control, _MAX_REQUEST, 4)
        if not message:
            return  # the test process is gone
        request = json.loads(message)
        status = socket.socket(fileno=fds[3])
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for sock in (control, *statuses.values(), status):
                sock.close()
            os.close(wake_read)
            os.close(wake_write)
            raise SystemExit(_child(request, fds[:3]))
        for fd in fds[:3]:
            os.close(fd)
        statuses[pid] = status
        control.sendall(str(pid).encode())


def _reap(statuses: dict[int, socket.socket]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = statuses.pop(pid, None)
        if sock is not None:
            sock.sendall(_STATUS.pack(status))
            sock.close()


def _child(request: dict[str, Any], fds: Sequence[int]) -> int:
    """In the forked child: take the caller's streams, environment and directory, then
    run the command. Its return value becomes the exit code."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import kvflow.cli

    sys.argv = [kvflow.cli.__file__, *request["argv"]]
    return kvflow.cli.main(request["argv"])


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    _serve(control)


if __name__ == "__main__":
    main()
