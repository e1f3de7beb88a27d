"""The torch reference transfer, checked against a naive per-block model of the formats.

The formats' tensor shapes are tabled in docs/KERNELS.md (KV cache formats).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvflow.kernels import (
    SUPPORTED_DTYPES,
    KVFormat,
    KVLayout,
    LayoutKernels,
    PreparedTransfer,
    transfer_blocks,
)
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import (
    apply_scatter,
    clone_structure,
    expected_gather,
    same_bytes,
)

POISON = 0xA5
PER_LAYER_FORMATS = [f for f in KVFormat if f is not KVFormat.VLLM_CROSS_LAYER]


def _ids_and_skip(
    num_blocks: int, chunks: int, per_chunk: int, seed: int
) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=g)[: chunks * per_chunk].view(chunks, per_chunk)
    skip = [c % (per_chunk + 1) for c in range(chunks)]
    return ids, skip


def _round_trip(fmt: KVFormat, seed: int, **cache_kwargs: object) -> None:
    """Gather into poisoned staging, compare with the model; scatter into a second cache."""
    gen = torch.Generator().manual_seed(seed)
    caches, kw = make_kv_caches(fmt, generator=gen, **cache_kwargs)  # type: ignore[arg-type]
    layout = KVLayout.from_kv_caches(caches, **kw)
    chunks, per_chunk = 3, 2
    ids, skip = _ids_and_skip(layout.num_blocks, chunks, per_chunk, seed)
    nbytes = layout.chunk_nbytes(per_chunk * layout.block_size)
    staging = torch.full((chunks, nbytes), POISON, dtype=torch.uint8)
    want = expected_gather(layout, caches, staging, ids, skip)
    transfer_blocks(layout, staging, ids, direction="gather", skip_blocks=skip, backend="cpu")
    assert torch.equal(staging, want)

    target, _ = make_kv_caches(fmt, generator=gen, **cache_kwargs)  # type: ignore[arg-type]
    target_layout = KVLayout.from_kv_caches(target, **kw)
    expected = clone_structure(target)
    apply_scatter(target_layout, expected, staging, ids, skip)
    transfer_blocks(
        target_layout, staging, ids, direction="scatter", skip_blocks=torch.tensor(skip)
    )
    assert same_bytes(target, expected)


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("fmt", list(KVFormat), ids=lambda f: f.value)
def test_round_trip_every_format_and_dtype(
    fmt: KVFormat, dtype: torch.dtype, noncontiguous: bool
) -> None:
    """Gather then scatter is bit-exact for every format x dtype, with skips and 3 chunks."""
    _round_trip(fmt, seed=7, dtype=dtype, noncontiguous=noncontiguous)


@pytest.mark.parametrize("fmt", PER_LAYER_FORMATS, ids=lambda f: f.value)
def test_two_layer_groups_of_different_head_size_and_dtype(fmt: KVFormat) -> None:
    """Layers with different (heads, head size, dtype) form two groups, concatenated in a chunk."""
    specs = [(2, 8, torch.bfloat16), (1, 12, torch.float8_e4m3fn), (2, 8, torch.bfloat16)]
    _round_trip(fmt, seed=11, layer_specs=specs, noncontiguous=True)
    caches, kw = make_kv_caches(fmt, layer_specs=specs)
    groups = KVLayout.from_kv_caches(caches, **kw).groups
    assert [g.layers for g in groups] == [(0, 2), (1,)]


@pytest.mark.parametrize("fmt", [KVFormat.VLLM_MLA, KVFormat.SGLANG_MLA], ids=lambda f: f.value)
@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "padded"])
def test_mla_head_of_132_int8_bytes(fmt: KVFormat, noncontiguous: bool) -> None:
    """An MLA head of 132 int8 bytes round-trips exactly."""
    _round_trip(fmt, seed=3, head_size=132, dtype=torch.int8, noncontiguous=noncontiguous)


def _setup(
    fmt: KVFormat = KVFormat.VLLM_FLASH_ATTN,
) -> tuple[Any, KVLayout, torch.Tensor]:
    caches, kw = make_kv_caches(fmt)
    layout = KVLayout.from_kv_caches(caches, **kw)
    staging = torch.full((2, layout.chunk_nbytes(8)), POISON, dtype=torch.uint8)
    return caches, layout, staging


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([[0, 8], [1, 2]], "block id 8 out of range"),
        ([[0, -1], [1, 2]], "block id -1 out of range"),
    ],
)
@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_bad_block_ids_are_rejected_before_any_write(
    ids: list[list[int]], message: str, direction: str
) -> None:
    """Out-of-range ids raise in either direction before anything moves."""
    caches, layout, staging = _setup()
    before = clone_structure(caches)
    with pytest.raises(ValueError, match=message):
        transfer_blocks(layout, staging, torch.tensor(ids), direction=direction)  # type: ignore[arg-type]
    assert bool((staging == POISON).all())
    assert same_bytes(caches, before)


def test_scatter_rejects_a_block_written_twice() -> None:
    """Two chunks writing one block would race on the GPU, so scatter refuses them."""
    caches, layout, staging = _setup()
    before = clone_structure(caches)
    with pytest.raises(ValueError, match="repeat a block"):
        transfer_blocks(layout, staging, torch.tensor([[0, 1], [1, 2]]), direction="scatter")
    assert same_bytes(caches, before)


def test_gather_may_read_a_block_twice() -> None:
    """Repeated ids are fine for a gather: both chunks get the same bytes."""
    _, layout, staging = _setup()
    transfer_blocks(layout, staging, torch.tensor([[3, 4], [3, 4]]), direction="gather")
    assert torch.equal(staging[0], staging[1])


def test_skipped_blocks_are_not_checked_for_repeats_on_scatter() -> None:
    """A repeated id inside the skipped prefix is never written, so scatter accepts it."""
    caches, layout, staging = _setup()
    staging.copy_(torch.randint(0, 256, staging.shape, dtype=torch.uint8))
    ids, skip = torch.tensor([[5, 1], [5, 2]]), [1, 1]
    expected = clone_structure(caches)
    apply_scatter(layout, expected, staging, ids, skip)
    transfer_blocks(layout, staging, ids, direction="scatter", skip_blocks=skip)
    assert same_bytes(caches, expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"direction": "sideways"}, "direction must be"),
        ({"backend": "tpu"}, "backend must be"),
        ({"skip_blocks": [0]}, "one count per chunk"),
        ({"skip_blocks": [0, 3]}, r"must lie in \[0, 2\]"),
        ({"skip_blocks": torch.tensor([0.0, 1.0])}, "must hold integers"),
        ({"backend": "cuda"}, "needs a CUDA cache"),
    ],
)
def test_bad_arguments_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    """Bad direction, backend or skip counts raise ValueError naming the argument."""
    _, layout, staging = _setup()
    args: dict[str, object] = {"direction": "gather", **kwargs}
    with pytest.raises(ValueError, match=message):
        transfer_blocks(layout, staging, torch.tensor([[0, 1], [2, 3]]), **args)  # type: ignore[arg-type]
    assert bool((staging == POISON).all())


@pytest.mark.parametrize(
    ("staging", "ids", "message"),
    [
        (torch.zeros(2, 10, dtype=torch.uint8), [[0, 1], [2, 3]], "staging must be"),
        (torch.zeros(2, 256, dtype=torch.float16), [[0, 1], [2, 3]], "uint8"),
        (torch.zeros(1024, 2, dtype=torch.uint8).t(), [[0, 1], [2, 3]], "contiguous"),
        (torch.zeros(2, 1024, dtype=torch.uint8), [0, 1], r"\[num_chunks, blocks_per_chunk"),
    ],
)
def test_bad_staging_or_id_shapes_are_rejected(
    staging: torch.Tensor, ids: list[int], message: str
) -> None:
    """Staging of the wrong shape, dtype or strides, or 1-d block ids, raise ValueError."""
    _, layout, _ = _setup()
    with pytest.raises(ValueError, match=message):
        transfer_blocks(layout, staging, torch.tensor(ids), direction="gather")


def test_float_block_ids_are_rejected() -> None:
    """Block ids must be an integer tensor."""
    _, layout, staging = _setup()
    with pytest.raises(ValueError, match="int64 or int32"):
        transfer_blocks(layout, staging, torch.tensor([[0.0, 1.0]]), direction="gather")


def _flat(x: Any) -> list[torch.Tensor]:
    """The caches' bytes, tensor by tensor (bytes: random fills may hold NaNs)."""
    if isinstance(x, torch.Tensor):
        return [x.contiguous().view(-1).view(torch.uint8)]
    return [t for item in x for t in _flat(item)]


