"""Rotary re-rotation for blend (kvflow/kernels/rope.py), on the CPU path.

The property that makes blend checkable without a model: for random "raw" K vectors
(k_proj's output before RoPE), K stored at position p and turned by q - p equals K
computed at q. Expected values are exact float64 rotations, and the error bound is the
one docs/KERNELS.md states ("Rotary re-rotation", Error bound). Every other byte of the
cache (V, non-rotary dims, other tokens, other layers) must be left bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvflow.kernels import (
    KVFormat,
    KVLayout,
    LayerRopes,
    LinearScaling,
    Llama3Scaling,
    Pairing,
    RerotateSegment,
    RopeParams,
    rerotate,
)
from kvflow.kernels.rope import rerotate_reference
from kvflow.kernels.rope_params import inverse_frequencies, rotation_table
from kvflow.kernels.synthetic import make_kv_caches
from tests.support.kernel_reference import block_of, clone_structure, same_bytes

MHA_FORMATS = [f for f in KVFormat if not f.is_mla]
MLA_FORMATS = [f for f in KVFormat if f.is_mla]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: unit roundoff of each cache dtype (half an ulp at 1)
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
#: float32 cos/sin and arithmetic, relative to a rotated pair's norm
ARITH = 2.0**-21


@dataclass(frozen=True)
class Seg:
    """A segment of the scene: its blocks, first offset, length, original and new position."""

    block_ids: tuple[int, ...]
    start: int
    num_tokens: int
    old: int
    new: int

    def segment(self) -> RerotateSegment:
        return RerotateSegment(self.block_ids, self.start, self.num_tokens, self.new - self.old)

    def slots(self, block_size: int) -> list[tuple[int, int]]:
        positions = range(self.start, self.start + self.num_tokens)
        return [(self.block_ids[p // block_size], p % block_size) for p in positions]


#: with 4-token blocks: one segment from inside block 5 into block 2, one from the end of
#: block 2 (which it shares) into block 6, with deltas of both signs, one of them large
#: (a float32 angle would be off by 7e-3 rad at that delta)
SEGMENTS = (Seg((5, 2), 3, 4, 7, 1000), Seg((2, 6), 3, 3, 123_500, 43))


def rotate_exact(x: torch.Tensor, positions: torch.Tensor, params: RopeParams) -> torch.Tensor:
    """x [T, NH, rotary_dim] (float64) turned to `positions` [T], in float64: transformers'
    rotate_half (NeoX) or rotate_every_two (GPT-J) convention."""
    inv = torch.from_numpy(inverse_frequencies(params)).double()
    angles = positions.double()[:, None, None] * inv  # [T, 1, half]
    cos, sin = angles.cos(), angles.sin()
    if params.pairing is Pairing.NEOX:
        x1, x2 = x[..., : params.half], x[..., params.half :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def pair_norm(x: torch.Tensor, params: RopeParams) -> torch.Tensor:
    """Each element's rotated pair's 2-norm, in x's shape."""
    if params.pairing is Pairing.NEOX:
        x1, x2 = x[..., : params.half], x[..., params.half :]
        norm = (x1 * x1 + x2 * x2).sqrt()
        return torch.cat([norm, norm], dim=-1)
    norm = (x[..., 0::2] ** 2 + x[..., 1::2] ** 2).sqrt()
    return norm.repeat_interleave(2, dim=-1)


