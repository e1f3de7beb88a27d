"""CURVE authentication (docs/SERVER.md, "Authentication with CURVE"; issue 18).

Real keys from `kvflow keygen`, a real server subprocess, real sockets: an
authorised client works, an unknown key and a plain client are refused before
any of their messages is processed, ownership follows the key, and a
non-loopback --host needs CURVE or --insecure-listen.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.config import ServerConfig
from kvflow.core.errors import (
    AlreadyRegisteredError,
    AuthenticationError,
    PermissionDeniedError,
    RequestTimeoutError,
)
from kvflow.core.server.curve import AuthorizedKeys, generate, load_key_pair, load_public_key
from tests.core.server.test_server import ServerProcess
from tests.support.launcher import kvflow_run
from tests.support.ops import lines_from
from tests.support.relay import NullGreeter, TcpRelay

NB, BS, NH, HS = 32, 16, 2, 8
FIRST, SECOND = list(range(16)), list(range(16, 32))  # one chunk's blocks each
CHUNK = 256


def _keygen(directory: Path, name: str) -> Path:
    """`kvflow keygen NAME --dir DIR`; returns the secret key file."""
    done = kvflow_run(["keygen", name, "--dir", str(directory)])
    assert done.returncode == 0, done.stderr
    return directory / f"{name}.key_secret"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """alice's pair from the real `kvflow keygen` (test_keygen_... checks it); the others from
    the function it calls, in-process (each CLI run costs a Python start with torch)."""
    root = tmp_path_factory.mktemp("curve")
    found = {"alice": _keygen(root / "alice", "alice")}
    found |= {name: generate(root / name, name)[1] for name in ("server", "bob", "mallory")}
    authorized = root / "authorized"
    authorized.mkdir()
    for name in ("alice", "bob"):
        shutil.copy(root / name / f"{name}.key", authorized)
    found["authorized"] = authorized
    found["server_public"] = root / "server" / "server.key"
    return found


@pytest.fixture(scope="module")
def server(keys: dict[str, Path]) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        "--disable-observability",
        "--curve-secret-key",
        str(keys["server"]),
        "--curve-authorized-keys",
        str(keys["authorized"]),
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.lines)


def _client(
    server: ServerProcess | TcpRelay, keys: dict[str, Path], who: str | None, **kw: object
) -> KVFlowClient:
    if who is None:
        return KVFlowClient(server.endpoint, timeout_s=10, **kw)  # type: ignore[arg-type]
    return KVFlowClient(
        server.endpoint,
        timeout_s=10,
        curve_server_key=keys["server_public"],
        curve_key=keys[who],
        **kw,  # type: ignore[arg-type]
    )


def _kv() -> list[torch.Tensor]:
    kv = [empty_shared((2, NB, BS, NH, HS), torch.float16)]
    kv[0].copy_(torch.randn(kv[0].shape).half())
    return kv


def _requests(server: ServerProcess, keys: dict[str, Path]) -> int:
    with _client(server, keys, "alice") as admin:
        return int(admin.status()["server"]["requests"])


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(keys: dict[str, Path]) -> None:
    secret = keys["alice"]
    public = secret.with_suffix(".key")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    pair = load_key_pair(secret)
    assert load_public_key(public) == pair.public and len(pair.public) == 40
    assert load_public_key(pair.public.decode()) == pair.public  # the key itself, as text
    again = kvflow_run(["keygen", "alice", "--dir", str(secret.parent)])
    assert again.returncode == 1 and "already exists" in again.stderr
    assert load_key_pair(secret) == pair  # untouched
    with pytest.raises(ValueError, match="holds no secret key"):
        load_key_pair(public)


def test_an_authorised_client_stores_and_retrieves(
    server: ServerProcess, keys: dict[str, Path]
) -> None:
    kv = _kv()
    tokens = list(range(CHUNK))
    with _client(server, keys, "alice") as alice:
        status = alice.status()["server"]
        assert status["authentication"] == "curve" and status["authorized_keys"] == 2
        alice.register_kv_caches("alice-0", kv, model_name="m")
        expected = kv[0][:, :16].clone()
        assert alice.store("alice-0", tokens, FIRST, request_id="s") == CHUNK
        assert alice.lookup(tokens, model_name="m") == CHUNK
        assert alice.retrieve("alice-0", tokens, SECOND, request_id="r") == CHUNK
        assert torch.equal(kv[0][:, 16:], expected)
        alice.unregister("alice-0")


#: the refusals whole, after "the kvflow server at ENDPOINT " (a plain client's names what
#: the handshake saw, in parentheses: a protocol error or handshakes closed in a row)
REFUSALS = {
    "mallory": re.escape(
        "refused this client's CURVE key (its public key is not in the server's"
        " --curve-authorized-keys directory)"
    ),
    None: re.escape("requires CURVE authentication (")
    + r"[^)]+"
    + re.escape(
        "): give its public key (NAME.key) and this client's key pair (NAME.key_secret) as"
        " curve_server_key= and curve_key= (--curve-server-key, --curve-key)"
    ),
}


@pytest.mark.parametrize("who", ["mallory", None])
def test_unknown_key_and_plain_client_are_refused_at_once(
    server: ServerProcess, keys: dict[str, Path], who: str | None
) -> None:
    """An unknown key and a client without CURVE are refused at once, saying what to do."""
    before = _requests(server, keys)
    started = time.monotonic()
    match = "^" + re.escape(f"the kvflow server at {server.endpoint} ") + REFUSALS[who] + "$"
    with _client(server, keys, who) as intruder, pytest.raises(AuthenticationError, match=match):
        intruder.lookup(list(range(CHUNK)), model_name="m")
    assert time.monotonic() - started < 8  # refused, not timed out (timeout_s is 10)
    # none of the intruder's messages reached the request handler (only our status call did)
    assert _requests(server, keys) == before + 1


def test_raw_frames_without_curve_get_no_reply(
    server: ServerProcess, keys: dict[str, Path]
) -> None:
    """A hostile peer speaking plain ZMTP never gets a message processed."""
    before = _requests(server, keys)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    for _ in range(20):
        sock.send_multipart([b"\x00garbage", b"more"])
    assert not sock.poll(1000)
    sock.close(0)
    ctx.term()
    assert _requests(server, keys) == before + 1
    assert server.proc.poll() is None


def test_authorised_keys_are_reread_when_the_directory_changes(
    server: ServerProcess, keys: dict[str, Path]
) -> None:
    added = keys["authorized"] / "mallory.key"
    shutil.copy(keys["mallory"].with_suffix(".key"), added)
    try:
        with _client(server, keys, "mallory") as mallory:
            assert mallory.lookup(list(range(CHUNK)), model_name="m") >= 0
    finally:
        added.unlink()
    with _client(server, keys, "mallory") as mallory, pytest.raises(AuthenticationError):
        mallory.lookup(list(range(CHUNK)), model_name="m")


def test_ownership_follows_the_key_not_the_claimed_client_id(
    server: ServerProcess, keys: dict[str, Path]
) -> None:
    """Bob claiming Alice's client_id still cannot touch, replace or take over her instance."""
    kv = _kv()
    tokens = list(range(CHUNK))
    with (
        _client(server, keys, "alice", client_id="shared-id") as alice,
        _client(server, keys, "bob", client_id="shared-id") as bob,
    ):
        alice.register_kv_caches("alice-own", kv, model_name="m")
        with pytest.raises(PermissionDeniedError):
            bob.store("alice-own", tokens, FIRST, request_id="b")
        with pytest.raises(AlreadyRegisteredError):
            bob.register_kv_caches("alice-own", _kv(), model_name="m")
        refusal = (
            "instance 'alice-own' is registered with another CURVE key: only a client"
            " holding that key may re-register or take it over"
        )
        with pytest.raises(PermissionDeniedError, match=f"^{re.escape(refusal)}$"):
            bob.register_kv_caches("alice-own", _kv(), model_name="m", takeover=True)
        alice.unregister("alice-own")


