"""The Redis tier's wire format: the Redis key that names an object, the checked value
stored under it, and the raw RESP of the single-server fast path.

A key is `prefix + owner + ":" + chunk hash hex`, the owner being
`model#world_size#rank#salt` with every character outside [A-Za-z0-9._-] written as
%XX of its UTF-8 bytes (no hash tag, and the key parses back). A value is a header
(magic, version, the key it was written under, payload length, the payload's xxh3_128)
then the payload, so garbage, a truncated value or one copied under another key is
caught on load. Pure functions: no I/O, no state but a cache of owner texts.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Sequence

import xxhash

from kvflow.core.tiers.base import ObjectKey

#: value header: magic, format version, key length, payload length, payload xxh3_128
HEADER = struct.Struct("<8sHHQ16s")
MAGIC = b"KVFLREDS"
VERSION = 1
#: the longest Redis key a header can name (a store of a longer one is a ValueError)
MAX_KEY_BYTES = 0xFFFF

#: owner characters kept as they are in a key; the rest are %XX of their UTF-8 bytes
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_ESCAPES = re.compile(r"%([0-9A-F]{2})")
_GLOB = re.compile(r"([*?\[\]\\])")


def _escape(text: str) -> str:
    """`text` with every character outside [A-Za-z0-9._-] as %XX of its UTF-8 bytes (no
    `{`, `}`, `:` or `#` is left: no hash tag, and the key parses back)."""
    return "".join(
        ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        for ch in text
    )


def _unescape(text: str) -> str:
    """The text `_escape` was given."""
    raw = _ESCAPES.sub(lambda m: chr(int(m.group(1), 16)), text)
    return raw.encode("latin-1").decode("utf-8", "surrogatepass")


def owner_text(key: ObjectKey) -> str:
    """The key's owner (model, world size, rank, salt) as key-safe text."""
    return _owner_text(key.model_name, key.world_size, key.rank, key.cache_salt)


@functools.lru_cache(maxsize=1024)
def _owner_text(model_name: str, world_size: int, rank: int, cache_salt: str | None) -> str:
    """Cached: a lookup names hundreds of keys of one owner (escaping each cost 2 us)."""
    salt = "-" if cache_salt is None else "=" + _escape(cache_salt)
    return f"{_escape(model_name)}#{world_size}#{rank}#{salt}"


class KeyNames:
    """The Redis keys of one key prefix: an object's key, and the object a key names."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._prefix_bytes = prefix.encode()

    def name(self, key: ObjectKey) -> bytes:
        """The Redis key of an object: prefix, owner, ':', chunk hash hex (no hash tag)."""
        return f"{self.prefix}{owner_text(key)}:{key.chunk_hash.hex()}".encode()

    def parse(self, name: bytes) -> ObjectKey | None:
        """The ObjectKey a Redis key of this prefix names, or None for a foreign key (one
        that is not exactly what `name` makes of the key it parses to)."""
        if not name.startswith(self._prefix_bytes):
            return None
        try:
            owner, colon, hash_hex = name[len(self._prefix_bytes) :].decode().rpartition(":")
            model, world, rank, salt = owner.split("#")
            key = ObjectKey(
                bytes.fromhex(hash_hex),
                _unescape(model),
                int(world),
                int(rank),
                None if salt == "-" else _unescape(salt.removeprefix("=")),
            )
            canonical = colon and self.name(key) == name
        except (ValueError, UnicodeError):
            return None
        return key if canonical else None

    def scan_match(self) -> str:
        """A SCAN MATCH pattern for every key under the prefix (its glob characters
        escaped)."""
        return _GLOB.sub(r"\\\1", self.prefix) + "*"


def encode_value(name: bytes, payload: memoryview) -> bytes:
    """The stored value: header (naming `name`) then the payload."""
    digest = xxhash.xxh3_128_digest(payload)
    header = HEADER.pack(MAGIC, VERSION, len(name), payload.nbytes, digest)
    return b"".join((header, name, payload))


def check_value(name: bytes, value: bytes, nbytes: int) -> tuple[int, str | None]:
    """(payload offset, None) for a whole value of `name` holding `nbytes` bytes;
    (-1, None) for a whole value of another size; (-1, why) for a corrupt value."""
    if len(value) < HEADER.size:
        return -1, "shorter than its header"
    magic, version, key_len, length, digest = HEADER.unpack_from(value)
    if magic != MAGIC:
        return -1, "not a kvflow value (bad magic)"
    if version != VERSION:
        return -1, f"value format version {version} is not {VERSION}"
    start = HEADER.size + key_len
    if value[HEADER.size : start] != name:
        return -1, "the value was written under another key"
    if len(value) - start != length:
        return -1, f"payload of {len(value) - start} bytes, header says {length}"
    if length != nbytes:
        return -1, None
    if xxhash.xxh3_128_digest(memoryview(value)[start:]) != digest:
        return -1, "payload checksum mismatch"
    return start, None


def pack_commands(command: bytes, names: Sequence[bytes]) -> bytes:
    """`command name` for each name in the Redis protocol (RESP), as one buffer: a 500-key
    EXISTS packs in ~0.1 ms, a tenth of redis-py's general-purpose packer."""
    head = b"*2\r\n$%d\r\n%s\r\n" % (len(command), command)
    return b"".join([b"%s$%d\r\n%s\r\n" % (head, len(name), name) for name in names])