class Scene:
    """Random caches with, per rotated layer and segment, K written at its old position."""

    def __init__(
        self,
        fmt: KVFormat,
        ropes: LayerRopes,
        segments: tuple[Seg, ...] = SEGMENTS,
        seed: int = 0,
        **cache_kwargs: Any,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.fmt, self.ropes, self.segs = fmt, ropes, segments
        self.caches, kw = make_kv_caches(fmt, generator=gen, **cache_kwargs)
        self.layout = KVLayout.from_kv_caches(self.caches, **kw)
        self.bs = self.layout.block_size
        self.raw: dict[tuple[int, int], torch.Tensor] = {}
        for layer in range(self.layout.num_layers):
            params = ropes.params(layer)
            for i, seg in enumerate(segments):
                if params is not None:
                    heads = int(self.layout.block_views[layer][0].shape[2])
                    raw = torch.randn(seg.num_tokens, heads, params.rotary_dim, generator=gen)
                    self.raw[layer, i] = raw.double()
                    self.write(self.caches, layer, seg, params, self.at(layer, i, seg.old))
        self.before = clone_structure(self.caches)

    def at(self, layer: int, index: int, position: int) -> torch.Tensor:
        """The exact K of one segment's tokens at `position` onwards."""
        params = self.ropes.params(layer)
        assert params is not None
        raw = self.raw[layer, index]
        return rotate_exact(raw, position + torch.arange(raw.shape[0]), params)

    def rows(self, caches: Any, layer: int, seg: Seg, params: RopeParams) -> list[torch.Tensor]:
        """The rotary slice of each of the segment's K rows in `caches` (this scene's or a
        snapshot), indexed as the format table of docs/KERNELS.md says."""
        end = params.offset + params.rotary_dim
        return [
            block_of(self.fmt, caches, layer, 0, block, self.bs)[offset, :, params.offset : end]
            for block, offset in seg.slots(self.bs)
        ]

    def write(
        self, caches: Any, layer: int, seg: Seg, params: RopeParams, values: torch.Tensor
    ) -> None:
        for row, value in zip(self.rows(caches, layer, seg, params), values, strict=True):
            row.copy_(value.to(row.dtype))

    def read(self, caches: Any, layer: int, seg: Seg, params: RopeParams) -> torch.Tensor:
        return torch.stack([row.double() for row in self.rows(caches, layer, seg, params)])

    def rerotate(self, **kwargs: Any) -> None:
        segments = [seg.segment() for seg in self.segs]
        rerotate(self.layout, self.ropes, segments, backend="cpu", **kwargs)

    def check(self, layers: list[int] | None = None) -> None:
        """Turned K within the bounds; every other byte as before."""
        for layer in range(self.layout.num_layers) if layers is None else layers:
            params = self.ropes.params(layer)
            if params is None:
                continue
            unit = UNIT[self.layout.block_views[layer][0].dtype]
            for i, seg in enumerate(self.segs):
                self.check_segment(layer, i, seg, params, unit)
        assert same_bytes(self.caches, self.before), "bytes outside the turned K changed"

    def check_segment(self, layer: int, i: int, seg: Seg, params: RopeParams, unit: float) -> None:
        got = self.read(self.caches, layer, seg, params)
        stored = self.read(self.before, layer, seg, params)
        # one rounding: against the exact rotation of the K the cache held
        turned = rotate_exact(stored, seg.new - seg.old + torch.zeros(seg.num_tokens), params)
        norm = pair_norm(stored, params)
        tol = unit * turned.abs() + ARITH * norm
        assert ((got - turned).abs() <= tol).all(), _worst(got, turned, tol, layer, i)
        # blend: against K computed at the new position from the raw vectors
        want = self.at(layer, i, seg.new)
        norm = pair_norm(want, params)
        tol = unit * (want.abs() + (1 + unit) * norm) + ARITH * norm
        assert ((got - want).abs() <= tol).all(), _worst(got, want, tol, layer, i)
        # the turned rows go into the snapshot, so the final compare covers everything else
        self.write(self.before, layer, seg, params, got)


def _worst(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor, layer: int, i: int) -> str:
    excess = ((got - want).abs() / tol).max()
    return f"layer {layer} segment {i}: error up to {float(excess):.3g}x the bound"


def uniform(params: RopeParams, layers: int = 2) -> LayerRopes:
    return LayerRopes.uniform(params, layers)


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "permuted"])
@pytest.mark.parametrize("pairing", list(Pairing), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MHA_FORMATS, ids=lambda f: f.value)
def test_turned_k_is_k_computed_at_the_new_position(
    fmt: KVFormat, dtype: torch.dtype, pairing: Pairing, noncontiguous: bool
) -> None:
    """Every MHA format and dtype, both pairings, HND views too: K within one rounding of
    the exact turn of what the cache held and within the blend bound of K at q; V, other
    tokens and other layers bit for bit."""
    scene = Scene(
        fmt, uniform(RopeParams(16, pairing=pairing)), dtype=dtype, head_size=16,
        noncontiguous=noncontiguous,
    )  # fmt: skip
    scene.rerotate()
    scene.check()


