"""The disk tier's object files (kvflow.core.tiers.diskfile) byte by byte: the header's
layout, the headers a read refuses, keys at the header's limit, writes and reads the kernel
does in part, and how object, temporary and probe files are opened."""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kvflow.core.tiers import diskfile
from kvflow.core.tiers.base import ObjectKey
from tests.core.tiers.disk_writer import object_bytes, object_key

NBYTES = 5000
#: the header's fields before its checksum: magic, header length, key length, payload
#: length, the payload's xxh3_128
FIELDS = struct.Struct("<8sIIQ16s")


def write(path: Path, key: ObjectKey, nbytes: int = NBYTES, *, direct: bool = False) -> bytes:
    """Write object 1's payload of `nbytes` bytes to `path` under `key`; those bytes."""
    data = object_bytes(1, nbytes)
    diskfile.write_object(str(path), key, data.numpy().data, direct=direct)
    return data.numpy().tobytes()


def read(path: Path, key: ObjectKey, nbytes: int = NBYTES, *, direct: bool = False) -> bytes:
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    diskfile.read_object(str(path), key, dst.numpy().data, direct=direct)
    return dst.numpy().tobytes()


@pytest.fixture
def no_umask() -> Iterator[None]:
    """umask 0 for the test, so a file's mode is the one its creator asked for."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_the_header_is_fields_checksum_key_then_zeros(tmp_path: Path) -> None:
    """A buffered object file: magic, header length, key length, payload length and the
    payload's xxh3_128 (little-endian), the xxh3_64 of those and the key text, the key
    text, zeros to 4096 bytes, then the payload unpadded."""
    path = tmp_path / "obj"
    data = write(path, object_key(1))
    raw = path.read_bytes()
    key_bytes = diskfile.key_text(object_key(1)).encode()
    fields = FIELDS.pack(b"KVFLOBJ1", 4096, len(key_bytes), NBYTES, xxhash.xxh3_128_digest(data))
    end = 48 + len(key_bytes)
    assert raw[:40] == fields and raw[40:48] == xxhash.xxh3_64_digest(fields + key_bytes)
    assert raw[48:end] == key_bytes and raw[end:4096] == bytes(4096 - end)
    assert raw[4096:] == data


def rewrite_fields(path: Path, **changes: Any) -> None:
    """Change header fields of the object at `path` and make its checksum match again."""
    raw = bytearray(path.read_bytes())
    names = ("magic", "header_len", "key_len", "nbytes", "digest")
    fields = dict(zip(names, FIELDS.unpack_from(raw), strict=True)) | changes
    packed = FIELDS.pack(*fields.values())
    key_bytes = bytes(raw[48 : 48 + fields["key_len"]])
    raw[:48] = packed + xxhash.xxh3_64_digest(packed + key_bytes)
    path.write_bytes(raw)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize(
    "changes",
    [{"magic": b"KVFLOBJ2"}, {"header_len": 8192}, {"key_len": diskfile.MAX_KEY_BYTES + 1}],
    ids=["magic", "header length", "key length"],
)
def test_a_header_of_another_format_is_refused(
    tmp_path: Path, changes: dict[str, Any], direct: bool
) -> None:
    """A header whose checksum matches but whose magic, header length or key length is
    not this format's is not read as an object."""
    path = tmp_path / "obj"
    write(path, object_key(1), direct=direct)
    rewrite_fields(path, **changes)
    with pytest.raises(diskfile.CorruptObject) as refused:
        read(path, object_key(1), direct=direct)
    assert str(refused.value) == "not a kvflow object header"


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_read_of_another_size_than_the_header_records_is_refused(
    tmp_path: Path, direct: bool
) -> None:
    """Reading an object into a buffer of another size names both sizes."""
    path = tmp_path / "obj"
    write(path, object_key(1), direct=direct)
    with pytest.raises(diskfile.CorruptObject) as refused:
        read(path, object_key(1), NBYTES - 1, direct=direct)
    assert str(refused.value) == f"the header records {NBYTES} payload bytes, not {NBYTES - 1}"


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_key_as_long_as_the_header_holds_round_trips_one_more_byte_is_refused(
    tmp_path: Path, direct: bool
) -> None:
    """A key text of exactly MAX_KEY_BYTES fills the header and its object reads back; a
    byte more and no file can be named for it: the ValueError quotes the model's first 40
    characters and the limit."""
    short = ObjectKey(b"\x07" * 32, "", 1, 0, None)
    room = diskfile.MAX_KEY_BYTES - len(diskfile.key_text(short).encode())
    at_limit = short._replace(model_name="m" * room)
    diskfile.object_relpath(at_limit, NBYTES)  # a name is given
    path = tmp_path / "obj"
    data = write(path, at_limit, direct=direct)
    assert read(path, at_limit, direct=direct) == data
    with pytest.raises(ValueError) as refused:
        diskfile.object_relpath(short._replace(model_name="m" * (room + 1)), NBYTES)
    assert str(refused.value) == (
        f"the disk tier cannot name an object of model {'m' * 40!r}...: its model name and "
        f"cache salt are longer than {diskfile.MAX_KEY_BYTES} bytes together"
    )


