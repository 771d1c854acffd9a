"""Triton kernels for FP8 (e4m3) quantization. Math and rounding match ``reference.py`` bit for bit.

Memory-bound on the GPU, so the per-element work is kept to a few instructions (static sm_90 SASS):
- the amax is a plain ``max |x|`` (one FMNMX with an |x| operand; ``max.f32`` already drops NaN). Only when a
  program meets a non-finite amax (±inf, or NaN in the interpreter, whose reductions propagate it) does it
  recompute the amax over the finite values (``finite_abs``), a branch taken by no program on finite data;
- the e4m3 cast is ``cvt.rn.satfinite`` on the GPU, which saturates to ±448 and keeps NaN by itself; the
  interpreter's cast does not saturate, so it clamps first (``cast_fp8_saturating``);
- values are multiplied by the scale's reciprocal, rounded once per group / row / block.
"""
import triton
import triton.language as tl

from .._triton_utils import FP32_MAX, INTERPRETED, cast_fp8_saturating, finite_abs, fp8_scale, reciprocal


@triton.jit
def to_e4m3(y):
    """fp32 -> e4m3, saturating to ±448, NaN kept (as ``cast_fp8_saturating``)."""
    if INTERPRETED:
        return cast_fp8_saturating(y)
    else:
        return y.to(tl.float8e4nv)  # cvt.rn.satfinite.e4m3x2.f32


@triton.jit
def all_finite(amax):
    """True when every entry of the 1-D ``amax`` is finite (a scalar per program, for a branch)."""
    return tl.min((amax <= FP32_MAX).to(tl.int32), axis=0) != 0


@triton.jit
def row_amax(x):
    """[R, C] fp32 -> [R]: max |x| over each row's finite values (NaN and ±inf take no part)."""
    amax = tl.max(tl.abs(x), axis=1)
    if not all_finite(amax):
        amax = tl.max(finite_abs(x), axis=1)
    return amax


@triton.jit
def _act_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, n_groups,
                          GROUP: tl.constexpr, UE8M0: tl.constexpr, BLOCK_G: tl.constexpr):
    # x viewed as [n_groups, GROUP]; each program quantizes BLOCK_G consecutive groups.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, GROUP)
    mask = rows[:, None] < n_groups
    offs = rows[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = fp8_scale(row_amax(x), UE8M0)
    tl.store(q_ptr + offs, to_e4m3(x * reciprocal(s)[:, None]), mask=mask)
    tl.store(s_ptr + rows, s, mask=rows < n_groups)


@triton.jit
def _block_quant_tile(w_ptr, q_ptr, s_ptr, pid_n, pid_k, N, K, stride_wn, stride_qn, n_kb,
                      BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    # One BN×BK block, loaded once and kept in registers (amax, then quantize). EVEN: N % BN == K % BK == 0.
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    q_ptrs = q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :]
    if EVEN:
        w = tl.load(w_ptrs).to(tl.float32)
    else:
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    if not (amax <= FP32_MAX):
        amax = tl.max(tl.max(finite_abs(w), axis=1), axis=0)
    s = fp8_scale(amax, False)
    q = to_e4m3(w * reciprocal(s))
    if EVEN:
        tl.store(q_ptrs, q)
    else:
        tl.store(q_ptrs, q, mask=mask)
    tl.store(s_ptr + pid_n * n_kb + pid_k, s)


@triton.jit
def _block_quant_fp8_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qn, n_kb, n_blocks,
                            BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, K_FAST: tl.constexpr,
                            STAGES: tl.constexpr):
    # STAGES 0: one block per program; grid (N blocks, K blocks), or (K blocks, N blocks) with K_FAST
    # (consecutive programs walk along K: adjacent bytes of the same rows). STAGES >= 1: a persistent 1-D grid
    # whose programs stride over the blocks in K-major order, loads pipelined STAGES deep (cp.async).
    if STAGES == 0:
        if K_FAST:
            pid_k, pid_n = tl.program_id(0), tl.program_id(1)
        else:
            pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        _block_quant_tile(w_ptr, q_ptr, s_ptr, pid_n, pid_k, N, K, stride_wn, stride_qn, n_kb, BN, BK, EVEN)
    else:
        for blk in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=STAGES):
            _block_quant_tile(w_ptr, q_ptr, s_ptr, blk // n_kb, blk % n_kb, N, K, stride_wn, stride_qn, n_kb,
                              BN, BK, EVEN)


