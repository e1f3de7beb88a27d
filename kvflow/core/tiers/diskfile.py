"""The disk tier's object files: names that spell their keys, a checksummed header, and
whole-or-nothing writes (a temporary name renamed when complete), buffered or O_DIRECT.

An object of key K and n payload bytes lives in
`<disk path>/kvflow-l2/<owner dirs>/<chunk hash hex>.<n>.kv`; the owner dirs spell
K's model, world size, rank and salt, so a directory scan rebuilds the index without
opening a file. The file is a 4096-byte header (magic, key, n, the payload's xxh3_128,
a checksum of the header itself) then the payload, padded to 4096 bytes when written
with O_DIRECT. Nothing is fsynced: after a power loss a torn file fails its checksum
on load and is dropped like any corrupt object.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterator
from contextlib import suppress
from typing import NamedTuple

import xxhash

from kvflow.core.tiers.base import ObjectKey

#: the directory under each disk path that holds the objects (nothing else is touched)
OBJECTS_DIR = "kvflow-l2"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
#: header bytes, the payload's file offset and O_DIRECT's unit of alignment
BLOCK = 4096
#: O_DIRECT I/O goes through one page-aligned buffer of this size per I/O thread
BOUNCE_BYTES = 4 << 20
#: longest owner directory name (bytes; filesystems allow 255): longer owners nest
MAX_PIECE_BYTES = 200
#: longest chunk hash that fits a file name next to its size and temporary suffix
MAX_HASH_BYTES = 96

MAGIC = b"KVFLOBJ1"
#: magic, header length, key length, payload length, payload xxh3_128, header xxh3_64
_FIXED = struct.Struct("<8sIIQ16sQ")
_DIGESTED = 40  # the fixed fields the header checksum covers (all before itself)
MAX_KEY_BYTES = BLOCK - _FIXED.size
_O_DIRECT = getattr(os, "O_DIRECT", 0)

_ESCAPED = frozenset("%/#\x7f")
_TOKEN = re.compile(r"%[0-9A-F]{2}|.", re.DOTALL)
_tmp_ids = itertools.count()
_local = threading.local()


class CorruptObject(Exception):
    """An object file whose header, length or checksum does not match its key."""


class FoundObject(NamedTuple):
    """An object file a scan found: where, whose, how big, when last written or read."""

    path: str
    key: ObjectKey
    nbytes: int
    file_bytes: int
    mtime_ns: int


# -- names ----------------------------------------------------------------------------


def _escape(text: str) -> str:
    """`text` with %, /, #, control characters and lone surrogates as %XX of their UTF-8."""
    out: list[str] = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPED or code < 0x20 or 0xD800 <= code <= 0xDFFF:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        else:
            out.append(ch)
    return "".join(out)


def _unescape(text: str) -> str:
    """The inverse of `_escape`; ValueError (UnicodeError included) for text it never made."""
    raw = bytearray()
    for token in _TOKEN.findall(text):
        if len(token) == 3:
            raw.append(int(token[1:], 16))
        elif token == "%":
            raise ValueError("a % that starts no escape")
        else:
            raw += token.encode("utf-8")
    return raw.decode("utf-8", "surrogatepass")


def _owner_text(key: ObjectKey) -> str:
    salt = "-" if key.cache_salt is None else "=" + _escape(key.cache_salt)
    return f"{_escape(key.model_name)}#{key.world_size}#{key.rank}#{salt}"


def key_text(key: ObjectKey) -> str:
    """The key as one string (in the header): chunk hash hex, then the owner."""
    return f"{key.chunk_hash.hex()}#{_owner_text(key)}"


def _owner_dirs(owner: str) -> list[str]:
    """The owner string cut into directory names of at most MAX_PIECE_BYTES bytes, never
    inside an escape: "+piece" for each but the last, "opiece" for the last."""
    pieces = [""]
    for token in _TOKEN.findall(owner):
        if len(pieces[-1].encode()) + len(token.encode()) > MAX_PIECE_BYTES:
            pieces.append("")
        pieces[-1] += token
    return ["+" + piece for piece in pieces[:-1]] + ["o" + pieces[-1]]


def object_relpath(key: ObjectKey, nbytes: int) -> str:
    """The object's path under OBJECTS_DIR; ValueError for a key no file can be named by."""
    if len(key.chunk_hash) > MAX_HASH_BYTES:
        raise ValueError(
            f"the disk tier names files by chunk hash: {len(key.chunk_hash)} bytes is over "
            f"its {MAX_HASH_BYTES}-byte limit"
        )
    if len(key_text(key).encode()) > MAX_KEY_BYTES:
        raise ValueError(
            f"the disk tier cannot name an object of model {key.model_name[:40]!r}...: its "
            f"model name and cache salt are longer than {MAX_KEY_BYTES} bytes together"
        )
    name = f"{key.chunk_hash.hex()}.{nbytes}{SUFFIX}"
    return os.path.join(
        _owner_relpath(key.model_name, key.world_size, key.rank, key.cache_salt), name
    )


