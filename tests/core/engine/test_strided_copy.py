"""`strided_copyto`, the CPU mover's copy (csrc/strided_copy.c): np.copyto's result for
arrays of one shape and item size, whatever their strides; a clear refusal, with nothing
written, of what it does not copy; numpy's loop where no C compiler is found."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvflow.core.engine import strided_copy
from kvflow.core.engine.movers import CpuMover
from kvflow.core.engine.strided_copy import strided_copyto
from kvflow.events import native
from kvflow.kernels import KVLayout
from kvflow.kernels.reference import transfer_reference
from tests.support.engine import TensorChunks


@pytest.fixture
def copyto() -> object:
    made = strided_copyto()
    assert made is not np.copyto, "the C extension was not built (a compiler is installed)"
    return made


def _views(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> Iterator[np.ndarray]:
    """Views of `shape` over fresh random buffers: contiguous, axes permuted, every other
    element of each axis, and reversed axes."""
    size = int(np.prod(shape))

    def buffer(n: int) -> np.ndarray:
        return rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)

    every = (slice(None, None, 2),) * len(shape) or ...  # `...` keeps a 0-d array a view
    backwards = (slice(None, None, -1),) * len(shape) or ...
    yield buffer(size).reshape(shape)
    order = rng.permutation(len(shape))
    permuted = tuple(shape[i] for i in order)
    yield buffer(size).reshape(permuted).transpose(np.argsort(order))
    yield buffer(size * 2 ** len(shape)).reshape([2 * n for n in shape])[every]
    yield buffer(size).reshape(shape)[backwards]


@pytest.mark.parametrize("dtype", ["<u1", "<u2", "<u4", "<u8"])
@pytest.mark.parametrize(
    "shape",
    [(), (1,), (7,), (32,), (33,), (3, 5), (2, 256), (2, 3, 4, 5), (4, 1, 16, 2, 40)],
    ids=str,
)
def test_every_stride_pattern_copies_as_numpy_does(
    copyto: object, shape: tuple[int, ...], dtype: str
) -> None:
    """Every pair of views (contiguous, permuted, strided, reversed) of shapes whose runs
    are shorter than, equal to and longer than a 256-byte block, and not a multiple of it."""
    rng = np.random.default_rng(len(shape) * 10 + np.dtype(dtype).itemsize)
    for src in _views(rng, shape, dtype):
        for dst in _views(rng, shape, dtype):
            want = dst.copy()
            np.copyto(want, src)
            copyto(dst, src)  # type: ignore[operator]
            assert np.array_equal(dst, want), (src.strides, dst.strides)


def test_runs_of_blocks_and_a_tail_between_rows_of_other_strides(copyto: object) -> None:
    """SGLang's `page_first` pattern (2 KiB rows at a 16 KiB stride into a layer-major
    chunk) and rows of 1000 bytes (three 256-byte blocks and a tail): every byte lands,
    and nothing around the destination rows is written."""
    for row in (2048, 1000):
        pool = np.random.default_rng(row).integers(0, 256, (2, 32, 8, row), dtype=np.uint8)
        chunk = np.full((8, 2, 32 + 1, row), 0xA5, dtype=np.uint8)  # one poisoned token row
        copyto(chunk[:, :, :32], pool.transpose(2, 0, 1, 3))  # type: ignore[operator]
        assert np.array_equal(chunk[:, :, :32], pool.transpose(2, 0, 1, 3))
        assert (chunk[:, :, 32] == 0xA5).all()


@pytest.mark.parametrize("row", [64, 2048, 2064, 2056], ids=lambda r: f"row{r}")
@pytest.mark.parametrize("shift", [0, 8], ids=["aligned", "shifted"])
def test_copies_of_128_kib_and_more_stream_every_byte_and_no_other(
    copyto: object, row: int, shift: int
) -> None:
    """A copy of 128 KiB or more writes with streaming stores where every row's destination
    is 16-byte aligned (rows of whole 64-byte steps, or a tail after them), and as any
    other copy where it is not (a destination 8 bytes off, rows of 2056 bytes)."""
    rows = -(-(256 << 10) // row)  # at least 256 KiB
    rng = np.random.default_rng(row + shift)
    pool = rng.integers(0, 256, (rows, 4, row), dtype=np.uint8)
    memory = np.full(4 * (rows + 1) * row + 64, 0xA5, dtype=np.uint8)
    start = -memory.ctypes.data % 16 + shift
    chunk = memory[start : start + 4 * (rows + 1) * row].reshape(4, rows + 1, row)
    copyto(chunk[:, :rows], pool.transpose(1, 0, 2))  # type: ignore[operator]
    assert np.array_equal(chunk[:, :rows], pool.transpose(1, 0, 2))
    assert (chunk[:, rows] == 0xA5).all() and (memory[:start] == 0xA5).all()
    back = np.zeros_like(pool)
    copyto(back.transpose(1, 0, 2), chunk[:, :rows])  # type: ignore[operator]
    assert np.array_equal(back, pool)


def test_a_streamed_copy_walks_its_source_in_any_axis_order(copyto: object) -> None:
    """A streamed copy reorders its outer axes by the source's strides (reads in address
    order): SGLang's `page_head` gather (256-byte rows, heads outermost in the pool), and
    the same with an axis reversed, land every byte where numpy puts it."""
    rng = np.random.default_rng(7)
    pool = rng.integers(0, 256, (8, 16, 8, 256), dtype=np.uint8)  # heads, tokens, layers, row
    for src in (pool.transpose(2, 1, 0, 3), pool[:, ::-1].transpose(2, 1, 0, 3)):
        chunk = np.zeros((8, 16, 8, 256), dtype=np.uint8)  # layers, tokens, heads, row
        copyto(chunk, src)  # type: ignore[operator]
        assert np.array_equal(chunk, src)


def test_an_empty_copy_writes_nothing(copyto: object) -> None:
    dst = np.full((3, 0, 4), 7, dtype=np.uint8)
    copyto(dst, np.empty((3, 0, 4), dtype=np.uint8))  # type: ignore[operator]
    assert dst.shape == (3, 0, 4)


@pytest.mark.parametrize(
    ("dst", "src", "message"),
    [
        (np.zeros((4, 3), np.uint8), np.ones((3, 4), np.uint8),
         r"copyto: dst has shape \(4, 3\), src \(3, 4\)"),
        (np.zeros((2, 3), np.uint8), np.ones((6,), np.uint8),
         r"copyto: dst has shape \(2, 3\), src \(6,\)"),
        (np.zeros(4, np.uint16), np.ones(4, np.uint32),
         r"copyto: items of 2 bytes \(dst\) and 4 bytes \(src\)"),
        (np.zeros((1,) * 17, np.uint8), np.ones((1,) * 17, np.uint8),
         r"copyto: 17 axes, at most 16"),
    ],
    ids=["shape", "axes", "item-size", "too-many-axes"],
)  # fmt: skip
def test_arrays_it_cannot_copy_are_refused_by_name(
    copyto: object, dst: np.ndarray, src: np.ndarray, message: str
) -> None:
    before = dst.copy()
    with pytest.raises(ValueError, match=f"^{message}$"):
        copyto(dst, src)  # type: ignore[operator]
    assert np.array_equal(dst, before)


def test_overlapping_or_read_only_destinations_are_refused(copyto: object) -> None:
    """Byte ranges that overlap (even interleaved rows that share no byte: the check is on
    ranges) and a read-only destination: ValueError, nothing written."""
    buf = np.arange(64, dtype=np.uint8)
    before = buf.copy()
    with pytest.raises(ValueError, match=r"^copyto: dst and src overlap$"):
        copyto(buf[8:40], buf[:32])  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"^copyto: dst and src overlap$"):
        copyto(buf[8:40], buf[31::-1])  # type: ignore[operator]  # a reversed source
    rows = buf.reshape(8, 8)
    with pytest.raises(ValueError, match=r"^copyto: dst and src overlap$"):
        copyto(rows[:, :4], rows[:, 4:])  # type: ignore[operator]
    frozen = np.zeros(8, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copyto(frozen, np.ones(8, dtype=np.uint8))  # type: ignore[operator]
    assert np.array_equal(buf, before) and not frozen.any()
    copyto(buf[32:], buf[:32])  # type: ignore[operator]  # adjacent, not overlapping
    assert np.array_equal(buf[32:], before[:32])


def test_without_a_compiler_the_mover_copies_through_numpy(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    """No C compiler: a warning, `np.copyto`, and a CpuMover that still stores and
    retrieves the reference's bytes."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    strided_copy.strided_copyto.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=strided_copy.__name__):
            assert strided_copyto() is np.copyto
        assert "copy through numpy's strided loop (slower): no C compiler found" in caplog.text
        shape = (2, 10, 4, 2, 8)  # [K/V, blocks, block_size, heads, head] float32
        layers = [torch.randn(shape) for _ in range(2)]
        layout = KVLayout.from_kv_caches(layers, kv_format="vllm_flash_attn")
        ids = np.array([[3, 4], [7, 8]])
        nbytes = layout.chunk_nbytes(2 * layout.block_size)
        want = torch.empty((2, nbytes), dtype=torch.uint8)
        transfer_reference(layout, want, torch.from_numpy(ids), torch.zeros(2), gather=True)
        chunks = TensorChunks([torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)])
        CpuMover(layout).store(ids, chunks)
        assert all(torch.equal(chunks[c], want[c]) for c in range(2))
    finally:
        strided_copy.strided_copyto.cache_clear()