def test_a_curve_client_of_a_plain_server_is_told_so(keys: dict[str, Path]) -> None:
    srv = ServerProcess("--disable-observability")
    try:
        client = KVFlowClient(
            srv.endpoint, timeout_s=10, curve_server_key=keys["server_public"],
            curve_key=keys["alice"],
        )  # fmt: skip
        with client, pytest.raises(AuthenticationError, match="does not use CURVE"):
            client.status()
    finally:
        assert srv.stop() == 0


def test_a_mechanism_mismatch_is_named_with_its_protocol_error(keys: dict[str, Path]) -> None:
    """A peer that greets with the NULL mechanism (a plain server that answers the
    greeting, not one that drops the connection first): the refusal names ZMQ's
    protocol error for a mechanism mismatch, whole."""
    peer = NullGreeter()
    client = KVFlowClient(
        peer.endpoint, timeout_s=10, curve_server_key=keys["server_public"],
        curve_key=keys["alice"],
    )  # fmt: skip
    message = (
        f"CURVE handshake with {peer.endpoint} failed (protocol error "
        f"{zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:#x}): the server does not use CURVE,"
        " or its key differs from curve_server_key"
    )
    try:
        with client, pytest.raises(AuthenticationError, match=f"^{re.escape(message)}$"):
            client.status()
    finally:
        peer.close()


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    """A server that must refuse to start: its exit status and output."""
    return kvflow_run(["server", "--port", "0", *flags])


