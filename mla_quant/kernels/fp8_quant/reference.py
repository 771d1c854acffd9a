"""Pure-torch references for FP8 (e4m3) quantization: fp32 math, written for clarity.

Scale rule (DeepSeek ``act_quant``): ``amax = max(|x| over the group, 1e-4)``, ``scale = amax / 448``,
optionally rounded up to a power of two ("ue8m0"); ``q = e4m3(clamp(x / scale, -448, 448))`` and
``real ≈ q * scale``; ``x / scale`` is computed as ``x * (1 / scale)`` with the reciprocal rounded
once per group (one division per group keeps the kernels memory-bound). Non-finite inputs: the scale is taken over the finite values only; ±inf saturates to
±448; NaN stays NaN in its own element. Division is IEEE round-to-nearest (the Triton kernels use
``div_rn``), so both backends are bit-exact on the GPU.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
FP8 = torch.float8_e4m3fn


def finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and ±inf replaced by 0 (they take no part in the scale)."""
    ax = x.float().abs()
    return torch.where(torch.isfinite(ax), ax, torch.zeros_like(ax))


def ue8m0_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to a power of two, exactly, through the exponent bits."""
    bits = scale.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def div_ieee(a: torch.Tensor, c: float) -> torch.Tensor:
    """a / c rounded once (IEEE). ``a / c`` with a Python scalar multiplies by 1/c on CUDA, which can
    differ in the last bit from the kernels' ``div_rn``."""
    return a / torch.full_like(a, c)


def reciprocal(s: torch.Tensor) -> torch.Tensor:
    """1 / s rounded once, as the kernels' ``_triton_utils.reciprocal``."""
    return torch.ones_like(s) / s


def fp8_scale_from_amax(amax: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    scale = div_ieee(amax.float().clamp_min(AMAX_FLOOR), FP8_MAX)
    return ue8m0_ceil(scale) if ue8m0 else scale


def cast_fp8_saturating(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 after clamping to ±448 (torch turns out-of-range values into NaN); NaN stays NaN."""
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def act_quant_fp8_reference(
    x: torch.Tensor, group_size: int = 128, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group activation quantization.

    x: [..., K] (bf16/fp16/fp32), K % group_size == 0.
    Returns q: [..., K] e4m3 and scale: [..., K // group_size] fp32 with x ≈ q * scale (per group).
    """
    *lead, k = x.shape
    g = x.float().reshape(*lead, k // group_size, group_size)
    scale = fp8_scale_from_amax(finite_abs(g).amax(dim=-1), ue8m0)
    q = cast_fp8_saturating(g * reciprocal(scale)[..., None])
    return q.reshape(x.shape), scale


def _block_view(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """Zero-pad [N, K] to whole blocks and view as [N/bn, bn, K/bk, bk]."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    return padded.view(nb, bn, kb, bk), nb, kb


def block_quant_fp8_reference(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128 block weight quantization (DeepSeek / GLM FP8 checkpoints).

    w: [N, K]. Returns q: [N, K] e4m3 and weight_scale_inv: [ceil(N/bn), ceil(K/bk)] fp32 with
    w[i, j] ≈ q[i, j] * weight_scale_inv[i // bn, j // bk]. Partial edge blocks are zero-padded for the scale.
    """
    n, k = w.shape
    blocks, _, _ = _block_view(w, block)
    scale = fp8_scale_from_amax(finite_abs(blocks).amax(dim=(1, 3)))
    q = cast_fp8_saturating(blocks * reciprocal(scale)[:, None, :, None])
    q = q.reshape(blocks.shape[0] * block[0], -1)[:n, :k]
    return q.contiguous(), scale


def block_dequant_fp8_reference(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of :func:`block_quant_fp8_reference`: [N, K] e4m3 × per-block fp32 scale -> [N, K] out_dtype."""
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (q.float() * s).to(out_dtype)


def kv_quant_fp8_reference(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 KV quantization of token rows.

    x: [T, D]. With ``scale=None`` each token gets its own scale (returned [T] fp32); with a given
    per-tensor ``scale`` ([1] fp32, e.g. calibrated) every token uses it. Returns (q [T, D] e4m3, scale).
    """
    xf = x.float()
    if scale is None:
        scale = fp8_scale_from_amax(finite_abs(xf).amax(dim=-1))
        return cast_fp8_saturating(xf * reciprocal(scale)[:, None]), scale
    return cast_fp8_saturating(xf * reciprocal(scale.float())), scale
