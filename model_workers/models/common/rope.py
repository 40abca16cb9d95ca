"""Rotary position embeddings: default and YaRN frequencies, interleaved-pair and half-split rotation.

Positions are always the global position ids of the tokens (prefix offset included); under context
parallelism they are sliced with the tokens, never recomputed.
"""

from __future__ import annotations

import math

import torch

from model_workers.models.common.config_fields import RopeSpec


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim/2], cos/sin scaling factor)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    pos_freqs = rope.theta**exponents  # [dim/2]
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, _yarn_attention_factor(rope)


def _yarn_correction_range(rope: RopeSpec, dim: int) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        ratio = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_attention_factor(rope: RopeSpec) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def attention_softmax_scale(config) -> float:
    """`config`'s (qk_head_dim, rope) MLA softmax scale: qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim."""
    scale = config.qk_head_dim**-0.5
    rope = config.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        mscale = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


class RotaryTable:
    """cos/sin per position for one rope dimension; `for_positions` looks rows up by global position.

    Built from a model config (`RotaryTable(config)`: its `rope` over its `qk_rope_head_dim`) or from any spec and
    dimension (`RotaryTable.of(spec, dim)`: DeepSeek-V4's main and compress tables)."""

    def __init__(self, config=None):
        self._copies: dict[torch.device, torch.Tensor] = {}  # inv_freq on each device it was used on
        if config is not None:
            self.inv_freq, self.scaling = inverse_frequencies(config.rope, config.qk_rope_head_dim)

    def frequencies_on(self, device: torch.device) -> torch.Tensor:
        """inv_freq on `device`, copied there once (a forward captured in a CUDA graph must not copy from the host)."""
        if device not in self._copies:
            self._copies[device] = self.inv_freq.to(device)
        return self._copies[device]

    @classmethod
    def of(cls, rope: RopeSpec, dim: int) -> "RotaryTable":
        table = cls()
        table.inv_freq, table.scaling = inverse_frequencies(rope, dim)
        return table

    def for_positions(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) each [T, rope_dim/2] in float32 (scaling folded in)."""
        freqs = positions.to(torch.float32)[:, None] * self.frequencies_on(positions.device)[None, :]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates interleaved pairs (x0,x1),(x2,x3)...; output lays the rotated evens then odds.

    x [T, ..., R], cos/sin [T, R/2]. Dot products between two rotated vectors equal those of the
    pair-interleaved layout, so keys and queries only need to agree with each other.
    """
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.cat([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1)
    return out.to(x.dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotates interleaved pairs (x0,x1),(x2,x3)... in place of the layout (DeepSeek-V4, where the rotated
    vector is also the value and its output is de-rotated: `inverse` rotates by -angle). x [T, ..., R]."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    sin = -sin if inverse else sin
    x_even, x_odd = x[..., 0::2].float(), x[..., 1::2].float()
    out = torch.stack([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x_i, x_{i+R/2}) (the "rotate_half" layout). x [T, ..., R], cos/sin [T, R/2]."""
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    half = x.shape[-1] // 2
    x_low, x_high = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x_low * cos - x_high * sin, x_high * cos + x_low * sin], dim=-1)
    return out.to(x.dtype)


def _broadcast(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    while table.dim() < x.dim():
        table = table.unsqueeze(-2)
    return table