@pytest.mark.parametrize("pairing", list(Pairing), ids=str)
@pytest.mark.parametrize("fmt", [KVFormat.VLLM_FLASH_ATTN, KVFormat.SGLANG_MHA], ids=str)
def test_partial_rotary_turns_only_the_first_dims(fmt: KVFormat, pairing: Pairing) -> None:
    """rotary_dim 8 of head 24: the other 16 dims keep their bytes."""
    scene = Scene(fmt, uniform(RopeParams(8, pairing=pairing)), head_size=24)
    scene.rerotate()
    scene.check()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "scaling",
    [LinearScaling(4.0), Llama3Scaling(8.0, 1.0, 4.0, 64)],
    ids=["linear", "llama3"],
)
def test_scaled_frequencies(scaling: LinearScaling | Llama3Scaling, dtype: torch.dtype) -> None:
    """Linear and llama3 scaling (a small original context so all three llama3 bands
    occur among 32 frequencies) turn K to the scaled frequencies' position q."""
    params = RopeParams(64, theta=500000.0, scaling=scaling)
    if isinstance(scaling, Llama3Scaling):
        wavelengths = 2 * np.pi / inverse_frequencies(RopeParams(64, theta=500000.0))
        assert (wavelengths < 16).any() and (wavelengths > 64).any()
        assert ((wavelengths > 16) & (wavelengths < 64)).any()
    scene = Scene(KVFormat.VLLM_FLASH_ATTN, uniform(params), dtype=dtype, head_size=64)
    scene.rerotate()
    scene.check()


