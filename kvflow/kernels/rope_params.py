"""The rotary embedding's parameters and a re-rotation's checked plan.

What planning a re-rotation (kvflow.kernels.rope), its torch reference and its CUDA
kernel (kvflow.kernels.rope_cuda) share, and what a client sends with a registration:
`RopeParams` (one layer's rotary embedding, Hugging Face transformers' definitions),
`LayerRopes` (per layer), `rotation_table` and the plan's `RerotationPlan`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class Pairing(enum.StrEnum):
    """Which dims of the rotary slice form a rotated pair."""

    NEOX = "neox"  # i with i + rotary_dim/2 (transformers' rotate_half; vLLM is_neox_style)
    GPTJ = "gptj"  # 2i with 2i + 1 (interleaved; vLLM is_neox_style=False, DeepSeek MLA)


def _positive(value: object, name: str) -> float:
    """`value` as a float, or ValueError unless it is a finite positive number."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite positive number; got {value!r}")
    return float(value)


def check_index(value: object, name: str, low: int = 0) -> int:
    """`value` as an int, or ValueError unless it is an integer >= low (numpy ints allowed)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    return int(value)


@dataclass(frozen=True)
class LinearScaling:
    """transformers' "linear" rope_type: every inverse frequency divided by `factor`."""

    factor: float

    def __post_init__(self) -> None:
        _positive(self.factor, "LinearScaling.factor")

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float64 in, float64 out)."""
        return inv_freq / self.factor


@dataclass(frozen=True)
class Llama3Scaling:
    """transformers' "llama3" rope_type: low frequencies divided by `factor`, high ones
    kept, the band between them interpolated (wavelengths against the original context)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _positive(self.factor, "Llama3Scaling.factor")
        low = _positive(self.low_freq_factor, "Llama3Scaling.low_freq_factor")
        high = _positive(self.high_freq_factor, "Llama3Scaling.high_freq_factor")
        if high <= low:
            raise ValueError(
                f"Llama3Scaling.high_freq_factor ({high}) must exceed low_freq_factor ({low})"
            )
        check_index(self.original_max_position_embeddings, "original_max_position_embeddings", 1)

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled inverse frequencies (float64 in, float64 out), as transformers'
        `_compute_llama3_parameters` computes them."""
        old = self.original_max_position_embeddings
        low, high, factor = self.low_freq_factor, self.high_freq_factor, self.factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return np.where(medium, smoothed, scaled)


RopeScaling = LinearScaling | Llama3Scaling


@dataclass(frozen=True)
class RopeParams:
    """The rotary embedding of one layer's K, as an engine registers it once.

    rotary_dim: dims that rotate (even); the head size for full rotary, fewer for partial
    rotary. offset: where they start in the head row: 0 for MHA (transformers rotates the
    first rotary_dim), the rope part of an MLA latent row (DeepSeek: 512, rotary_dim 64).
    theta: the base (transformers' rope_theta). scaling: None ("default"), LinearScaling
    or Llama3Scaling. Invalid values raise ValueError naming the field.
    """

    rotary_dim: int
    theta: float = 10000.0
    pairing: Pairing = Pairing.NEOX
    scaling: RopeScaling | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        if check_index(self.rotary_dim, "rotary_dim", 2) % 2:
            raise ValueError(
                f"rotary_dim must be even (dims rotate in pairs); got {self.rotary_dim}"
            )
        _positive(self.theta, "theta")
        check_index(self.offset, "offset")
        try:
            object.__setattr__(self, "pairing", Pairing(self.pairing))
        except ValueError:
            names = ", ".join(p.value for p in Pairing)
            raise ValueError(f"pairing must be one of {names}; got {self.pairing!r}") from None
        if self.scaling is not None and not isinstance(self.scaling, LinearScaling | Llama3Scaling):
            raise ValueError(
                "scaling must be None, LinearScaling or Llama3Scaling (other rope types are "
                f"not supported); got {self.scaling!r}"
            )

    @property
    def half(self) -> int:
        """Number of rotated pairs (and of inverse frequencies)."""
        return self.rotary_dim // 2


def inverse_frequencies(params: RopeParams) -> np.ndarray:
    """inv_freq[i] = 1 / theta^(2i / rotary_dim), scaled, computed in float64 and rounded
    once to float32 (the precision engines hold them in): shape [rotary_dim / 2]."""
    exponents = np.arange(0, params.rotary_dim, 2, dtype=np.float64) / params.rotary_dim
    inv = 1.0 / params.theta**exponents
    if params.scaling is not None:
        inv = params.scaling.apply(inv)
    return inv.astype(np.float32)


def rotation_table(params: RopeParams, deltas: np.ndarray) -> np.ndarray:
    """cos and sin of delta * inv_freq: float32 [len(deltas), rotary_dim / 2, 2].

    The angle is formed in float64 from the float32 frequencies (exact for |delta| < 2^29:
    a 24-bit mantissa times a 29-bit integer) and cos/sin rounded once to float32, so each
    is within 2^-25 of the true value whatever the delta; a float32 angle would be off by
    up to |delta * inv_freq| * 2^-24 (6e-3 rad at delta 10^5). The CPU and CUDA paths both
    read this one table, so they agree bit for bit.
    """
    angles = deltas.astype(np.float64)[:, None] * inverse_frequencies(params).astype(np.float64)
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


@dataclass(frozen=True)
class LayerRopes:
    """Which RopeParams each layer uses: groups of (layers, params). params None marks
    layers without rotary embedding (NoPE), whose K is left alone. Every layer a
    re-rotation touches must be listed."""

    groups: tuple[tuple[tuple[int, ...], RopeParams | None], ...]
    _by_layer: dict[int, RopeParams | None] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        for layers, params in self.groups:
            if params is not None and not isinstance(params, RopeParams):
                raise ValueError(f"params must be RopeParams or None; got {params!r}")
            for layer in layers:
                if check_index(layer, "a layer") in self._by_layer:
                    raise ValueError(f"layer {layer} is in more than one group")
                self._by_layer[int(layer)] = params

    @classmethod
    def uniform(cls, params: RopeParams, num_layers: int) -> LayerRopes:
        """Every one of `num_layers` layers with the same params."""
        return cls(((tuple(range(num_layers)), params),))

    def params(self, layer: int) -> RopeParams | None:
        """The layer's params (None: no RoPE); ValueError if the layer is not listed."""
        if layer not in self._by_layer:
            raise ValueError(
                f"layer {layer} has no rotary parameters (list it with None for a layer "
                "without RoPE)"
            )
        return self._by_layer[layer]


@dataclass(frozen=True)
class RerotateSegment:
    """`num_tokens` consecutive tokens to turn by `delta` (new position - original one).

    Token t lives in block `block_ids[(start + t) // block_size]` at offset
    `(start + t) % block_size`: `start` is the first token's offset in the first block
    (a segment may start inside a block), and block_ids hold exactly the blocks its
    tokens touch.
    """

    block_ids: Sequence[int] | np.ndarray
    start: int
    num_tokens: int
    delta: int


@dataclass(frozen=True, eq=False)
class RerotationPlan:
    """Checked work of one re-rotation, shared by the CPU and CUDA paths.

    layers: (layer, params) of each layer to turn; tokens: int32 [T, 3] of (block id,
    offset in block, row of its delta in `deltas`) per token with a nonzero delta;
    deltas: the distinct nonzero deltas (int64).
    """

    layers: tuple[tuple[int, RopeParams], ...]
    tokens: np.ndarray
    deltas: np.ndarray
