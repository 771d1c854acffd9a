"""Triton kernels for FP8 (e4m3) quantization. Math and rounding match ``reference.py`` bit for bit."""
import triton
import triton.language as tl

from .._triton_utils import cast_fp8_saturating, finite_abs, fp8_scale, reciprocal


@triton.jit
def _act_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, n_groups,
                          GROUP: tl.constexpr, UE8M0: tl.constexpr, BLOCK_G: tl.constexpr):
    # x viewed as [n_groups, GROUP]; each program quantizes BLOCK_G consecutive groups.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, GROUP)
    mask = rows[:, None] < n_groups
    offs = rows[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(finite_abs(x), axis=1), UE8M0)
    q = cast_fp8_saturating(x * reciprocal(s)[:, None])
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows, s, mask=rows < n_groups)


@triton.jit
def _block_quant_fp8_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qn, n_kb,
                            BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(tl.max(finite_abs(w), axis=1), axis=0), False)
    q = cast_fp8_saturating(w * reciprocal(s))
    tl.store(q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :], q, mask=mask)
    tl.store(s_ptr + pid_n * n_kb + pid_k, s)


@triton.jit
def _block_dequant_fp8_kernel(q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_on, n_kb,
                              BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    q = tl.load(q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + pid_n * n_kb + pid_k)
    w = q.to(tl.float32) * s
    tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, T, D, PER_TOKEN: tl.constexpr,
                         BLOCK_T: tl.constexpr, D_HEAD: tl.constexpr, D_TAIL: tl.constexpr):
    # A row of D values is read as a power-of-two head [0, D_HEAD) and a masked tail [D_HEAD, D)
    # (576 = 512 + 64 for MLA rows), so no lanes are wasted on padding to 1024.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.arange(0, D_HEAD)
    ct = D_HEAD + tl.arange(0, D_TAIL)
    m_h = (rows[:, None] < T) & (ch[None, :] < D)
    m_t = (rows[:, None] < T) & (ct[None, :] < D)
    xh = tl.load(x_ptr + rows[:, None] * D + ch[None, :], mask=m_h, other=0.0).to(tl.float32)
    xt = tl.load(x_ptr + rows[:, None] * D + ct[None, :], mask=m_t, other=0.0).to(tl.float32)
    if PER_TOKEN:
        s = fp8_scale(tl.maximum(tl.max(finite_abs(xh), axis=1), tl.max(finite_abs(xt), axis=1)), False)
        tl.store(s_ptr + rows, s, mask=rows < T)
        r = reciprocal(s)[:, None]
    else:
        r = reciprocal(tl.load(s_ptr))
    tl.store(q_ptr + rows[:, None] * D + ch[None, :], cast_fp8_saturating(xh * r), mask=m_h)
    tl.store(q_ptr + rows[:, None] * D + ct[None, :], cast_fp8_saturating(xt * r), mask=m_t)