@pytest.mark.parametrize("noncontiguous", [False, True], ids=["contiguous", "padded"])
@pytest.mark.parametrize("pairing", list(Pairing), ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", MLA_FORMATS, ids=lambda f: f.value)
def test_mla_turns_only_the_rope_slice(
    fmt: KVFormat, dtype: torch.dtype, pairing: Pairing, noncontiguous: bool
) -> None:
    """An MLA latent row of 24: the rope slice [16, 24) turns, the latent part (K's
    non-rotary part and V) keeps its bytes."""
    params = RopeParams(8, offset=16, pairing=pairing)
    scene = Scene(fmt, uniform(params), dtype=dtype, head_size=24, noncontiguous=noncontiguous)
    scene.rerotate()
    scene.check()


def test_layer_groups_with_their_own_ropes() -> None:
    """Three layer groups: NeoX full rotary, no RoPE (untouched), GPT-J partial rotary
    with linear scaling on a float32 group of another head size."""
    neox = RopeParams(16, theta=10000.0)
    gptj = RopeParams(4, theta=1e6, pairing=Pairing.GPTJ, scaling=LinearScaling(2.0))
    specs = [(2, 16, torch.bfloat16), (2, 16, torch.bfloat16), (1, 8, torch.float32)]
    ropes = LayerRopes((((0,), neox), ((1,), None), ((2,), gptj)))
    scene = Scene(KVFormat.VLLM_FLASH_ATTN, ropes, layer_specs=specs)
    assert len(scene.layout.groups) == 2
    scene.rerotate()
    scene.check()


def test_only_the_layers_asked_for() -> None:
    """layers=[1] (a layerwise retrieve turns each layer after its copy): layer 0 untouched."""
    scene = Scene(KVFormat.VLLM_FLASHINFER, uniform(RopeParams(8)))
    scene.rerotate(layers=[1])
    scene.check(layers=[1])


def test_delta_zero_leaves_every_byte() -> None:
    """A zero delta writes nothing: random bytes, NaN patterns included, stay as they were."""
    gen = torch.Generator().manual_seed(3)
    caches, kw = make_kv_caches(KVFormat.VLLM_FLASH_ATTN, generator=gen, head_size=16)
    layout = KVLayout.from_kv_caches(caches, **kw)
    before = clone_structure(caches)
    rerotate(layout, RopeParams(16), [RerotateSegment((1, 2, 3), 1, 9, 0)])
    assert same_bytes(caches, before)


def test_turning_back_and_forth_composes() -> None:
    """Turning by d then by -d in float32 returns K within two roundings (fp32 cache)."""
    gen = torch.Generator().manual_seed(4)
    caches = [torch.randn(2, 8, 4, 2, 16, generator=gen)]
    layout = KVLayout.from_kv_caches(caches)
    before = caches[0].clone()
    for delta in (98_765, -98_765):
        rerotate(layout, RopeParams(16), [RerotateSegment((0, 1), 2, 5, delta)])
    assert torch.allclose(caches[0], before, rtol=0, atol=8 * ARITH * float(before.abs().max()))


def test_inverse_frequencies_and_table() -> None:
    """inv_freq is theta^(-2i/d) rounded once to float32; the table is cos/sin of exact
    float64 angles rounded once to float32."""
    params = RopeParams(8, theta=10000.0)
    inv = inverse_frequencies(params)
    assert inv.dtype == np.float32
    np.testing.assert_array_equal(inv, (10000.0 ** -(np.arange(4) / 4)).astype(np.float32))
    table = rotation_table(params, np.array([-3, 100_000], dtype=np.int64))
    assert table.shape == (2, 4, 2) and table.dtype == np.float32
    angles = np.array([-3, 100_000], dtype=np.float64)[:, None] * inv.astype(np.float64)
    np.testing.assert_array_equal(table[..., 0], np.cos(angles).astype(np.float32))
    np.testing.assert_array_equal(table[..., 1], np.sin(angles).astype(np.float32))


@pytest.mark.parametrize(
    ("rope_type", "extra", "scaling"),
    [
        ("default", {}, None),
        ("linear", {"factor": 2.5}, LinearScaling(2.5)),
        (
            "llama3",
            {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            Llama3Scaling(8.0, 1.0, 4.0, 8192),
        ),
    ],
)
def test_frequencies_match_transformers(
    rope_type: str, extra: dict[str, float], scaling: LinearScaling | Llama3Scaling | None
) -> None:
    """The scalings are transformers' definitions: its float32 inv_freq (head 64) within
    2 float32 ulps of ours (it computes the power in float32)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = {"rope_type": rope_type, "rope_theta": 500000.0}
    config = transformers.LlamaConfig(
        head_dim=64, hidden_size=256, num_attention_heads=4, max_position_embeddings=16384,
        rope_parameters={**rope, **extra},
    )  # fmt: skip
    init = ROPE_INIT_FUNCTIONS.get(rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters)
    theirs = init(config)[0].numpy()
    ours = inverse_frequencies(RopeParams(64, theta=500000.0, scaling=scaling))
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(ours, theirs, rtol=2 * 2.0**-23, atol=0)


@pytest.mark.parametrize("pairing", list(Pairing), ids=str)
def test_pairings_are_transformers_rotations(pairing: Pairing) -> None:
    """The tests' exact rotation is transformers' NeoX (llama) and GPT-J formulas."""
    pytest.importorskip("transformers")
    from transformers.models.gptj import modeling_gptj
    from transformers.models.llama import modeling_llama

    params = RopeParams(8, pairing=pairing)
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    positions = torch.tensor([0, 7, 4096])
    freqs = positions.double()[:, None] * torch.from_numpy(inverse_frequencies(params)).double()
    if pairing is Pairing.NEOX:  # cos/sin [T, rot]; heads at dim 1
        emb = torch.cat([freqs, freqs], dim=-1)
        theirs, _ = modeling_llama.apply_rotary_pos_emb(x, x, emb.cos(), emb.sin(), 1)
    else:  # [batch, T, heads, rot] and sin/cos [batch, T, rot/2]
        theirs = modeling_gptj.apply_rotary_pos_emb(x[None], freqs.sin()[None], freqs.cos()[None])
        theirs = theirs[0]
    torch.testing.assert_close(rotate_exact(x, positions, params), theirs, rtol=1e-15, atol=1e-15)


def _caches(fmt: KVFormat = KVFormat.VLLM_FLASH_ATTN, **kwargs: Any) -> KVLayout:
    caches, kw = make_kv_caches(fmt, generator=torch.Generator().manual_seed(6), **kwargs)
    return KVLayout.from_kv_caches(caches, **kw)


SEG = RerotateSegment((1,), 0, 4, 5)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: RopeParams(7), "rotary_dim must be even"),
        (lambda: RopeParams(0), "rotary_dim must be an integer >= 2"),
        (lambda: RopeParams(8, pairing="halves"), "pairing must be one of neox, gptj"),
        (lambda: RopeParams(8, theta=-1.0), "theta must be a finite positive"),
        (lambda: RopeParams(8, offset=-2), "offset must be an integer >= 0"),
        (lambda: RopeParams(8, scaling={"rope_type": "yarn"}), "scaling must be None, Linear"),
        (lambda: LinearScaling(0.0), "LinearScaling.factor must be a finite positive"),
        (lambda: Llama3Scaling(8.0, 4.0, 1.0, 8192), "high_freq_factor .* must exceed"),
        (lambda: Llama3Scaling(8.0, 1.0, 4.0, 0), "original_max_position_embeddings must"),
        (lambda: LayerRopes((((0, 1), None), ((1,), None))), "layer 1 is in more than one"),
    ],
)
def test_bad_parameters_are_refused(make: Any, match: str) -> None:
    """Parameters are checked at construction, with the field named."""
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("layout_kwargs", "params", "segments", "match"),
    [
        ({"dtype": torch.float8_e4m3fn}, RopeParams(8), [SEG], "float8_e4m3fn; re-rotation"),
        ({"dtype": torch.int8}, RopeParams(8), [SEG], "quantised K, fp8 or int8"),
        ({"head_size": 8}, RopeParams(16), [SEG], r"rotary dims \[0, 16\) do not fit .* 8"),
        ({"head_size": 8}, RopeParams(4, offset=6), [SEG], r"\[6, 10\) do not fit"),
        ({}, RopeParams(8), [RerotateSegment((8,), 0, 4, 5)], "segment 0: block id 8 out of"),
        ({}, RopeParams(8), [SEG, RerotateSegment((2,), 4, 1, 5)], "segment 1: start 4 must"),
        ({}, RopeParams(8), [RerotateSegment((1,), 2, 4, 5)], "fill 2 blocks of 4; got 1"),
        ({}, RopeParams(8), [RerotateSegment((1.0,), 0, 4, 5)], "1-d list of integers"),
        ({}, RopeParams(8), [RerotateSegment((1,), 0, 4, 2.5)], "delta must be an integer"),
        ({}, RopeParams(8), [RerotateSegment((1,), 0, 4, 2**31)], "does not fit int32"),
        (
            {},
            RopeParams(8),
            [SEG, RerotateSegment((1,), 3, 1, -5)],
            r"slot \(block 1, offset 3\) is in more than one segment",
        ),
        ({}, LayerRopes((((0,), RopeParams(8)),)), [SEG], "layer 1 has no rotary parameters"),
        ({}, "rope", [SEG], "ropes must be RopeParams or LayerRopes"),
    ],
)
def test_bad_requests_are_refused_before_any_write(
    layout_kwargs: dict[str, Any], params: Any, segments: list[RerotateSegment], match: str
) -> None:
    """Bad caches, slices, slots and deltas raise ValueError naming them; nothing is written."""
    layout = _caches(**layout_kwargs)
    before = [[v.clone() for v in kv] for kv in layout.block_views]
    with pytest.raises(ValueError, match=match):
        rerotate_reference(layout, params, segments)
    for kv, was in zip(layout.block_views, before, strict=True):
        assert all(
            torch.equal(v.view(torch.uint8), w.view(torch.uint8))
            for v, w in zip(kv, was, strict=True)
        )


def test_mla_rows_turn_only_a_slice() -> None:
    """MLA keeps no K apart from V: turning the whole latent row is refused."""
    layout = _caches(KVFormat.VLLM_MLA, head_size=16)
    with pytest.raises(ValueError, match="vllm_mla has no K apart from V"):
        rerotate(layout, RopeParams(16), [SEG])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": [2]}, "layer 2 is not within the 2 layers"),
        ({"layers": [0, 0]}, "layers repeat a layer"),
        ({"backend": "gpu"}, "backend must be 'auto', 'cuda' or 'cpu'"),
        ({"backend": "cuda"}, "the cuda backend needs a CUDA cache"),
    ],
)
def test_bad_layers_and_backends(kwargs: dict[str, Any], match: str) -> None:
    """Layers out of range or repeated, an unknown backend, CUDA on a CPU cache."""
    with pytest.raises(ValueError, match=match):
        rerotate(_caches(), RopeParams(8), [SEG], **kwargs)
