"""Pure-torch references for symmetric INT4 group quantization in compressed-tensors ``pack-quantized`` form.

Quantization (compressed-tensors ``minmax`` observer, symmetric): per group of ``group_size`` input
columns, ``scale = absmax / 7.5`` rounded to the scale dtype (bf16 for Kimi K2.6), then
``q = clamp(round_half_even(w · (1/scale)), -8, 7)`` computed with that rounded scale (its reciprocal
rounded once); an all-zero group gets
scale 0 and codes 0. Dequantization: ``w = q * scale``.

Packing: nibble = q + 8 (0..15); element j of a row goes to int32 word j // 8 at bits 4·(j % 8)
(least significant nibble first); the word is the signed reinterpretation of those 32 bits.
"""
from __future__ import annotations

import torch

from ..fp8_quant.reference import div_ieee, reciprocal

QMIN, QMAX = -8, 7
HALF_RANGE = 7.5  # (QMAX - QMIN) / 2


def int4_pack_reference(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7], [N, K] with K % 8 == 0 -> int32 [N, K // 8]."""
    n, k = q.shape
    nibbles = (q.to(torch.int64) + 8).reshape(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)  # disjoint bits: sum == or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def int4_unpack_reference(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> int8 codes [N, K] in [-8, 7]."""
    n, kw = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nibbles = (packed[:, :, None] >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).reshape(n, kw * 8)


def int4_group_scales(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """[N, K] -> [N, K // group_size] symmetric scales, rounded to ``scale_dtype``."""
    n, k = w.shape
    absmax = w.float().reshape(n, k // group_size, group_size).abs().amax(dim=-1)
    return div_ieee(absmax, HALF_RANGE).to(scale_dtype)


def int4_codes(w: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round w to the grid of ``scale`` ([N, K // group_size]): int8 codes [N, K]."""
    n, k = w.shape
    s = scale.float().repeat_interleave(group_size, dim=1)
    q = torch.where(s == 0, torch.zeros_like(s), torch.round(w.float() * reciprocal(s)))
    return q.clamp(QMIN, QMAX).to(torch.int8)


def int4_quantize_reference(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (weight_packed int32 [N, K // 8], weight_scale [N, K // group_size] ``scale_dtype``)."""
    scale = int4_group_scales(w, group_size, scale_dtype)
    return int4_pack_reference(int4_codes(w, scale, group_size)), scale


def int4_dequantize_reference(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(int32 [N, K // 8], scale [N, K // group_size]) -> [N, K] ``out_dtype``."""
    q = int4_unpack_reference(packed).float()
    return (q * scale.float().repeat_interleave(group_size, dim=1)).to(out_dtype)