def test_non_loopback_listening_needs_curve_or_insecure_listen(keys: dict[str, Path]) -> None:
    refused = _serve("--host", "0.0.0.0", "--disable-observability")
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1] == (
        "kvflow server: error: --host 0.0.0.0 accepts connections from other machines, and"
        " without authentication any of them could store, retrieve and read KV: give"
        " --curve-secret-key and --curve-authorized-keys (make keys with `kvflow keygen`),"
        " or --insecure-listen to accept every client that reaches the port"
    )
    for flags in (
        ("--insecure-listen",),
        ("--curve-secret-key", str(keys["server"]), "--curve-authorized-keys",
         str(keys["authorized"])),
    ):  # fmt: skip
        srv = ServerProcess("--host", "0.0.0.0", "--disable-observability", *flags)
        assert srv.stop() == 0, "".join(srv.lines)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (("--curve-secret-key", "/nonexistent.key_secret", "--curve-authorized-keys", "."),
         "cannot read the secret key file"),
        (("--curve-authorized-keys", "."), "go together"),
    ],
)  # fmt: skip
def test_bad_curve_flags_exit_2_naming_the_problem(flags: tuple[str, ...], match: str) -> None:
    refused = _serve("--disable-observability", *flags)
    assert refused.returncode == 2 and match in refused.stderr, refused.stderr


def test_a_public_key_is_not_a_server_secret_key(keys: dict[str, Path]) -> None:
    refused = _serve(
        "--disable-observability",
        "--curve-secret-key",
        str(keys["server_public"]),
        "--curve-authorized-keys",
        str(keys["authorized"]),
    )
    assert refused.returncode == 2 and "holds no secret key" in refused.stderr


