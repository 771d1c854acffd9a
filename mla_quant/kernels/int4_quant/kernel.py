"""Triton kernels: fused INT4 group quantize + pack, and fused unpack + dequantize (layout of reference.py)."""
import triton
import triton.language as tl

from .._triton_utils import reciprocal, rint


@triton.jit
def _int4_quant_pack_kernel(w_ptr, packed_ptr, scale_ptr, N, K, stride_wn,
                            GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Tile [BN, BK] of w -> [BN, BK/8] words and [BN, BK/GROUP] scales (BK is a multiple of GROUP and 8).
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    wg = tl.reshape(w, (BN, BK // GROUP, GROUP))
    s = tl.div_rn(tl.max(tl.abs(wg), axis=2), 7.5)
    s = s.to(scale_ptr.dtype.element_ty).to(tl.float32)  # quantize against the stored (rounded) scale
    q = tl.where(s[:, :, None] == 0.0, 0.0, rint(wg * reciprocal(s)[:, :, None]))
    q = tl.minimum(tl.maximum(q, -8.0), 7.0)
    nib = tl.reshape((q + 8.0).to(tl.int32), (BN, BK // 8, 8))
    shifts = tl.arange(0, 8) * 4
    words = tl.sum(nib << shifts[None, None, :], axis=2)  # disjoint bits, so the sum is an OR
    rw = tl.program_id(1) * (BK // 8) + tl.arange(0, BK // 8)
    tl.store(packed_ptr + rn[:, None].to(tl.int64) * (K // 8) + rw[None, :], words,
             mask=(rn[:, None] < N) & (rw[None, :] < K // 8))
    rg = tl.program_id(1) * (BK // GROUP) + tl.arange(0, BK // GROUP)
    tl.store(scale_ptr + rn[:, None].to(tl.int64) * (K // GROUP) + rg[None, :],
             s.to(scale_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rg[None, :] < K // GROUP))


@triton.jit
def _int4_dequant_kernel(packed_ptr, scale_ptr, out_ptr, N, K,
                         GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rw = tl.program_id(1) * (BK // 8) + tl.arange(0, BK // 8)
    words = tl.load(packed_ptr + rn[:, None].to(tl.int64) * (K // 8) + rw[None, :],
                    mask=(rn[:, None] < N) & (rw[None, :] < K // 8), other=0)
    shifts = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8
    rg = tl.program_id(1) * (BK // GROUP) + tl.arange(0, BK // GROUP)
    s = tl.load(scale_ptr + rn[:, None].to(tl.int64) * (K // GROUP) + rg[None, :],
                mask=(rn[:, None] < N) & (rg[None, :] < K // GROUP), other=0.0).to(tl.float32)
    w = tl.reshape(q.to(tl.float32), (BN, BK // GROUP, GROUP)) * s[:, :, None]
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
             tl.reshape(w, (BN, BK)).to(out_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))