@pytest.mark.parametrize("take", [100, diskfile.BLOCK + 100], ids=["in the header", "after"])
def test_a_write_the_kernel_takes_only_in_part_is_completed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, take: int
) -> None:
    """writev may write fewer bytes than given (a signal, a nearly full disk): the rest of
    the header and the payload still follow, and the object reads back whole."""
    real_write = os.write

    def partial_writev(fd: int, buffers: list[memoryview]) -> int:
        return real_write(fd, b"".join(bytes(b) for b in buffers)[:take])

    monkeypatch.setattr(os, "writev", partial_writev)
    data = write(tmp_path / "obj", object_key(1))
    monkeypatch.undo()
    assert read(tmp_path / "obj", object_key(1)) == data
    assert os.path.getsize(tmp_path / "obj") == diskfile.BLOCK + NBYTES


def test_a_read_the_kernel_returns_only_in_part_is_completed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A buffered read that readv answers in pieces (1000 bytes at a time) still fills the
    header and the payload in order."""
    data = write(tmp_path / "obj", object_key(1))
    real_readv = os.readv

    def partial_readv(fd: int, buffers: list[memoryview]) -> int:
        return real_readv(fd, [buffers[0][:1000]])

    monkeypatch.setattr(os, "readv", partial_readv)
    assert read(tmp_path / "obj", object_key(1)) == data


def test_a_write_never_goes_through_a_temporary_file_it_did_not_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary name (<object path>.<pid>-<sequence number>.tmp) is created
    exclusively: where a file of that name exists already, the write fails with
    FileExistsError and puts no object in place."""
    renamed: list[str] = []
    real_rename = os.rename

    def spy(src: str, dst: str) -> None:
        renamed.append(src)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", spy)
    write(tmp_path / "a", object_key(1))
    monkeypatch.undo()
    prefix, _, number = renamed[0].removesuffix(diskfile.TMP_SUFFIX).rpartition("-")
    assert prefix == f"{tmp_path / 'a'}.{os.getpid()}"
    taken = f"{tmp_path / 'b'}.{os.getpid()}-{int(number) + 1}{diskfile.TMP_SUFFIX}"
    Path(taken).write_bytes(b"another writer's")
    with pytest.raises(FileExistsError):
        write(tmp_path / "b", object_key(2))
    assert not (tmp_path / "b").exists()


def fd_facts(monkeypatch: pytest.MonkeyPatch, *calls: str) -> list[tuple[bool, int]]:
    """For each of the named os calls made later, the file descriptor it got: whether it
    was opened O_DIRECT, and its file's permission bits. (Close-on-exec needs no check:
    Python opens every descriptor so, PEP 446.)"""
    seen: list[tuple[bool, int]] = []

    def spy_on(real: Callable[..., Any]) -> Callable[..., Any]:
        def spy(fd: int, *args: Any) -> Any:
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            seen.append((direct, os.fstat(fd).st_mode & 0o777))
            return real(fd, *args)

        return spy

    for name in calls:
        monkeypatch.setattr(os, name, spy_on(getattr(os, name)))
    return seen


@pytest.mark.usefixtures("no_umask")
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_object_files_are_private_and_o_direct_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """Object files are written and read through descriptors opened O_DIRECT exactly when
    asked; the files are the server user's alone (mode 0600 whatever the umask)."""
    path = tmp_path / "obj"
    writes = fd_facts(monkeypatch, "write", "writev")
    data = write(path, object_key(1), direct=direct)
    monkeypatch.undo()
    reads = fd_facts(monkeypatch, "readv")
    assert read(path, object_key(1), direct=direct) == data
    monkeypatch.undo()
    assert writes and set(writes) == {(direct, 0o600)}
    assert reads and set(reads) == {(direct, 0o600)}
    assert os.stat(path).st_mode & 0o777 == 0o600


@pytest.mark.usefixtures("no_umask")
def test_the_direct_io_probe_is_a_private_o_direct_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """probe_direct_io writes and reads back through an O_DIRECT descriptor of a 0600
    file, and leaves no file behind."""
    seen = fd_facts(monkeypatch, "write", "preadv")
    assert diskfile.probe_direct_io(str(tmp_path)) is True
    monkeypatch.undo()
    assert len(seen) == 2 and set(seen) == {(True, 0o600)}
    assert os.listdir(tmp_path) == []


def test_the_direct_io_probe_says_no_where_it_cannot_ask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """probe_direct_io answers False, without raising, for a directory that does not
    exist, and on a platform without O_DIRECT."""
    assert diskfile.probe_direct_io(str(tmp_path / "missing")) is False
    monkeypatch.setattr(diskfile, "_O_DIRECT", 0)
    assert diskfile.probe_direct_io(str(tmp_path)) is False