@pytest.mark.parametrize("direction", ["scatter", "gather"])
def test_zero_chunks_is_a_no_op(direction: str) -> None:
    """An empty batch moves nothing and raises nothing: every cache byte stays as it was."""
    caches, layout, _ = _setup()
    before = [t.clone() for t in _flat(caches)]
    assert before and any(t.any() for t in before)  # filled: a zeroing would show
    staging = torch.empty(0, layout.chunk_nbytes(8), dtype=torch.uint8)
    ids = torch.empty(0, 2, dtype=torch.int64)
    transfer_blocks(layout, staging, ids, direction=direction)  # type: ignore[arg-type]
    assert staging.shape == (0, layout.chunk_nbytes(8))
    assert all(torch.equal(a, b) for a, b in zip(before, _flat(caches), strict=True))


@pytest.mark.parametrize(
    "fmt", [KVFormat.VLLM_FLASH_ATTN, KVFormat.SGLANG_MLA], ids=lambda f: f.value
)
def test_prepared_transfer_in_pieces_matches_one_shot(fmt: KVFormat) -> None:
    """Launching chunk groups of a PreparedTransfer moves the same bytes as one transfer."""
    gen = torch.Generator().manual_seed(7)
    caches, kw = make_kv_caches(fmt, generator=gen, num_blocks=32)
    layout = KVLayout.from_kv_caches(caches, **kw)
    chunks, per_chunk = 5, 2
    ids, skip = _ids_and_skip(layout.num_blocks, chunks, per_chunk, seed=7)
    nbytes = layout.chunk_nbytes(per_chunk * layout.block_size)
    whole = torch.full((chunks, nbytes), POISON, dtype=torch.uint8)
    transfer_blocks(layout, whole, ids, direction="gather", skip_blocks=skip)
    pieces = torch.full((chunks, nbytes), POISON, dtype=torch.uint8)
    moves = PreparedTransfer(layout, ids.numpy(), direction="gather", skip_blocks=skip)
    for first, count in ((0, 2), (2, 1), (3, 2)):
        moves.launch(pieces[first : first + count], first, count)
    assert torch.equal(pieces, whole)

    target, _ = make_kv_caches(fmt, generator=gen, num_blocks=32)
    target_layout = KVLayout.from_kv_caches(target, **kw)
    expected = clone_structure(target)
    apply_scatter(target_layout, expected, whole, ids, skip)
    scatter = PreparedTransfer(target_layout, ids, direction="scatter", skip_blocks=skip)
    scatter.launch(whole[:3], 0, 3)
    scatter.launch(whole[3:], 3)
    assert same_bytes(target, expected)


