"""Pure-torch reference of the block-scaled FP8 GEMM (DeepSeek ``fp8_gemm`` / DeepGEMM
``gemm_fp8_fp8_bf16_nt``): activations quantized per token in 1×bk groups, weights in bn×bk blocks.

    C[m, n] = Σ_kb (A[m, kb·bk:(kb+1)·bk] · B[n, kb·bk:(kb+1)·bk]) · a_scale[m, kb] · b_scale[n // bn, kb]

Computed here as (A dequantized) @ (B dequantized).T in fp32 — the same sum, written for clarity.
"""
from __future__ import annotations

import torch

from ..fp8_quant.reference import block_dequant_fp8_reference


def fp8_gemm_reference(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                       block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a: e4m3 [M, K]; a_scale: fp32 [M, K/bk]; b: e4m3 [N, K]; b_scale: fp32 [⌈N/bn⌉, ⌈K/bk⌉].
    Returns C: [M, N] ``out_dtype``."""
    m, k = a.shape
    bk = block[1]
    a_deq = (a.float().reshape(m, k // bk, bk) * a_scale.float()[..., None]).reshape(m, k)
    b_deq = block_dequant_fp8_reference(b, b_scale, block, torch.float32)
    return (a_deq @ b_deq.T).to(out_dtype)
