"""Triton kernels: fused INT4 group quantize + pack, and fused unpack + dequantize (layout of reference.py)."""
import triton
import triton.language as tl

from .._triton_utils import reciprocal

ROUND_MAGIC = tl.constexpr(12582920.0)  # 1.5·2^23 + 8: y + it rounds y to an integer, bits 0x4B400000 + (q + 8)
MAGIC_BITS_WORD = tl.constexpr(1061158912)  # sum of 0x4B400000 << 4j over j < 8, as int32 (mod 2^32)


@triton.jit
def _int4_quant_pack_tile(w_ptr, packed_ptr, scale_ptr, pid_n, pid_k, N, K, stride_wn,
                          GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # Tile [BN, BK] of w -> [BN, BK/8] words and [BN, BK/GROUP] scales (BK is a multiple of GROUP and 8).
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    wg = tl.reshape(w, (BN, BK // GROUP, GROUP))
    s = tl.div_rn(tl.max(tl.abs(wg), axis=2), 7.5)
    s = s.to(scale_ptr.dtype.element_ty).to(tl.float32)  # quantize against the stored (rounded) scale
    r = tl.where(s == 0.0, 0.0, reciprocal(s))  # per group: an all-zero group gets codes 0
    # Clamping before rounding equals clamping after (integer bounds, rounding is monotone). Adding
    # ROUND_MAGIC rounds to an integer (half to even, as torch.round: the constant is even) and leaves the
    # bits 0x4B400000 + (q + 8): no rint / float->int conversion per value. The clamp separates the multiply
    # from the add, so no FMA contraction changes the rounding.
    y = tl.minimum(tl.maximum(wg * r[:, :, None], -8.0), 7.0)
    bits = tl.reshape((y + ROUND_MAGIC).to(tl.int32, bitcast=True), (BN, BK // 8, 8))
    shifts = tl.arange(0, 8) * 4
    # sum_j bits_j << 4j - sum_j 0x4B400000 << 4j == sum_j (q_j + 8) << 4j (mod 2^32): the nibbles, packed
    words = tl.sum(bits << shifts[None, None, :], axis=2) - MAGIC_BITS_WORD
    rw = pid_k * (BK // 8) + tl.arange(0, BK // 8)
    tl.store(packed_ptr + rn[:, None].to(tl.int64) * (K // 8) + rw[None, :], words,
             mask=(rn[:, None] < N) & (rw[None, :] < K // 8))
    rg = pid_k * (BK // GROUP) + tl.arange(0, BK // GROUP)
    tl.store(scale_ptr + rn[:, None].to(tl.int64) * (K // GROUP) + rg[None, :],
             s.to(scale_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rg[None, :] < K // GROUP))


@triton.jit
def _int4_quant_pack_kernel(w_ptr, packed_ptr, scale_ptr, N, K, stride_wn, n_kb, n_tiles,
                            GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                            K_FAST: tl.constexpr):
    # STAGES 0: one tile per program, grid (N tiles, K tiles), or (K tiles, N tiles) with K_FAST (consecutive
    # programs read one BN-row slab end to end). STAGES >= 1: a persistent 1-D grid whose programs stride over
    # the tiles in K-major order, loads pipelined STAGES deep (cp.async).
    if STAGES == 0:
        _int4_quant_pack_tile(w_ptr, packed_ptr, scale_ptr, tl.program_id(1 if K_FAST else 0),
                              tl.program_id(0 if K_FAST else 1), N, K, stride_wn, GROUP, BN, BK)
    else:
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            _int4_quant_pack_tile(w_ptr, packed_ptr, scale_ptr, tile // n_kb, tile % n_kb, N, K, stride_wn,
                                  GROUP, BN, BK)


@triton.jit
def _int4_dequant_kernel(packed_ptr, scale_ptr, out_ptr, N, K,
                         GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_FAST: tl.constexpr):
    # K_FAST: grid axis 0 walks K, so consecutive programs write one BN-row slab of the output end to end
    pid_n = tl.program_id(1 if K_FAST else 0)
    pid_k = tl.program_id(0 if K_FAST else 1)
    rn = pid_n * BN + tl.arange(0, BN)
    rw = pid_k * (BK // 8) + tl.arange(0, BK // 8)
    words = tl.load(packed_ptr + rn[:, None].to(tl.int64) * (K // 8) + rw[None, :],
                    mask=(rn[:, None] < N) & (rw[None, :] < K // 8), other=0)
    shifts = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8
    rg = pid_k * (BK // GROUP) + tl.arange(0, BK // GROUP)
    s = tl.load(scale_ptr + rn[:, None].to(tl.int64) * (K // GROUP) + rg[None, :],
                mask=(rn[:, None] < N) & (rg[None, :] < K // GROUP), other=0.0).to(tl.float32)
    w = tl.reshape(q.to(tl.float32), (BN, BK // GROUP, GROUP)) * s[:, :, None]
    rk = pid_k * BK + tl.arange(0, BK)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
             tl.reshape(w, (BN, BK)).to(out_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))