@triton.jit
def _block_dequant_fp8_kernel(q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_on, n_kb,
                              BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr, K_FAST: tl.constexpr):
    if K_FAST:
        pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    else:
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    q_ptrs = q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :]
    o_ptrs = out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :]
    s = tl.load(s_ptr + pid_n * n_kb + pid_k)
    if EVEN:
        w = tl.load(q_ptrs).to(tl.float32) * s
        tl.store(o_ptrs, w.to(out_ptr.dtype.element_ty))
    else:
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = tl.load(q_ptrs, mask=mask, other=0.0).to(tl.float32) * s
        tl.store(o_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_quant_tile(x_ptr, q_ptr, s_ptr, tile, T, D: tl.constexpr, PER_TOKEN: tl.constexpr,
                   BLOCK_T: tl.constexpr, D_HEAD: tl.constexpr, D_TAIL: tl.constexpr):
    # BLOCK_T rows of D values each, read as a power-of-two head [0, D_HEAD) and a tail [D_HEAD, D) padded to
    # D_TAIL (576 = 512 + 64 for MLA rows: no lanes spent on padding to 1024, no column mask). Triton meets the
    # two layouts by passing the bf16 head through shared memory once (static sm_90 SASS: ~10 instructions per
    # value, against ~18 for one [BLOCK_T, 1024] padded tile).
    HAS_TAIL: tl.constexpr = D > D_HEAD
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)  # tile: a Python int when interpreted
    ok = (rows < T)[:, None]
    ch = tl.arange(0, D_HEAD)
    xh = tl.load(x_ptr + rows[:, None] * D + ch[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_TAIL:
        ct = D_HEAD + tl.arange(0, D_TAIL)
        if D_HEAD + D_TAIL == D:
            m_t = ok
        else:
            m_t = ok & (ct < D)[None, :]
        xt = tl.load(x_ptr + rows[:, None] * D + ct[None, :], mask=m_t, other=0.0).to(tl.float32)
    if PER_TOKEN:
        amax = tl.max(tl.abs(xh), axis=1)
        if HAS_TAIL:
            amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=1))
        if not all_finite(amax):  # an inf (or, interpreted, a NaN) somewhere: the finite values only
            amax = tl.max(finite_abs(xh), axis=1)
            if HAS_TAIL:
                amax = tl.maximum(amax, tl.max(finite_abs(xt), axis=1))
        s = fp8_scale(amax, False)
        tl.store(s_ptr + rows, s, mask=rows < T)
        r = reciprocal(s)[:, None]
    else:
        r = reciprocal(tl.load(s_ptr))
    tl.store(q_ptr + rows[:, None] * D + ch[None, :], to_e4m3(xh * r), mask=ok)
    if HAS_TAIL:
        tl.store(q_ptr + rows[:, None] * D + ct[None, :], to_e4m3(xt * r), mask=m_t)


@triton.jit
def _kv_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, T, D: tl.constexpr, PER_TOKEN: tl.constexpr,
                         BLOCK_T: tl.constexpr, D_HEAD: tl.constexpr, D_TAIL: tl.constexpr, STAGES: tl.constexpr):
    # STAGES 0: one tile per program. STAGES >= 1: a persistent grid; each program strides over the tiles with
    # the next tiles' loads issued STAGES - 1 iterations ahead (software pipelining: bytes in flight without
    # the registers of more resident programs).
    if STAGES == 0:
        _kv_quant_tile(x_ptr, q_ptr, s_ptr, tl.program_id(0), T, D, PER_TOKEN, BLOCK_T, D_HEAD, D_TAIL)
    else:
        for tile in tl.range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0), num_stages=STAGES):
            _kv_quant_tile(x_ptr, q_ptr, s_ptr, tile, T, D, PER_TOKEN, BLOCK_T, D_HEAD, D_TAIL)