@pytest.mark.parametrize(
    ("first", "count", "message"),
    [(-1, 1, r"chunks \[-1, 0\)"), (2, 2, r"chunks \[2, 4\) are not within the 3"),
     (0, -1, r"chunks \[0, -1\)")],
)  # fmt: skip
def test_prepared_launch_outside_the_prepared_chunks_is_rejected(
    first: int, count: int, message: str
) -> None:
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=16)
    layout = KVLayout.from_kv_caches(caches, **kw)
    moves = PreparedTransfer(layout, torch.arange(6).view(3, 2), direction="gather")
    staging = torch.zeros(
        (max(count, 0), layout.chunk_nbytes(2 * layout.block_size)), dtype=torch.uint8
    )
    with pytest.raises(ValueError, match=message):
        moves.launch(staging, first, count)


def test_prepared_launch_checks_the_staging_rows() -> None:
    """A launch of 2 chunks needs exactly 2 staging rows of the chunk's bytes."""
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=16)
    layout = KVLayout.from_kv_caches(caches, **kw)
    moves = PreparedTransfer(layout, torch.arange(6).view(3, 2), direction="gather")
    staging = torch.zeros((3, layout.chunk_nbytes(2 * layout.block_size)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"staging must be \[num_chunks=2"):
        moves.launch(staging, 1, 2)


def test_prepared_scatter_rejects_a_block_repeated_across_chunks() -> None:
    """Scatter checks repeats over the whole prepared request, not one launch's chunks."""
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=16)
    layout = KVLayout.from_kv_caches(caches, **kw)
    with pytest.raises(ValueError, match="write twice"):
        PreparedTransfer(layout, torch.tensor([[1, 2], [3, 1]]), direction="scatter")


