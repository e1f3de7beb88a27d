"""CURVE keys without a server: the exact errors of `load_public_key` for each kind of bad
key, the key given as str, bytes or a file, the refusal of a libzmq without CURVE, and the
log lines of reading an authorised-keys directory (a junk file skipped, the rest kept).

Direct calls on real key files from `generate` (what `kvflow keygen` runs); the servers
of tests/core/server/test_curve.py are not needed for any of this.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvflow.core.server.curve import (
    AuthorizedKeys,
    CurveServer,
    generate,
    load_key_pair,
    load_public_key,
)
from tests.support.ops import lines_from


def test_without_curve_support_keygen_and_the_server_refuse_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A libzmq built without CURVE: `generate` and `CurveServer` raise RuntimeError with
    the exact reason, before writing or reading any file."""
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    expected = "this libzmq was built without CURVE support"
    with pytest.raises(RuntimeError) as info:
        generate(tmp_path / "keys", "alice")
    assert str(info.value) == expected
    assert list(tmp_path.iterdir()) == []
    ctx = zmq.Context()
    try:
        with pytest.raises(RuntimeError) as info:
            CurveServer(ctx, str(tmp_path / "none.key_secret"), str(tmp_path))
        assert str(info.value) == expected
    finally:
        ctx.term()


def test_a_public_key_is_read_from_its_text_as_str_or_bytes_or_from_a_file(
    tmp_path: Path,
) -> None:
    """The 40 Z85 characters as str or bytes, the NAME.key file (Path or str) and the
    NAME.key_secret file all give the same public key, as bytes."""
    public_file, secret_file = generate(tmp_path, "alice")
    public = load_key_pair(secret_file).public
    assert load_public_key(public) == public  # bytes: decoded, not taken for a path
    assert load_public_key(public.decode()) == public
    assert load_public_key(public_file) == public
    assert load_public_key(str(public_file)) == public
    assert load_public_key(secret_file) == public


@pytest.mark.parametrize("kind", ["missing file", "junk file", "40 characters not Z85"])
def test_a_bad_public_key_is_refused_with_a_message_naming_it(tmp_path: Path, kind: str) -> None:
    """A file that does not exist, a file with no key in it, and 40 characters that are not
    Z85 each raise ValueError saying which, with the reason pyzmq gave."""
    if kind == "missing file":
        key = str(tmp_path / "nobody.key")
        expected = f"cannot read the public key file {re.escape(key)}: Invalid certificate file: {re.escape(key)}"
    elif kind == "junk file":
        junk = tmp_path / "junk.key"
        junk.write_text("not a certificate\n")
        key = str(junk)
        expected = f"{re.escape(key)} is not a CURVE key file \\(public key file\\): .+"
    else:
        key = "~" * 40  # '~' is not one of Z85's 85 characters
        expected = f"{re.escape(repr(key))} is not a Z85 public key: .+"
    with pytest.raises(ValueError) as info:
        load_public_key(key)
    assert re.fullmatch(expected, str(info.value)), str(info.value)


def test_reading_the_authorised_keys_skips_a_junk_file_with_a_warning_and_keeps_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that is no key (sorted before a real one) is skipped with a warning naming it
    and pyzmq's reason; the real key after it is still loaded and authorised, and an info
    line counts the keys of the folder."""
    alice_public, _ = generate(tmp_path / "alice", "alice")
    folder = tmp_path / "authorized"
    folder.mkdir()
    junk = folder / "a-junk.key"
    junk.write_text("not a certificate\n")
    shutil.copy(alice_public, folder / "b-alice.key")
    with pytest.raises(ValueError) as why:
        zmq.auth.load_certificate(str(junk))
    caplog.set_level(logging.INFO, logger="kvflow.server")
    keys = AuthorizedKeys(folder)
    assert lines_from(caplog, "curve") == [
        (logging.WARNING, f"ignoring {junk}: not a CURVE public key file ({why.value})"),
        (logging.INFO, f"CURVE: 1 authorised client key(s) in {folder}"),
    ]
    assert len(keys) == 1
    assert keys.callback("global", load_public_key(alice_public))