def test_authorized_keys_must_be_a_directory_and_skip_junk(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        AuthorizedKeys(tmp_path / "missing")
    (tmp_path / "junk.key").write_text("not a certificate\n")
    assert len(AuthorizedKeys(tmp_path)) == 0
    with pytest.raises(ValueError, match="go together"):
        ServerConfig(curve_secret_key="x")
    assert os.path.isdir(tmp_path)


@pytest.mark.parametrize("command", [["status"], ["top", "--once", "--interval-s", "0.2"]])
def test_status_and_top_take_the_curve_keys(
    server: ServerProcess, keys: dict[str, Path], command: list[str]
) -> None:
    # A roomy --timeout-s (default 5 s): under load (make mutation runs many suites at once)
    # the keyed command's reply may take longer, and the refusal comes at once anyway.
    base = [*command, "--endpoint", server.endpoint]
    base += ["--timeout-s", "60"]
    with_keys = [*base, "--curve-server-key", str(keys["server_public"])]
    with_keys += ["--curve-key", str(keys["alice"])]
    done = kvflow_run(with_keys, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    refused = kvflow_run(base, timeout=120)
    assert refused.returncode == 1 and "requires CURVE" in refused.stderr


@pytest.mark.parametrize("name", ["", "a/b", ".hidden"])
def test_keygen_refuses_a_name_that_is_not_a_plain_file_name(tmp_path: Path, name: str) -> None:
    """An empty name, a path or a dot file is refused before anything is written."""
    with pytest.raises(ValueError) as info:
        generate(tmp_path, name)
    assert str(info.value) == f"key name must be a plain file name, got {name!r}"
    assert list(tmp_path.iterdir()) == []


def test_keygen_creates_the_missing_folders_of_its_directory(tmp_path: Path) -> None:
    """`--dir` may name folders that do not exist yet: they are created."""
    public, secret = generate(tmp_path / "keys" / "clients", "alice")
    assert public == tmp_path / "keys" / "clients" / "alice.key"
    assert secret == tmp_path / "keys" / "clients" / "alice.key_secret"
    assert load_public_key(public) == load_key_pair(secret).public


def test_the_key_check_logs_each_refusal_and_keeps_its_keys_when_the_folder_vanishes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An authorised key passes silently; an unknown one is refused with a warning naming
    it; with the folder gone the last keys still decide, and a warning says why."""
    folder = tmp_path / "authorized"
    public, _ = generate(folder, "alice")
    alice = load_public_key(public)
    stranger = b"x" * 40
    keys = AuthorizedKeys(folder)
    caplog.set_level(logging.INFO, logger="kvflow.server")
    caplog.clear()
    assert keys.callback("global", alice)
    assert lines_from(caplog, "curve") == []
    assert not keys.callback("global", stranger)
    assert lines_from(caplog, "curve") == [
        (
            logging.WARNING,
            f"CURVE: refused a client whose public key is not authorised: {stranger.decode()}",
        )
    ]
    caplog.clear()
    shutil.rmtree(folder)
    assert keys.callback("global", alice)
    messages = lines_from(caplog, "curve")
    assert len(messages) == 1 and messages[0][0] == logging.WARNING
    assert messages[0][1].startswith(f"cannot re-read {folder} (")
    assert messages[0][1].endswith("): using the last keys")


def test_a_curve_client_of_a_silent_port_asks_for_the_server_and_its_key(
    keys: dict[str, Path],
) -> None:
    """Nothing answers (no server on the port, so no handshake to refuse): the timeout asks
    whether the server runs and whether curve_server_key is its key, a plain client's only
    whether it runs."""
    endpoint = "tcp://127.0.0.1:9"
    with (
        KVFlowClient(
            endpoint, timeout_s=0.3, curve_server_key=keys["server_public"], curve_key=keys["alice"]
        ) as client,
        pytest.raises(RequestTimeoutError) as raised,
    ):
        client.status()
    assert str(raised.value) == (
        f"no reply to Status from the kvflow server at {endpoint} within 0.3 s"
        " (is it running, and is curve_server_key its public key?)"
    )


@pytest.mark.parametrize(
    ("who", "match"),
    [
        (None, r"requires CURVE authentication \(it closed 3 handshakes in a row\)"),
        ("alice", r"CURVE handshake with .* failed \(it closed 3 handshakes in a row\)"),
    ],
)
def test_a_peer_that_drops_every_handshake_is_a_refusal_not_a_timeout(
    keys: dict[str, Path], who: str | None, match: str
) -> None:
    """A server requiring CURVE may close a plain client's connection mid-handshake instead
    of naming the mismatch (timing decides which): three drops in a row are a refusal."""
    peer = TcpRelay()
    started = time.monotonic()
    try:
        client = _client(peer, keys, who)
        with client, pytest.raises(AuthenticationError, match=match):
            client.status()
    finally:
        peer.close()
    assert time.monotonic() - started < 8  # refused, not timed out (timeout_s is 10)


def test_two_dropped_handshakes_then_a_served_one_are_no_refusal(
    server: ServerProcess, keys: dict[str, Path]
) -> None:
    """A dropped handshake or two (a server restarting) is retried: the call is answered."""
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    peer = TcpRelay(drops=2, upstream=(host, int(port)))
    try:
        with _client(peer, keys, "alice") as alice:
            assert alice.status()["server"]["authentication"] == "curve"
    finally:
        peer.close()


def test_drops_after_a_served_handshake_count_afresh(
    server: ServerProcess, keys: dict[str, Path]
) -> None:
    """Two drops, a served handshake, the connection cut, two drops again: four drops in
    all but never three in a row, so both calls are answered (a served handshake resets
    the count)."""
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    peer = TcpRelay(drops=2, upstream=(host, int(port)))
    try:
        with _client(peer, keys, "alice") as alice:
            assert alice.status()["server"]["authentication"] == "curve"
            peer.cut(drops=2)
            assert alice.status()["server"]["authentication"] == "curve"
    finally:
        peer.close()


def test_a_wrong_server_key_is_refused_not_timed_out(
    server: ServerProcess, keys: dict[str, Path]
) -> None:
    """A client holding another key as the server's cannot finish the handshake; the server
    drops each attempt and the client says its key may differ, without the timeout."""
    started = time.monotonic()
    client = KVFlowClient(
        server.endpoint, timeout_s=10, curve_server_key=keys["alice"].with_suffix(".key"),
        curve_key=keys["alice"],
    )  # fmt: skip
    with client, pytest.raises(AuthenticationError, match="its key differs"):
        client.status()
    assert time.monotonic() - started < 8


def test_a_sharded_server_authenticates_at_its_front(keys: dict[str, Path]) -> None:
    """`--shards 2` with CURVE: the front checks every key, the shards still tell keys
    apart (another key may not take an instance over), and no client is sent around the
    front to a shard: each store is one more request the front saw."""
    flags = ["--curve-secret-key", str(keys["server"]), "--curve-authorized-keys"]
    with ServerProcess("--shards", "2", *flags, str(keys["authorized"])) as srv:
        kv, tokens = _kv(), list(range(CHUNK))
        with _client(srv, keys, "alice") as alice, _client(srv, keys, "bob") as bob:
            alice.register_kv_caches("a-1", kv, model_name="m", world_size=2, rank=1)
            before = _requests(srv, keys)
            assert alice.store("a-1", tokens, FIRST, request_id="s") == CHUNK
            assert _requests(srv, keys) == before + 2, "the store went through the front"
            assert alice.lookup(tokens, model_name="m", world_size=2, ranks=[1]) == CHUNK
            with pytest.raises(AlreadyRegisteredError):
                bob.register_kv_caches("a-1", kv, model_name="m", world_size=2, rank=1)
            with pytest.raises(PermissionDeniedError, match="another CURVE key"):
                bob.register_kv_caches(
                    "a-1", kv, model_name="m", world_size=2, rank=1, takeover=True
                )
            with pytest.raises(PermissionDeniedError):
                bob.store("a-1", tokens, SECOND, request_id="b")
            alice.unregister("a-1")
        with _client(srv, keys, "mallory") as mallory, pytest.raises(AuthenticationError):
            mallory.status()
