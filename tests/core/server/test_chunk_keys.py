"""Requests named by chunk keys, and KV caches in another allocator's memfd, through a real
`kvflow server` (what SGLang's storage tier needs: kvflow.integrations.sglang)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest
import torch

from kvflow.core import KVFlowClient, empty_shared
from kvflow.core.engine.cache_engine import MAX_REQUEST_TOKENS
from kvflow.core.engine.chunk_keys import check_chunk_keys, keys_from_wire
from kvflow.core.errors import InvalidRequestError
from kvflow.core.server.protocol import FdMemory, KVCachesDesc, TensorDesc
from kvflow.core.server.sharing import open_kv_caches
from kvflow.core.server.shm import forget_memfd, share_memfd, shared_memory_of
from tests.e2e.server_proc import running_server

PAGE = 4  # tokens per page = block = chunk
LAYERS, PAGES, HEADS, DIM = 2, 16, 2, 8


def _key(name: str) -> bytes:
    return blake3.blake3(name.encode()).digest()


def _pool(fill: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An sglang_mha pair (K list, V list) of [PAGES*PAGE, HEADS, DIM] in shared memory."""
    k = [empty_shared((PAGES * PAGE, HEADS, DIM), torch.float16) for _ in range(LAYERS)]
    v = [empty_shared((PAGES * PAGE, HEADS, DIM), torch.float16) for _ in range(LAYERS)]
    for t in k + v:
        t.copy_(torch.randn(t.shape) if fill else torch.zeros(t.shape))
    return k, v


def _page(pool: tuple[list[torch.Tensor], list[torch.Tensor]], page: int) -> torch.Tensor:
    rows = slice(page * PAGE, (page + 1) * PAGE)
    return torch.stack([t[rows] for t in pool[0] + pool[1]])


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(PAGE, log) as ep:
        yield ep


def test_pages_named_by_keys_store_look_up_and_load_bit_exact(endpoint: str) -> None:
    """Pages stored under their own keys are found as a prefix of keys and land in another
    instance's blocks byte for byte; a missing key ends the prefix."""
    src, dst = _pool(True), _pool(False)
    keys = [_key(f"page-{i}") for i in range(5)]
    with KVFlowClient(endpoint) as client:
        client.register_kv_caches("keys-src", src, model_name="m", block_size=PAGE)
        client.register_kv_caches("keys-dst", dst, model_name="m", block_size=PAGE)
        # pages 3, 7, 1 of src hold keys 0, 1, 2; key 3 is never stored, key 4 is
        stored = client.store("keys-src", None, [3, 7, 1], request_id="s1", chunk_keys=keys[:3])
        assert stored == 3 * PAGE
        client.store("keys-src", None, [9], request_id="s2", chunk_keys=[keys[4]])
        assert client.lookup(None, model_name="m", chunk_keys=keys) == 3 * PAGE
        assert client.lookup(None, model_name="m", chunk_keys=keys[3:]) == 0
        assert client.lookup(None, model_name="m", chunk_keys=keys[4:]) == PAGE
        # other names, other salts, other models miss
        assert client.lookup(None, model_name="m", chunk_keys=[_key("other")]) == 0
        assert client.lookup(None, model_name="m", chunk_keys=keys, cache_salt="s") == 0
        assert client.lookup(None, model_name="n", chunk_keys=keys) == 0
        hit = client.retrieve("keys-dst", None, [0, 5, 11], request_id="r1", chunk_keys=keys[:3])
        assert hit == 3 * PAGE
        for src_page, dst_page in ((3, 0), (7, 5), (1, 11)):
            assert torch.equal(_page(dst, dst_page), _page(src, src_page))
        assert torch.count_nonzero(_page(dst, 2)) == 0  # untouched
        # a retrieve stops at the first missing key: nothing after it is written
        hit = client.retrieve(
            "keys-dst", None, [12, 13, 14], request_id="r2", chunk_keys=[keys[0], keys[3], keys[4]]
        )
        assert hit == PAGE and torch.count_nonzero(_page(dst, 14)) == 0


def test_keys_and_tokens_are_separate_names(endpoint: str) -> None:
    """A chunk stored by its tokens is not found by a key, and a request cannot carry both."""
    src = _pool(True)
    with KVFlowClient(endpoint) as client:
        client.register_kv_caches("keys-tokens", src, model_name="t", block_size=PAGE)
        tokens = list(range(PAGE))
        assert client.store("keys-tokens", tokens, [0], request_id="t1") == PAGE
        assert client.lookup(tokens, model_name="t") == PAGE
        assert client.lookup(None, model_name="t", chunk_keys=[_key("0123")]) == 0
        with pytest.raises(InvalidRequestError, match="not both"):
            client.lookup(tokens, model_name="t", chunk_keys=[_key("x")])


def test_malformed_keys_are_refused_and_the_server_keeps_serving(endpoint: str) -> None:
    with KVFlowClient(endpoint) as client:
        with pytest.raises(InvalidRequestError, match="32-byte"):
            client.lookup(None, model_name="m", chunk_keys=[b"short"])
        with pytest.raises(InvalidRequestError, match="32-byte"):
            client.lookup(None, model_name="m", chunk_keys="not keys")  # type: ignore[arg-type]
        assert client.lookup(None, model_name="m", chunk_keys=[]) == 0
        assert client.status()


