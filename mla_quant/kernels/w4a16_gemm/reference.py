"""Pure-torch reference of the W4A16 GEMM: y = x @ dequant(W).T with W in compressed-tensors
``pack-quantized`` INT4 groups (layout in ``kernels/int4_quant/reference.py``).

The weight is dequantized exactly as :func:`int4_dequantize_reference` stores it in the activation dtype
(``q · scale`` rounded once), then multiplied in fp32 and rounded to the activation dtype — the math of
``QuantLinear`` holding an ``Int4Group`` weight.
"""
from __future__ import annotations

import torch

from ..int4_quant.reference import int4_dequantize_reference


def w4a16_gemm_reference(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                         group_size: int = 32) -> torch.Tensor:
    """x: [..., K] (bf16/fp16/fp32); weight_packed: int32 [N, K/8]; weight_scale: [N, K/group_size].
    Returns y: [..., N] in x.dtype."""
    w = int4_dequantize_reference(weight_packed, weight_scale, group_size, x.dtype)  # [N, K]
    return (x.float() @ w.float().T).to(x.dtype)
