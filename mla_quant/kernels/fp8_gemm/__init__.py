"""Block-scaled FP8 GEMM (W8A8, the prefill path of FP8 checkpoints): e4m3 activations with per-token 1×bk
scales (from ``fp8_quant.act_quant_fp8``) times e4m3 weights with bn×bk block scales (``weight_scale_inv``),
fp32 accumulation per scale block, bf16 out. Reference in ``reference.py``, kernel in ``kernel.py``."""
from __future__ import annotations

import torch
import triton

from .._backend import triton_interpreted, use_triton
from .._checks import check_divisible, check_same_device, check_tensor
from .._gemm_utils import m_bucket
from ..fp8_quant import FP8
from .reference import fp8_gemm_reference

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CONFIG_KEYS = ("BM", "BN", "GROUP_M", "num_warps", "num_stages")

__all__ = ["fp8_gemm", "fp8_gemm_reference", "CONFIG_KEYS"]


def _check(a, a_scale, b, b_scale, block, out_dtype) -> tuple[int, int, int]:
    check_tensor("a", a, dtype=FP8, ndim=2, contiguous=True)
    check_tensor("a_scale", a_scale, dtype=torch.float32, ndim=2, contiguous=True)
    check_tensor("b", b, dtype=FP8, ndim=2)
    check_tensor("b_scale", b_scale, dtype=torch.float32, ndim=2, contiguous=True)
    check_same_device(a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    if b.stride(-1) != 1:
        raise ValueError("b: the last dimension must be contiguous")
    bn, bk = (int(v) for v in block)
    if bn <= 0 or bk < 16 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"block: {block} must be powers of two with bk >= 16")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: {out_dtype} not supported, expected one of {OUT_DTYPES}")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"b: shape {tuple(b.shape)} does not match a {tuple(a.shape)} (K differs)")
    check_divisible("K", k, bk, "the block width bk")
    if tuple(a_scale.shape) != (m, k // bk):
        raise ValueError(f"a_scale: shape {tuple(a_scale.shape)}, expected {(m, k // bk)}")
    if tuple(b_scale.shape) != (triton.cdiv(n, bn), k // bk):
        raise ValueError(f"b_scale: shape {tuple(b_scale.shape)}, expected {(triton.cdiv(n, bn), k // bk)}")
    return m, n, k


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             block: tuple[int, int] = (128, 128), out_dtype: torch.dtype = torch.bfloat16, *,
             out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """C = A @ B.T with per-block scales.

    a: e4m3 [M, K] (contiguous); a_scale: fp32 [M, K/bk] (one scale per token and bk-wide group);
    b: e4m3 [N, K] (last dim contiguous); b_scale: fp32 [⌈N/bn⌉, K/bk]; K % bk == 0.
    Returns C: [M, N] ``out_dtype`` (written into ``out`` if given: contiguous, that shape and dtype).
    ``config`` (keys of ``CONFIG_KEYS``) pins a kernel configuration instead of the autotuned one.
    """
    m, n, k = _check(a, a_scale, b, b_scale, block, out_dtype)
    if out is not None:
        check_tensor("out", out, dtype=out_dtype, ndim=2, contiguous=True)
        check_same_device(a=a, out=out)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {(m, n)}")
    if not use_triton(a, a_scale, b, b_scale):
        c = fp8_gemm_reference(a, a_scale, b, b_scale, block, out_dtype)
        return c if out is None else out.copy_(c)
    from .kernel import _fp8_gemm_kernel, fp8_gemm_autotuned

    c = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return c
    interpreted = triton_interpreted()
    if config is None and interpreted:
        config = {"BM": 32, "BN": 32, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}
    args = (a, a_scale, b, b_scale, c, m, n, k, a.stride(0), b.stride(0), c.stride(0), m_bucket(m))
    common = dict(BN_S=int(block[0]), BK=int(block[1]), INTERPRET=interpreted)

    def grid(meta):
        return (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)

    if config is None:
        fp8_gemm_autotuned[grid](*args, **common)
    else:
        _fp8_gemm_kernel[grid(config)](*args, **common, **config)
    return c