def test_a_transfer_for_another_layer_moves_that_layer_with_the_same_ids() -> None:
    """`for_layout(layer_layout(i))` of a transfer prepared for layer 0 moves layer i's
    bytes exactly as a transfer prepared for layer i would, and nothing of layer 0."""
    gen = torch.Generator().manual_seed(11)
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, generator=gen, num_blocks=32)
    layout = KVLayout.from_kv_caches(caches, **kw)
    chunks, per_chunk = 4, 2
    ids, skip = _ids_and_skip(layout.num_blocks, chunks, per_chunk, seed=11)
    first = PreparedTransfer(
        layout.layer_layout(0), ids.numpy(), direction="gather", skip_blocks=skip
    )
    last = layout.num_layers - 1
    nbytes = layout.layer_layout(last).chunk_nbytes(per_chunk * layout.block_size)
    got = torch.full((chunks, nbytes), POISON, dtype=torch.uint8)
    first.for_layout(layout.layer_layout(last)).launch(got)
    want = torch.full_like(got, POISON)
    transfer_blocks(layout.layer_layout(last), want, ids, direction="gather", skip_blocks=skip)
    assert torch.equal(got, want)
    layer0 = torch.full_like(got, POISON)
    first.launch(layer0)
    assert not torch.equal(layer0, want)  # the layers differ: the test tells them apart


def test_a_transfer_is_not_moved_onto_blocks_of_another_size() -> None:
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, num_blocks=16)
    layout = KVLayout.from_kv_caches(caches, **kw)
    other_caches, other_kw = make_kv_caches(
        KVFormat.VLLM_FLASH_ATTN, num_blocks=16, block_size=2 * layout.block_size
    )
    other = KVLayout.from_kv_caches(other_caches, **other_kw)
    moves = PreparedTransfer(layout, torch.arange(6).view(3, 2), direction="gather")
    with pytest.raises(ValueError, match=f"blocks of {layout.block_size} tokens"):
        moves.for_layout(other)


