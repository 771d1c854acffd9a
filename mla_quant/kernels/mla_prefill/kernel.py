"""Triton flash-attention kernel for MLA prefill in the expanded form (ragged batch, causal over a cached
prefix). One program per (query block, head, sequence); bf16 dots, fp32 online-softmax state, exp2.

d_qk need not be a power of two (Kimi 192 = 128 + 64, GLM 256): q·k is split into a power-of-two head part
D1 and a remainder D2 (padded to a power of two, masked), so no lanes are wasted on 192.
"""
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend_block_range(acc, m_i, l_i, q1, q2, k_base, v_base, stride_kt, stride_vt, n_lo, n_hi, offs_m,
                        kv_len, prefix, qk_scale, d1, d2, d2_ok, dv, dv_ok,
                        BLOCK_N: tl.constexpr, HAS_D2: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, dot_ty: tl.constexpr):
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        k_rows = k_base + offs_n.to(tl.int64) * stride_kt
        k1 = tl.load(k_rows[:, None] + d1[None, :], mask=n_ok[:, None], other=0.0).to(dot_ty)
        s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        if HAS_D2:
            k2 = tl.load(k_rows[:, None] + d2[None, :], mask=n_ok[:, None] & d2_ok[None, :], other=0.0).to(dot_ty)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        s = s * qk_scale
        if MASK:  # the last blocks: the sequence end and, when causal, the diagonal
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= prefix + offs_m[:, None])
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vt + dv[None, :],
                     mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(dot_ty)
        acc = tl.dot(p.to(dot_ty), vt, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _mla_prefill_kernel(
    q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_kv_ptr, out_ptr, lse_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, H,
    D1: tl.constexpr, D2: tl.constexpr, D2P: tl.constexpr, DV: tl.constexpr, DVP: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    kv_start = tl.load(cu_kv_ptr + b)
    kv_len = tl.load(cu_kv_ptr + b + 1) - kv_start
    prefix = kv_len - q_len  # cached tokens before this chunk
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    HAS_D2: tl.constexpr = D2 > 0
    d1 = tl.arange(0, D1)
    d2 = D1 + tl.arange(0, D2P)
    d2_ok = d2 < D1 + D2
    dv = tl.arange(0, DVP)
    dv_ok = dv < DV
    dot_ty = q_ptr.dtype.element_ty
    if INTERPRET:  # the interpreter's bf16 dot is wrong: run the dots in fp32
        dot_ty = tl.float32

    q_rows = q_ptr + (q_start + offs_m).to(tl.int64) * stride_qt + h * stride_qh
    q1 = tl.load(q_rows[:, None] + d1[None, :], mask=m_ok[:, None], other=0.0).to(dot_ty)
    if HAS_D2:
        q2 = tl.load(q_rows[:, None] + d2[None, :], mask=m_ok[:, None] & d2_ok[None, :], other=0.0).to(dot_ty)
    else:
        q2 = q1
    k_base = k_ptr + kv_start.to(tl.int64) * stride_kt + h * stride_kh
    v_base = v_ptr + kv_start.to(tl.int64) * stride_vt + h * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DVP], tl.float32)
    block_lo = pid_m * BLOCK_M
    if block_lo < q_len:  # programs past a short sequence's end do nothing
        if CAUSAL:
            # keys every row of the block sees (no mask needed), then the diagonal blocks
            full_hi = tl.minimum(prefix + block_lo + 1, kv_len) // BLOCK_N * BLOCK_N
            diag_hi = tl.minimum(prefix + block_lo + BLOCK_M, kv_len)
        else:
            full_hi = kv_len // BLOCK_N * BLOCK_N
            diag_hi = kv_len
        acc, m_i, l_i = _attend_block_range(acc, m_i, l_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                                            0, full_hi, offs_m, kv_len, prefix, qk_scale, d1, d2, d2_ok, dv,
                                            dv_ok, BLOCK_N, HAS_D2, False, CAUSAL, DOT_PRECISION, dot_ty)
        acc, m_i, l_i = _attend_block_range(acc, m_i, l_i, q1, q2, k_base, v_base, stride_kt, stride_vt,
                                            full_hi, diag_hi, offs_m, kv_len, prefix, qk_scale, d1, d2, d2_ok,
                                            dv, dv_ok, BLOCK_N, HAS_D2, True, CAUSAL, DOT_PRECISION, dot_ty)
    empty = l_i == 0.0
    l_use = tl.where(empty, 1.0, l_i)
    o = acc / l_use[:, None]
    rows = (q_start + offs_m).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & dv_ok[None, :])
    tl.store(lse_ptr + rows * H + h, tl.where(empty, float("-inf"), (m_i + tl.log2(l_use)) * LN2), mask=m_ok)


# Autotuner candidates (BLOCK_M, BLOCK_N, warps, stages), checked for sm_90 ahead of time: all compile to wgmma
# with async copies; spill-free for d_qk/d_v 192/128 (Kimi) and, except the last two, 256/256 (GLM).
PREFILL_CONFIGS = [(128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2), (128, 32, 8, 3)]
_mla_prefill_kernel_tuned = triton.autotune(
    [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in PREFILL_CONFIGS],
    key=["D1", "D2", "DV", "CAUSAL"],
)(_mla_prefill_kernel)