@functools.lru_cache(maxsize=1024)
def _owner_relpath(model_name: str, world_size: int, rank: int, cache_salt: str | None) -> str:
    """The directories of an owner's objects (cached: a store names many objects of one)."""
    owner = _owner_text(ObjectKey(b"", model_name, world_size, rank, cache_salt))
    return os.path.join(*_owner_dirs(owner))


def object_path(root: str, key: ObjectKey, nbytes: int) -> str:
    """Where the object of `key` and `nbytes` payload bytes lives under disk path `root`."""
    return os.path.join(root, OBJECTS_DIR, object_relpath(key, nbytes))


def parse_relpath(relpath: str) -> tuple[ObjectKey, int] | None:
    """The key and payload size a path under OBJECTS_DIR names, or None when kvflow would
    not have named a file so."""
    *dirs, name = relpath.split(os.sep)
    if not name.endswith(SUFFIX) or not dirs:
        return None
    *more, last = dirs
    if not last.startswith("o") or not all(d.startswith("+") for d in more):
        return None
    hash_hex, _, size = name[: -len(SUFFIX)].partition(".")
    try:
        model, world_size, rank, salt = "".join(d[1:] for d in dirs).split("#")
        key = ObjectKey(
            bytes.fromhex(hash_hex),
            _unescape(model),
            int(world_size),
            int(rank),
            None if salt == "-" else _unescape(salt.removeprefix("=")),
        )
        nbytes = int(size)
        canonical = object_relpath(key, nbytes) == relpath
    except ValueError:
        return None
    return (key, nbytes) if canonical else None


