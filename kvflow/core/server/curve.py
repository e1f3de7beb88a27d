"""CURVE keys for kvflow's server and clients (docs/SERVER.md, "Authentication with CURVE").

Keys are ZMQ certificate files: `NAME.key` holds a public key (safe to copy),
`NAME.key_secret` holds the key pair (keep it private). The server accepts a
client only if the client's public key file lies in its authorised-keys
directory; the directory is read again whenever it changes, so adding or
removing a file takes effect at the next connection without a restart.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("kvflow.server")

#: the suffixes zmq.auth.create_certificates gives the two files of a key pair
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
#: a key written as text: 40 Z85 characters (32 bytes)
_Z85_KEY_LENGTH = 40


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair as Z85 bytes (what ZMQ's curve socket options take)."""

    public: bytes
    secret: bytes


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")


def generate(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write NAME.key and NAME.key_secret (mode 0600) into `directory`; returns both paths.

    Refuses to overwrite an existing pair, so a typo cannot destroy a deployed key.
    """
    _require_curve()
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name must be a plain file name, got {name!r}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}{PUBLIC_SUFFIX}", folder / f"{name}{SECRET_SUFFIX}"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} already exists: choose another name or directory")
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        made_public, made_secret = zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old_umask)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def _read(path: str | os.PathLike[str], what: str) -> tuple[bytes | None, bytes | None]:
    try:
        return zmq.auth.load_certificate(os.fspath(path))
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"{path} is not a CURVE key file ({what}): {exc}") from None


def load_key_pair(path: str | os.PathLike[str]) -> KeyPair:
    """The key pair in a NAME.key_secret file (ValueError naming the file otherwise)."""
    public, secret = _read(path, "secret key file")
    if public is None or secret is None:
        raise ValueError(
            f"{path} holds no secret key: give the NAME{SECRET_SUFFIX} file `kvflow keygen` wrote"
        )
    return KeyPair(public, secret)


def load_public_key(key: str | bytes | os.PathLike[str]) -> bytes:
    """A public key from a NAME.key (or .key_secret) file, or given as its 40 Z85 characters."""
    text = key.decode() if isinstance(key, bytes) else key
    if isinstance(text, str) and len(text) == _Z85_KEY_LENGTH and not os.path.exists(text):
        try:
            zmq.utils.z85.decode(text)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{text!r} is not a Z85 public key: {exc}") from None
        return text.encode()
    public, _ = _read(text, "public key file")
    if public is None:
        raise ValueError(f"{text} holds no public key")
    return public


class AuthorizedKeys:
    """The public keys in a directory of NAME.key files, re-read when the directory changes.

    Used as the authenticator's credentials provider: `callback` runs on the
    authenticator thread once per connection handshake, never per message.
    """

    def __init__(
        self, directory: str | os.PathLike[str], flag: str = "--curve-authorized-keys"
    ) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(
                f"{flag} {self.directory} is not a directory of client"
                f" public keys (NAME{PUBLIC_SUFFIX} files)"
            )
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._keys: frozenset[bytes] = frozenset()
        self._reload()

    def _reload(self) -> None:
        stat = self.directory.stat()
        stamp = (stat.st_mtime_ns, stat.st_ino)
        if stamp == self._stamp:
            return
        keys: set[bytes] = set()
        for path in sorted(self.directory.glob(f"*{PUBLIC_SUFFIX}")):
            try:
                public, _ = zmq.auth.load_certificate(str(path))
            except (OSError, ValueError, KeyError, IndexError) as exc:
                log.warning("ignoring %s: not a CURVE public key file (%s)", path, exc)
                continue
            if public is not None:
                keys.add(public)
        self._keys, self._stamp = frozenset(keys), stamp
        log.info("CURVE: %d authorised client key(s) in %s", len(keys), self.directory)

    def __len__(self) -> int:
        return len(self._keys)

    def holds(self, key: bytes) -> bool:
        """Whether the Z85 public `key` is listed (the directory re-read if it changed)."""
        with self._lock:
            try:
                self._reload()
            except OSError as exc:  # the directory vanished: keep the last known keys
                log.warning("cannot re-read %s (%s): using the last keys", self.directory, exc)
            return key in self._keys

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the Z85 public `key` is authorised (ZAP calls this per handshake)."""
        allowed = self.holds(key)
        if not allowed:
            log.warning(
                "CURVE: refused a client whose public key is not authorised: %s",
                key.decode("ascii", "replace"),
            )
        return allowed


class CurveServer:
    """CURVE on a server socket: its key pair, and a ZAP authenticator for client keys.

    `owner_prefix(frame)` gives the authenticated key of a request's sender, so
    ownership (docs/SERVER.md) is tied to a key no other client can present.
    """

    def __init__(self, ctx: zmq.Context[Any], secret_key_file: str, authorized_dir: str) -> None:
        _require_curve()
        self.keys = load_key_pair(secret_key_file)
        self.authorized = AuthorizedKeys(authorized_dir)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvflow.server.zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self.authorized)

    def secure(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` (before bind) a CURVE server with this key pair."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


def secure_client(sock: zmq.Socket[Any], server_key: bytes, pair: KeyPair) -> None:
    """Make `sock` (before connect) a CURVE client of the server whose public key is given."""
    sock.curve_serverkey = server_key
    sock.curve_publickey = pair.public
    sock.curve_secretkey = pair.secret
