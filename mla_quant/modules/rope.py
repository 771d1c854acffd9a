"""Rotary position embedding with YaRN scaling, as DeepSeek-V3 / Kimi K2.x / GLM-5.x use it.

Conventions (docs/mla.md; reference/model_specs.md §5.6, §6.3–6.4):

* ``interleaved=True`` (MLA q_pe / k_pe of all three families, GLM's indexer): pairs ``(x[2i], x[2i+1])``
  are rotated by angle ``pos·inv_freq[i]`` — the DeepSeek reference's complex form. The output stays in the
  interleaved order, so cached k_pe bytes are FlashMLA's. (HF permutes to half-split order first; q·k is the
  same, the bytes are not.)
* ``interleaved=False`` (NeoX half-split; DeepSeek-V3.2's indexer): ``x[i]`` pairs with ``x[i + D/2]``.
* YaRN inverse frequencies follow HF ``_compute_yarn_parameters`` (≡ the DeepSeek reference
  ``precompute_freqs_cis`` with ``truncate=True``); cos/sin are multiplied by HF's ``attention_factor``
  (= ``get_mscale(f, mscale) / get_mscale(f, mscale_all_dim)``, 1.0 for DeepSeek / Kimi).
* The softmax scale correction: ``qk_head_dim^-0.5 · get_mscale(f, mscale_all_dim)²`` when YaRN is active
  (0.130861 for Kimi K2 f=32, 0.144680 for f=64; GLM-5.x has no YaRN: 256^-0.5 = 0.0625).

All angle and rotation arithmetic is fp32; the result is cast back to the input dtype once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1·mscale·ln(scale) + 1`` (1 for scale ≤ 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_find_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float,
                               original_max_position_embeddings: int, truncate: bool = True) -> tuple[float, float]:
    """The rotary-dimension range [low, high] over which YaRN ramps from interpolation to extrapolation."""
    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


@dataclass(frozen=True)
class YarnScaling:
    """The ``rope_scaling`` block of a config with ``type``/``rope_type`` ``yarn`` (HF field names)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, rope_scaling: dict | None) -> "YarnScaling | None":
        """None for no scaling (``null`` or ``rope_type: default``); raises for other scaling types."""
        if rope_scaling is None:
            return None
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ("yarn", "deepseek_yarn"):
            raise ValueError(f"rope_scaling: type {kind!r} not supported (expected 'yarn' or 'default')")
        for key in ("factor", "original_max_position_embeddings"):
            if rope_scaling.get(key) is None:
                raise ValueError(f"rope_scaling: yarn needs {key!r}")
        return cls(
            factor=float(rope_scaling["factor"]),
            original_max_position_embeddings=int(rope_scaling["original_max_position_embeddings"]),
            # HF: `rope_scaling.get("beta_fast") or 32` — a missing or zero value means the paper's default.
            beta_fast=float(rope_scaling.get("beta_fast") or 32.0),
            beta_slow=float(rope_scaling.get("beta_slow") or 1.0),
            mscale=rope_scaling.get("mscale"),
            mscale_all_dim=rope_scaling.get("mscale_all_dim"),
            attention_factor=rope_scaling.get("attention_factor"),
            truncate=bool(rope_scaling.get("truncate", True)),
        )

    def cos_sin_factor(self) -> float:
        """HF ``attention_factor``: the multiplier applied to cos and sin."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """The factor whose square multiplies the softmax scale (HF ``yarn_get_mscale(f, mscale_all_dim)``)."""
        return yarn_get_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0


def rope_inv_freq(dim: int, base: float, scaling: YarnScaling | None = None) -> torch.Tensor:
    """Inverse frequencies, fp32 [dim/2]: ``base^(-2i/dim)``, YaRN-blended when ``scaling`` is given."""
    if dim % 2:
        raise ValueError(f"dim: rotary dimension {dim} must be even")
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1.0 / pos_freqs
    if scaling is None:
        return extrapolation
    interpolation = 1.0 / (scaling.factor * pos_freqs)
    low, high = yarn_find_correction_range(scaling.beta_fast, scaling.beta_slow, dim, base,
                                           scaling.original_max_position_embeddings, scaling.truncate)
    if low == high:
        high += 0.001  # HF / reference: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high-frequency dims keep their frequency), 0: interpolate by 1/factor
    return interpolation * (1 - keep) + extrapolation * keep


def softmax_scale(qk_head_dim: int, scaling: YarnScaling | None = None) -> float:
    """``qk_head_dim^-0.5``, times ``mscale²`` under YaRN (DeepSeek / HF MLA attention)."""
    m = scaling.softmax_mscale() if scaling is not None else 1.0
    return qk_head_dim ** -0.5 * m * m


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate the last dimension of ``x`` ([..., D]) by angles whose cos/sin are [..., D/2] (broadcastable).

    Computed in fp32; returns x.dtype.
    """
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return y.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE over ``dim`` rotary dimensions, plain or YaRN-scaled.

    ``forward(x, positions)``: x ``[*P, ..., dim]`` where ``positions`` (int) has shape ``P``, a prefix of
    x's shape (e.g. x ``[B, T, H, D]`` with positions ``[B, T]``, or x ``[T, D]`` with positions ``[T]``).
    """

    def __init__(self, dim: int, base: float = 10000.0, scaling: YarnScaling | dict | None = None,
                 interleaved: bool = True, device: torch.device | str | None = None):
        super().__init__()
        if isinstance(scaling, dict) or scaling is None:
            scaling = YarnScaling.from_config(scaling)
        self.dim, self.base, self.scaling, self.interleaved = dim, float(base), scaling, interleaved
        self.attention_factor = scaling.cos_sin_factor() if scaling is not None else 1.0
        inv_freq = rope_inv_freq(dim, self.base, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device) if device is not None else inv_freq, persistent=False)

    @classmethod
    def from_config(cls, dim: int, rope_theta: float, rope_scaling: dict | None = None,
                    interleaved: bool = True, device=None) -> "RotaryEmbedding":
        """From the config fields ``qk_rope_head_dim``, ``rope_theta``, ``rope_scaling`` (HF names)."""
        return cls(dim, rope_theta, YarnScaling.from_config(rope_scaling), interleaved, device)

    def softmax_scale(self, qk_head_dim: int) -> float:
        return softmax_scale(qk_head_dim, self.scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int [*P] -> (cos, sin) fp32 [*P, dim/2], attention_factor applied."""
        inv_freq = self.inv_freq
        if inv_freq.device.type == "meta" or inv_freq.device != positions.device:
            # built on meta (gpt-fast style) or not moved with the model: recompute where the positions live
            inv_freq = rope_inv_freq(self.dim, self.base, self.scaling).to(positions.device)
        angles = positions.float()[..., None] * inv_freq
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RotaryEmbedding: x has {x.shape[-1]} features, expected {self.dim}")
        p = positions.dim()
        if tuple(positions.shape) != tuple(x.shape[:p]) or p >= x.dim():
            raise ValueError(f"positions: shape {tuple(positions.shape)} must be a leading prefix of x's "
                             f"shape {tuple(x.shape)} (without its last dimension)")
        cos, sin = self.cos_sin(positions)
        extra = (1,) * (x.dim() - 1 - p)
        cos = cos.reshape(*positions.shape, *extra, self.dim // 2)
        sin = sin.reshape(*positions.shape, *extra, self.dim // 2)
        return apply_rotary(x, cos, sin, self.interleaved)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, scaling={self.scaling}, interleaved={self.interleaved}"