def scan_objects(root: str) -> Iterator[FoundObject]:
    """Every object file under disk path `root`, deleting temporary files (their writers
    are dead: the caller holds the path's lock) and emptied directories on the way."""
    top = os.path.join(root, OBJECTS_DIR)
    for dirpath, _, filenames in os.walk(top, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if name.endswith(TMP_SUFFIX):
                with suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            parsed = parse_relpath(os.path.relpath(path, top))
            if parsed is None:
                continue
            with suppress(FileNotFoundError):
                st = os.stat(path)
                yield FoundObject(path, parsed[0], parsed[1], st.st_size, st.st_mtime_ns)
        # bottom-up, so a parent goes once its emptied children have (its `dirnames` were
        # listed before they went: try every directory, not just those listed empty)
        if dirpath != top:
            with suppress(OSError):  # not empty: it holds objects, foreign files or dirs
                os.rmdir(dirpath)


# -- header ---------------------------------------------------------------------------


def encode_header(key: ObjectKey, nbytes: int, digest: bytes) -> bytes:
    """The BLOCK-byte header of an object of `key` whose payload has `nbytes` and `digest`."""
    key_bytes = key_text(key).encode()
    fixed = _FIXED.pack(MAGIC, BLOCK, len(key_bytes), nbytes, digest, 0)[:_DIGESTED]
    check = xxhash.xxh3_64_digest(fixed + key_bytes)
    return (fixed + check + key_bytes).ljust(BLOCK, b"\0")


def check_header(header: memoryview, key: ObjectKey, nbytes: int) -> bytes:
    """The payload digest a header records; CorruptObject unless the header is whole and
    names `key` with `nbytes` payload bytes."""
    magic, header_len, key_len, payload_len, digest, _ = _FIXED.unpack_from(header)
    if magic != MAGIC or header_len != BLOCK or key_len > MAX_KEY_BYTES:
        raise CorruptObject("not a kvflow object header")
    key_bytes = bytes(header[_FIXED.size : _FIXED.size + key_len])
    check = xxhash.xxh3_64_digest(bytes(header[:_DIGESTED]) + key_bytes)
    if check != bytes(header[_DIGESTED : _FIXED.size]):
        raise CorruptObject("header checksum mismatch")
    if key_bytes != key_text(key).encode():
        raise CorruptObject("the header names another key than the file name")
    if payload_len != nbytes:
        raise CorruptObject(f"the header records {payload_len} payload bytes, not {nbytes}")
    return bytes(digest)


# -- reading and writing -------------------------------------------------------------


def _align(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _bounce() -> memoryview:
    """This thread's page-aligned O_DIRECT buffer."""
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = _local.bounce = mmap.mmap(-1, BOUNCE_BYTES)
    return memoryview(buf)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _write_all_of(fd: int, head: memoryview, body: memoryview) -> None:
    """Write `head` then `body`, in one system call when the kernel takes it all."""
    done = os.writev(fd, [head, body])
    if done < len(head):
        _write_all(fd, head[done:])
        _write_all(fd, body)
    else:
        _write_all(fd, body[done - len(head) :])


def _read_full(fd: int, buf: memoryview) -> int:
    """Read into `buf` until it is full or the file ends; the bytes read."""
    got = 0
    while got < len(buf):
        n = os.readv(fd, [buf[got:]])
        if n == 0:
            break
        got += n
    return got


def _write_direct(fd: int, header: bytes, payload: memoryview) -> None:
    """Header and payload through the bounce buffer, the last block zero-padded."""
    bounce = _bounce()
    bounce[:BLOCK] = header
    fill = BLOCK
    while payload:
        take = min(len(bounce) - fill, len(payload))
        bounce[fill : fill + take] = payload[:take]
        payload = payload[take:]
        fill += take
        if fill == len(bounce):
            _write_all(fd, bounce)
            fill = 0
    if fill:
        end = _align(fill)
        bounce[fill:end] = bytes(end - fill)
        _write_all(fd, bounce[:end])


def write_object(path: str, key: ObjectKey, payload: memoryview, *, direct: bool) -> None:
    """Write the object to a temporary name beside `path`, then rename it into place, so
    a reader finds the whole object or none; OSError after removing the temporary file."""
    header = encode_header(key, len(payload), xxhash.xxh3_128_digest(payload))
    tmp = f"{path}.{os.getpid()}-{next(_tmp_ids)}{TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
    try:
        fd = os.open(tmp, flags, 0o600)
        try:
            if direct:
                _write_direct(fd, header, payload)
            else:
                _write_all_of(fd, memoryview(header), payload)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _read_buffered(fd: int, key: ObjectKey, dst: memoryview) -> None:
    header = memoryview(bytearray(BLOCK))
    if _read_full(fd, header) < BLOCK:
        raise CorruptObject("truncated header")
    digest = check_header(header, key, len(dst))
    if _read_full(fd, dst) < len(dst):
        raise CorruptObject("truncated payload")
    if xxhash.xxh3_128_digest(dst) != digest:
        raise CorruptObject("payload checksum mismatch")


def _read_direct(fd: int, key: ObjectKey, dst: memoryview) -> None:
    """Header and payload through the bounce buffer in aligned reads, hashed as they come."""
    bounce = _bounce()
    total = BLOCK + len(dst)  # file bytes that matter (padding follows)
    hasher = xxhash.xxh3_128()
    digest = b""
    pos = 0
    while pos < total:
        want = min(len(bounce), _align(total - pos))
        # one read per block run: O_DIRECT reads short only at the end of the file
        got = min(os.readv(fd, [bounce[:want]]), total - pos)
        if got < min(want, total - pos):
            raise CorruptObject("truncated header" if pos + got < BLOCK else "truncated payload")
        start = 0
        if pos == 0:
            digest = check_header(bounce[:BLOCK], key, len(dst))
            start = BLOCK
        piece = bounce[start:got]
        dst[pos + start - BLOCK : pos + got - BLOCK] = piece
        hasher.update(piece)
        pos += got
    if hasher.digest() != digest:
        raise CorruptObject("payload checksum mismatch")


def read_object(path: str, key: ObjectKey, dst: memoryview, *, direct: bool) -> None:
    """Read the object's payload into `dst` (exactly its size) and verify it.

    CorruptObject for a header naming another key or size, a short file or a checksum
    mismatch; FileNotFoundError/NotADirectoryError for a missing file; OSError for the
    rest. After any exception `dst` holds undefined bytes.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))
    try:
        if direct:
            _read_direct(fd, key, dst)
        else:
            _read_buffered(fd, key, dst)
    finally:
        os.close(fd)


def probe_direct_io(directory: str) -> bool:
    """Whether `directory`'s filesystem takes O_DIRECT: write and read back one aligned
    block (ramfs, tmpfs on older kernels and some FUSE filesystems refuse with EINVAL)."""
    if not _O_DIRECT:
        return False
    probe = os.path.join(directory, f".kvflow-direct-probe.{os.getpid()}{TMP_SUFFIX}")
    block = mmap.mmap(-1, BLOCK)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o600)
        try:
            os.write(fd, block)
            return os.preadv(fd, [block], 0) == BLOCK
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        block.close()
        with suppress(OSError):
            os.unlink(probe)
