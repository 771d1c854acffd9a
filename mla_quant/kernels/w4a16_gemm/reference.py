"""Pure-torch reference of the W4A16 GEMM: y = x @ dequant(W).T with W in compressed-tensors
``pack-quantized`` INT4 groups (layout in ``kernels/int4_quant/reference.py``).

The weight is dequantized exactly as :func:`int4_dequantize_reference` stores it in the activation dtype
(``q · scale`` rounded once), then multiplied in fp32 and rounded to the activation dtype — the math of
``QuantLinear`` holding an ``Int4Group`` weight.
"""
from __future__ import annotations

import torch

from .._half2_gemv import pair_values, swiglu_reference
from ..int4_quant.reference import int4_dequantize_reference


def w4a16_gemm_reference(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                         group_size: int = 32) -> torch.Tensor:
    """x: [..., K] (bf16/fp16/fp32); weight_packed: int32 [N, K/8]; weight_scale: [N, K/group_size].
    Returns y: [..., N] in x.dtype."""
    w = int4_dequantize_reference(weight_packed, weight_scale, group_size, x.dtype)  # [N, K]
    return (x.float() @ w.float().T).to(x.dtype)


def w4a16_gemv_pairs_reference(pairs: torch.Tensor, pair_scales: torch.Tensor, weight_packed: torch.Tensor,
                               weight_scale: torch.Tensor, group_size: int = 32, *,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The GEMV on one activation row in pair order: pairs int32 [1, plane_width(K) / 2], pair_scales fp32
    [1, plane_width(K) / 32] (``swiglu_pair_order`` / ``_half2_gemv.pair_order``), the weight as in
    :func:`w4a16_gemm_reference`. The values the pairs hold (fp16 lanes times their run's power of two) times the
    weight dequantized in ``dtype``, summed in fp32. Returns y: [1, N] in ``dtype``."""
    x = pair_values(pairs, pair_scales, 8 * weight_packed.shape[1])
    w = int4_dequantize_reference(weight_packed, weight_scale, group_size, dtype)
    return (x @ w.float().T).to(dtype)


def w4a16_swiglu_gemv_reference(x: torch.Tensor, gate_packed: torch.Tensor, gate_scale: torch.Tensor,
                                up_packed: torch.Tensor, up_scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """A SwiGLU MLP's h for one token: x [1, K] bf16 / fp16; gate and up weights as in :func:`w4a16_gemm_reference`
    ([I, K/8] / [I, K/group_size]). gate · x and up · x in fp32 (the weights dequantized in x's dtype), h =
    silu(gate) · up rounded once to x's dtype. Returns h: [1, I]."""
    g = x.float() @ int4_dequantize_reference(gate_packed, gate_scale, group_size, x.dtype).float().T
    u = x.float() @ int4_dequantize_reference(up_packed, up_scale, group_size, x.dtype).float().T
    return swiglu_reference(g, u).to(x.dtype)  # fp32 h, rounded once