@pytest.mark.parametrize(
    "fmt", [KVFormat.VLLM_FLASH_ATTN, KVFormat.VLLM_MLA], ids=lambda f: f.value
)
def test_a_span_of_layers_gathers_the_runs_span_parts_names(fmt: KVFormat) -> None:
    """Gathering with `span_layout(first, count)` writes, per chunk, exactly the bytes of a
    whole chunk's gather at `span_parts`: several layers move in one launch as their
    one-layer transfers would, and every span is one run per kv."""
    gen = torch.Generator().manual_seed(12)
    caches, kw = make_kv_caches(fmt, generator=gen, num_blocks=32, num_layers=5)
    layout = KVLayout.from_kv_caches(caches, **kw)
    chunks, per_chunk = 3, 2
    tokens = per_chunk * layout.block_size
    ids, skip = _ids_and_skip(layout.num_blocks, chunks, per_chunk, seed=12)
    whole = torch.full((chunks, layout.chunk_nbytes(tokens)), POISON, dtype=torch.uint8)
    transfer_blocks(layout, whole, ids, direction="gather", skip_blocks=skip)
    for first, count in [(0, 1), (1, 2), (1, 4), (0, 5)]:
        parts = layout.span_parts(first, count, tokens)
        assert len(parts) == (1 if fmt.is_mla else 2)
        span = layout.span_layout(first, count)
        assert span.chunk_nbytes(tokens) == sum(n for _, n in parts)
        got = torch.full((chunks, span.chunk_nbytes(tokens)), POISON, dtype=torch.uint8)
        prepared = PreparedTransfer(layout.layer_layout(0), ids.numpy(), direction="gather",
                                    skip_blocks=skip)  # fmt: skip
        prepared.for_layout(span).launch(got)
        want = torch.cat([whole[:, offset : offset + n] for offset, n in parts], dim=1)
        assert torch.equal(got, want), (first, count)


def test_layout_kernels_move_any_transfers_ids_through_their_layout() -> None:
    """`LayoutKernels.launch` scatters the chunks of any prepared transfer (two here, one
    kernels object) from a flat buffer's first rows through a span of layers exactly as
    `for_layout(span).launch` does, and leaves the other layers alone."""
    gen = torch.Generator().manual_seed(13)
    caches, kw = make_kv_caches(
        KVFormat.VLLM_FLASH_ATTN, generator=gen, num_blocks=32, num_layers=5
    )
    layout = KVLayout.from_kv_caches(caches, **kw)
    want = clone_structure(caches)
    want_layout = KVLayout.from_kv_caches(want, **kw)
    per_chunk = 2
    tokens = per_chunk * layout.block_size
    kernels = LayoutKernels(layout.span_layout(1, 3), tokens, gather=False)
    nbytes = want_layout.span_layout(1, 3).chunk_nbytes(tokens)
    assert kernels.chunk_nbytes == nbytes
    for seed, first, count in [(21, 0, 3), (22, 1, 2)]:
        ids, skip = _ids_and_skip(layout.num_blocks, 3, per_chunk, seed=seed)
        rows = torch.randint(0, 256, (count, nbytes), dtype=torch.uint8, generator=gen)
        flat = torch.full((4 * nbytes,), POISON, dtype=torch.uint8)
        flat[: count * nbytes] = rows.view(-1)
        moves = PreparedTransfer(
            layout.layer_layout(0), ids.numpy(), direction="scatter", skip_blocks=skip
        )
        kernels.launch(moves, flat, first, count)
        reference = PreparedTransfer(
            want_layout.layer_layout(0), ids.numpy(), direction="scatter", skip_blocks=skip
        )
        reference.for_layout(want_layout.span_layout(1, 3)).launch(rows, first, count)
        assert same_bytes(caches, want), (first, count)
    untouched, _ = make_kv_caches(
        KVFormat.VLLM_FLASH_ATTN, generator=torch.Generator().manual_seed(13), num_blocks=32,
        num_layers=5,
    )  # fmt: skip
    assert not same_bytes(caches, untouched)  # the launches wrote something


def test_only_layers_next_to_each_other_in_one_group_make_a_span() -> None:
    """Layers of two groups (another head count every other layer) or past the last layer
    are no span: `span_fits` says so and the span's layout and parts refuse them."""
    specs = [(4, 16, torch.float16), (2, 8, torch.float16), (4, 16, torch.float16)]
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASHINFER, layer_specs=specs)
    layout = KVLayout.from_kv_caches(caches, **kw)
    assert layout.span_fits(0, 1) and not layout.span_fits(0, 2)
    assert not layout.span_fits(2, 2) and not layout.span_fits(-1, 1) and not layout.span_fits(0, 0)
    with pytest.raises(ValueError, match="not one span"):
        layout.span_layout(0, 2)
    with pytest.raises(ValueError, match="not one span"):
        layout.span_parts(1, 2, layout.block_size)