def test_engine_refuses_more_keys_than_a_request_may_carry() -> None:
    too_many = MAX_REQUEST_TOKENS // PAGE + 1
    with pytest.raises(InvalidRequestError, match="MAX_REQUEST_TOKENS"):
        check_chunk_keys([_key("k")] * too_many, PAGE, MAX_REQUEST_TOKENS)
    with pytest.raises(InvalidRequestError, match=r"chunk_keys\[1\] must be 32 bytes"):
        check_chunk_keys([_key("k"), b"x" * 31], PAGE, MAX_REQUEST_TOKENS)
    with pytest.raises(InvalidRequestError, match="whole number"):
        keys_from_wire(np.zeros(9, dtype="<i4"))


def _memfd_tensor(nbytes: int) -> tuple[torch.Tensor, int]:
    fd = os.memfd_create("kvflow-test-pool")
    os.ftruncate(fd, nbytes)
    mapping = mmap.mmap(fd, nbytes)
    return torch.frombuffer(mapping, dtype=torch.uint8), fd


def test_a_cache_in_a_memfd_is_mapped_by_the_server(endpoint: str) -> None:
    """A host pool another allocator put in a memfd (SGLang's shm allocator) registers
    without a copy: the server writes into the very pages the engine reads."""
    per_layer = PAGES * PAGE * HEADS * DIM
    raw, fd = _memfd_tensor(2 * LAYERS * per_layer * 2)
    try:
        share_memfd(raw, fd)
        halves = raw.view(torch.float16).view(2, LAYERS, PAGES * PAGE, HEADS, DIM)
        pool = ([halves[0, i] for i in range(LAYERS)], [halves[1, i] for i in range(LAYERS)])
        memory = shared_memory_of(pool[1][1])
        assert isinstance(memory, FdMemory) and memory.pid == os.getpid() and memory.fd == fd
        assert memory.offset == (LAYERS + 1) * per_layer * 2
        src = _pool(True)
        keys = [_key("memfd-0"), _key("memfd-1")]
        with KVFlowClient(endpoint) as client:
            client.register_kv_caches("memfd-src", src, model_name="f", block_size=PAGE)
            client.register_kv_caches("memfd-dst", pool, model_name="f", block_size=PAGE)
            client.store("memfd-src", None, [2, 4], request_id="f1", chunk_keys=keys)
            assert client.retrieve("memfd-dst", None, [6, 8], request_id="f2", chunk_keys=keys)
            assert torch.equal(_page(pool, 6), _page(src, 2))
            assert torch.equal(_page(pool, 8), _page(src, 4))
            client.unregister("memfd-dst")
    finally:
        forget_memfd(raw)
        os.close(fd)
    assert shared_memory_of(raw) is None


def test_share_memfd_refuses_what_is_not_a_memfd(tmp_path: Path) -> None:
    raw, fd = _memfd_tensor(4096)
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * 4096)
    plain = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(ValueError, match="not a memfd"):
            share_memfd(raw, plain)
        with pytest.raises(ValueError, match="starts the memfd"):
            share_memfd(raw[1:], fd)
        with pytest.raises(ValueError, match="fewer than"):
            share_memfd(_memfd_tensor(8192)[0], fd)
    finally:
        os.close(plain)
        os.close(fd)


def test_the_server_maps_only_a_clients_memfd(tmp_path: Path) -> None:
    """Descriptions naming a plain file, a missing descriptor or the server's own process
    are refused with a message, never mapped."""
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * 4096)
    plain = os.open(path, os.O_RDWR)

    def desc(pid: int, fd: int, size: int = 4096) -> KVCachesDesc:
        memory = FdMemory(pid=pid, fd=fd, size=size, offset=0)
        return KVCachesDesc(kind="tensor", tensors=[TensorDesc("uint8", (4096,), (1,), memory)])

    try:
        # this process stands for the server here: its own pid is refused
        with pytest.raises(InvalidRequestError, match="cannot be a client's memfd"):
            open_kv_caches(desc(os.getpid(), plain))
        parent = os.getppid()
        with pytest.raises(InvalidRequestError, match="cannot open"):
            open_kv_caches(desc(parent, 10**6))
    finally:
        os.close(plain)
    # a memfd of another process is mapped; a size that differs is refused
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import os,sys; fd=os.memfd_create('x'); os.ftruncate(fd, 4096); print(fd, flush=True);"
         " sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        fd = int(holder.stdout.readline())
        opened = open_kv_caches(desc(holder.pid, fd))
        assert opened.kv_caches.numel() == 4096
        assert opened.release()
        with pytest.raises(InvalidRequestError, match="described as 8192"):
            open_kv_caches(desc(holder.pid, fd, 8192))
        with pytest.raises(InvalidRequestError, match="not a memfd"):
            open_kv_caches(desc(holder.pid, 0))  # its stdin: a pipe
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=10)
