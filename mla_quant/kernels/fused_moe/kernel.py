"""Triton kernels of the fused MoE experts (math in ``reference.py``, layout in docs/moe.md).

``_moe_gemm_kernel`` is one grouped GEMM over the blocks that ``moe_align`` made: program (m, n) takes
block m (``BLOCK_M`` assignments of one expert, padding rows masked) and output columns n·BLOCK_N...,
loops over K, and multiplies in one of three weight formats (``KIND``):

* ``KIND_DENSE``: bf16/fp16/fp32 weights as stored.
* ``KIND_FP8``: e4m3 weights with 128×128 block scales; either dequantized in registers (weight-only) or,
  with ``W8A8``, multiplied as e4m3 × e4m3 against activations quantized per token in 1×128 groups, the
  two scales applied to each K block's fp32 partial product (DeepSeek's ``fp8_gemm``).
* ``KIND_INT4``: compressed-tensors int32 words, eight nibbles each. A [BN, BK/8] tile of words is
  unpacked in registers: ``nibble | 0x4B000000`` read as fp32 is 2^23 + nibble, so subtracting 2^23 + 8
  gives the code ``q`` exactly without an int→float conversion; ``q × group scale`` in fp32, then the
  tile goes to the tensor cores in the activation dtype.

A group-scaled INT4 tile (``FAST_DEQUANT``: codes from 16-bit lanes, the group scale on each group's fp32
partial) was measured on the H200 at 0.40-0.61x the plane tile above 16 tokens and equal to the default GEMV
below; it was removed (session 4). ``w4a16_gemm`` keeps its own (faster there at 2-16 tokens).
A GEMV on the tensor cores (the expert's rows as the A operand in biased bf16 codes, the activation spread into
one B column per group; 1.6-2.5 SASS instructions per weight against 3.7-3.9 here) took 132.6 µs against 73.5 at
one Kimi token on the H200 (session 10: Triton routes each plane's B operand through shared memory, two barriers
per plane); it was removed. docs/moe.md "Where the INT4 GEMV time goes (measured)".

``PLANES`` (INT4, ``BLOCK_M == 1``, ``fused_moe(..., gemv="prefetch")`` (the default for fp32 x) or ``"planes"``)
runs the plane GEMV (``_int4_plane_gemv``, the core shared with ``w4a16_gemm`` in ``_gemm_utils``): the activations
arrive as fp32 nibble planes (``plane_order``) and the gate-up epilogue writes ``h`` in that order; ``PREFETCH``
adds a register double buffer of the next K block's words (also to the half2 GEMV, ``HALF2``).

``PLANE_TILE`` (INT4, ``BLOCK_M > 1``, ``fused_moe(..., int4_tile="planes")``, the default) is the plane
form of the tensor-core tile (``_int4_plane_tile_step``): the words stay in their [BLOCK_K/8, BLOCK_N] load
layout, the activations arrive as unscaled nibble planes in their own dtype (``plane_order(..., scaled=False)``;
the gate-up epilogue writes ``h`` so), and each plane i is one ``tl.dot(a_plane_i, codes_i · scale)``.

With ``GATED`` the program holds two accumulators (gate and up rows of the same columns) and its
epilogue writes ``silu(gate) * up`` (the SwiGLU of the expert) in the activation dtype; otherwise (the
down projection) it multiplies each row by its routing weight and writes fp32. ``_moe_combine_kernel``
then sums each token's k rows in a fixed order (deterministic), adds the shared experts' output if given,
and rounds once.

``DIRECT`` (``BLOCK_M == 1``, ``fused_moe(..., decode_fusion=True)``, the default) drops both the alignment and
the combine launch: program m takes assignment m (row m // k of x, expert ``topk_ids.flat[m]``; ids outside
[0, E) computed by nobody, as ``moe_align`` drops them). The gate-up launch zeroes one arrival counter per
(token, column tile of the down projection) (``COUNTERS`` per program); in the down launch each program writes
its weighted fp32 row to ``y`` and arrives at its token's counter (a dropped slot arrives with a zero row), and the
last of the token's k to arrive sums the k rows in slot order, adds the shared output and rounds once
(``_combine_on_arrival`` on ``_gemm_utils.reduce_arrivals``, the split-K store's scheme): the same rows and the
same sum as the combine kernel.
"""
from functools import partial

import triton
import triton.language as tl

from .._gemm_utils import (PLANE_WORDS, _load_in_place, autotune_bench, four_words, int4_codes, int4_plane_gemv_step,
                           load_k, plane_offsets, plane_scale, reduce_arrivals)
from .._half2_gemv import PAIR_BLOCK, f16_pairs, inline_pairs, load_pairs, pair_offsets, run_dot, run_exponent
from .._triton_utils import grid_dependency_sync

KIND_DENSE, KIND_FP8, KIND_INT4 = 0, 1, 2


@triton.jit
def _load(ptrs, ok, k_ok, EVEN_K: tl.constexpr):
    """``ptrs`` masked by ``ok`` (rows / columns of N) and, unless every K block is whole (``EVEN_K``: K % BLOCK_K
    == 0), by ``k_ok``; masked elements read 0. Without the K mask the loads vectorise fully (LDG.E.128)."""
    if EVEN_K:
        return tl.load(ptrs, mask=ok, other=0.0)
    return tl.load(ptrs, mask=ok & k_ok, other=0.0)  # 0.0: also for e4m3 (an int constant does not cast to it)


@triton.jit
def _weight_tile(w_ptr, s_ptr, rn, k0, N, K, stride_wn, stride_sn,
                 KIND: tl.constexpr, W8A8: tl.constexpr, GROUP: tl.constexpr, SBN: tl.constexpr,
                 SBK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Rows ``rn`` ([BLOCK_N]) and columns k0..k0+BLOCK_K of one expert's [N, K] weight: fp32 values,
    or the raw tile for KIND_DENSE and for W8A8 (whose scales the caller applies after the dot)."""
    n_ok = rn < N
    if KIND == 2:
        rw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = _load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rw[None, :], n_ok[:, None],
                      (rw < K // 8)[None, :], EVEN_K)
        shifts = tl.arange(0, 8) * 4
        nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF
        q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # (2^23 + nib) - (2^23 + 8)
        rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s = _load(s_ptr + rn[:, None].to(tl.int64) * stride_sn + rg[None, :], n_ok[:, None],
                  (rg < K // GROUP)[None, :], EVEN_K).to(tl.float32)
        w = tl.reshape(tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None], (BLOCK_N, BLOCK_K))
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        w = _load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], n_ok[:, None], (rk < K)[None, :],
                  EVEN_K)
        if KIND == 1:
            if not W8A8:
                s = _load(s_ptr + (rn // SBN)[:, None].to(tl.int64) * stride_sn + (rk // SBK)[None, :],
                          n_ok[:, None], (rk < K)[None, :], EVEN_K)
                w = w.to(tl.float32) * s
    return w


@triton.jit
def _mma(a, w, acc, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ w.T for a [M, K] and w [N, K] (fp32 operands under the interpreter: its bf16/fp8 dot is wrong)."""
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    elif IEEE:
        out = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(w), acc)
    return out


@triton.jit
def _int4_plane_gemv(a_ptr, a_row, w1_ptr, s1_ptr, w3_ptr, s3_ptr, rn, N, K, stride_at, stride_wn, stride_sn,
                     GATED: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr):
    """The INT4 GEMV of one assignment (``a_row`` [1]: its row of ``a``, fp32 nibble planes from
    ``_gemm_utils.plane_order``; BLOCK_K a multiple of PLANE_BLOCK_K) against rows ``rn`` of one expert's
    words: fp32 [1, BLOCK_N] sums (gate, and up when GATED). Words load in their [BLOCK_K/8, BLOCK_N] layout,
    the plane vectors in the same layout (``int4_plane_gemv_step``), each run of 4 words (32 K) is scaled
    once; rows past N re-read row N - 1 (never stored). PREFETCH: the next K block's words are loaded before
    this block's products (a register double buffer: twice the word bytes in flight per thread)."""
    rows = tl.minimum(rn, N - 1).to(tl.int64)[None, :]
    rw = tl.arange(0, BLOCK_K // 8)[:, None]  # the tile is [BLOCK_K/8, BLOCK_N]: see int4_plane_dot
    rr = tl.arange(0, BLOCK_K // 32)[:, None]  # runs of 4 words (32 K), one scale each
    w1_ptrs = w1_ptr + rows * stride_wn + rw
    w3_ptrs = w3_ptr + rows * stride_wn + rw
    s1_ptrs = s1_ptr + rows * stride_sn + 32 * rr // GROUP
    s3_ptrs = s3_ptr + rows * stride_sn + 32 * rr // GROUP
    a_ptrs = a_ptr + a_row[None, :] * stride_at + plane_offsets(rw)  # [BLOCK_K/8, 1]: plane 0, first K block
    acc1 = tl.zeros((BLOCK_K // 32, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_K // 32, BLOCK_N), dtype=tl.float32)
    k_words = tl.multiple_of(K // 8, GROUP // 8)  # K % GROUP == 0: masks constant over 4 words (LDG.E.128)
    if PREFETCH:  # the first K block's words
        next1 = tl.load(w1_ptrs, mask=rw < k_words, other=0)
        if GATED:
            next3 = tl.load(w3_ptrs, mask=rw < k_words, other=0)
    for k0 in range(0, K, BLOCK_K):
        w_ok = k0 // 8 + rw < K // 8
        r_ok = k0 // 32 + rr < K // 32
        if PREFETCH:  # take this block's words, start loading the next block's (none past K)
            next_ok = k0 // 8 + BLOCK_K // 8 + rw < k_words
            words1 = next1
            next1 = tl.load(w1_ptrs + BLOCK_K // 8, mask=next_ok, other=0)
            if GATED:
                words3 = next3
                next3 = tl.load(w3_ptrs + BLOCK_K // 8, mask=next_ok, other=0)
        else:
            words1 = load_k(w1_ptrs, w_ok, EVEN_K)
            if GATED:
                words3 = load_k(w3_ptrs, w_ok, EVEN_K)
        acc1 += int4_plane_gemv_step(words1, s1_ptrs, a_ptrs, w_ok, r_ok, EVEN_K, INTERPRET)
        if GATED:
            acc3 += int4_plane_gemv_step(words3, s3_ptrs, a_ptrs, w_ok, r_ok, EVEN_K, INTERPRET)
        w1_ptrs += BLOCK_K // 8
        w3_ptrs += BLOCK_K // 8
        s1_ptrs += BLOCK_K // GROUP
        s3_ptrs += BLOCK_K // GROUP
        a_ptrs += BLOCK_K  # BLOCK_K % 256 == 0: whole plane blocks
    return tl.reshape(tl.sum(acc1, axis=0), (1, BLOCK_N)), tl.reshape(tl.sum(acc3, axis=0), (1, BLOCK_N))


@triton.jit
def _int4_half2_gemv(a_ptr, as_ptr, a_row, w1_ptr, s1_ptr, w3_ptr, s3_ptr, n0, N, K, stride_at, stride_ast,
                     stride_wn, stride_sn, GATED: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr,
                     ROWS: tl.constexpr = False, WAIT: tl.constexpr = 0, STREAM: tl.constexpr = False,
                     INLINE_X: tl.constexpr = False):
    """The half2 GEMV of one assignment (``HALF2``; ``a_row``: its row of ``a``, pairs from
    ``_half2_gemv.pair_order``, run scales at ``as_ptr``) against columns n0..n0+BLOCK_N of one expert: fp32
    [1, BLOCK_N] sums (gate, and up when GATED). Tiles are [BLOCK_K/32, BLOCK_N/2] runs (4 words each), the even
    and odd columns in two tiles that share each run's 16 activation pairs; each run is one inline-PTX block of
    fp16x2 arithmetic (``_half2_gemv.run_dot``) scaled by group scale × activation run scale in fp32. Columns past
    N re-read column N - 1 and runs past K (unless EVEN_K) the first run, zeroed (never stored). PREFETCH: the next
    K block's words are loaded before this block's arithmetic (a register double buffer; past K the last run is
    read again). ROWS: the tiles are [BLOCK_N/2, BLOCK_K/32] instead, so a warp's lanes take consecutive runs of
    one weight row (coalesced 16-byte word loads) rather than the columns of one run. WAIT (a PDL mode, with
    PREFETCH): the PDL wait comes after the first K block's words are loaded, before any activation is read.
    STREAM: the weights' words and scales are loaded without L1 lines (read once; see gemv_half2.STREAM_WEIGHTS).
    INLINE_X: ``a_ptr`` is the activation row itself (bf16 / fp16, 16-byte aligned rows), put in pair order here, once
    per run for all the tile's columns (``_half2_gemv.inline_pairs``: the bits ``pair_order`` writes)."""
    if ROWS:
        r1 = tl.arange(0, BLOCK_K // 32)[None, :]  # the tile's runs, broadcast over its columns
        rr = r1 + tl.zeros((BLOCK_N // 2, 1), dtype=tl.int32)  # full tile shape
        c = n0 + 2 * tl.arange(0, BLOCK_N // 2)[:, None]
    else:
        r1 = tl.arange(0, BLOCK_K // 32)[:, None]
        rr = r1 + tl.zeros((1, BLOCK_N // 2), dtype=tl.int32)
        c = n0 + 2 * tl.arange(0, BLOCK_N // 2)[None, :]
    even = tl.minimum(c, N - 1).to(tl.int64) * stride_wn
    odd = tl.minimum(c + 1, N - 1).to(tl.int64) * stride_wn
    even_s = tl.minimum(c, N - 1).to(tl.int64) * stride_sn
    odd_s = tl.minimum(c + 1, N - 1).to(tl.int64) * stride_sn
    a_ptr += a_row * stride_at
    as_ptr += a_row * stride_ast
    acc1e = tl.zeros(rr.shape, dtype=tl.float32)
    acc1o = tl.zeros(rr.shape, dtype=tl.float32)
    acc3e = tl.zeros(rr.shape, dtype=tl.float32)
    acc3o = tl.zeros(rr.shape, dtype=tl.float32)
    if PREFETCH:  # the first K block's words (runs past K: the first run)
        n1e, n1o, n3e, n3o = _column_words(w1_ptr, w3_ptr, even, odd, 4 * tl.where(rr < K // 32, rr, 0), GATED,
                                           INTERPRET, STREAM, WAIT > 0)
    grid_dependency_sync(WAIT)
    for k0 in range(0, K, BLOCK_K):
        run = k0 // 32 + rr
        ok = run < K // 32
        if not EVEN_K:  # runs past K read the first run, zeroed
            run = tl.where(ok, run, 0)
        if INLINE_X:  # once per run of the tile, not per column (runs past K: the first run, as above)
            rx = k0 // 32 + r1
            x = inline_pairs(a_ptr, rx if EVEN_K else tl.where(rx < K // 32, rx, 0), INTERPRET)
            xs = x[16]
        else:
            x = load_pairs(a_ptr + pair_offsets(run), INTERPRET)
            xs = _load_in_place(as_ptr + run, ok, True, INTERPRET, CONSTANT=False)
        w_off, s_off = 4 * run, 32 * run // GROUP
        if PREFETCH:  # this block's words were loaded one block ago; start the next block's
            w1e, w1o, w3e, w3o = n1e, n1o, n3e, n3o
            n1e, n1o, n3e, n3o = _column_words(w1_ptr, w3_ptr, even, odd,
                                               4 * tl.minimum(run + BLOCK_K // 32, K // 32 - 1), GATED, INTERPRET,
                                               STREAM)
        else:
            w1e, w1o, w3e, w3o = _column_words(w1_ptr, w3_ptr, even, odd, w_off, GATED, INTERPRET, STREAM)
        acc1e += _half2_term(w1e, s1_ptr + even_s + s_off, x, xs, ok, EVEN_K, INTERPRET, STREAM)
        acc1o += _half2_term(w1o, s1_ptr + odd_s + s_off, x, xs, ok, EVEN_K, INTERPRET, STREAM)
        if GATED:
            acc3e += _half2_term(w3e, s3_ptr + even_s + s_off, x, xs, ok, EVEN_K, INTERPRET, STREAM)
            acc3o += _half2_term(w3o, s3_ptr + odd_s + s_off, x, xs, ok, EVEN_K, INTERPRET, STREAM)
    RUN_AXIS: tl.constexpr = 1 if ROWS else 0
    return _interleave(acc1e, acc1o, BLOCK_N, RUN_AXIS), _interleave(acc3e, acc3o, BLOCK_N, RUN_AXIS)


@triton.jit
def _column_words(w1_ptr, w3_ptr, even, odd, w_off, GATED: tl.constexpr, INTERPRET: tl.constexpr,
                  STREAM: tl.constexpr = False, EARLY: tl.constexpr = False):
    """The half2 tile's words at word offset ``w_off`` (``four_words`` each): gate even / odd columns, then up even /
    odd (without GATED the gate's again, unread: no load). EARLY: loaded before the PDL wait, so coherently
    (``ld4``'s CONSTANT=False: ptxas moves ``.nc`` loads below the wait)."""
    w1e = four_words(w1_ptr + even + w_off, INTERPRET, STREAM, not EARLY)
    w1o = four_words(w1_ptr + odd + w_off, INTERPRET, STREAM, not EARLY)
    if GATED:
        w3e = four_words(w3_ptr + even + w_off, INTERPRET, STREAM, not EARLY)
        w3o = four_words(w3_ptr + odd + w_off, INTERPRET, STREAM, not EARLY)
    else:
        w3e, w3o = w1e, w1o
    return w1e, w1o, w3e, w3o


@triton.jit
def _half2_term(words, s_ptrs, x, xs, ok, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, STREAM: tl.constexpr = False):
    """Run sums × group scale × activation run scale for one column tile's ``words`` (``four_words``; zero where not
    ``ok`` unless EVEN_K)."""
    term = run_dot(words, x, INTERPRET) * (_load_in_place(s_ptrs, ok, True, INTERPRET, STREAM) * xs)
    if not EVEN_K:
        term = tl.where(ok, term, 0.0)
    return term


@triton.jit
def _interleave(even, odd, BLOCK_N: tl.constexpr, RUN_AXIS: tl.constexpr = 0):
    """Column sums of the even and odd column tiles (runs along ``RUN_AXIS``) -> [1, BLOCK_N] in column order."""
    return tl.reshape(tl.join(tl.sum(even, axis=RUN_AXIS), tl.sum(odd, axis=RUN_AXIS)), (1, BLOCK_N))


@triton.jit
def _bf16_plane_codes(words, I: tl.constexpr):
    """bf16 codes n - 8 of nibble I of each word, two words per instruction (inline PTX, pack=2: the pair of
    words (w0, w1) -> one 32-bit register of two bf16 lanes): PRMT takes the 16-bit halves holding nibble I of
    both words, SHR brings it to bits 0-3 / 16-19, one LOP3 ``(t & 0x000F000F) | 0x43004300`` makes the lanes
    128 + n, one bf16x2 subtraction of 136 gives n - 8 exactly."""
    SEL: tl.constexpr = 0x5410 if I < 4 else 0x7632  # low halves of w0, w1 (nibbles 0-3) or high halves (4-7)
    SH: tl.constexpr = 4 * (I % 4)
    lanes = tl.inline_asm_elementwise(
        f"{{ .reg .b32 t; prmt.b32 t, $1, $2, {SEL}; shr.b32 t, t, {SH}; "
        "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True,
        pack=2)
    return (lanes - 136.0).to(tl.bfloat16)


@triton.jit
def _int4_plane_tile_step(a_ptrs, a_ok, w_ptrs, s_ptrs, w_ok, acc, DT: tl.constexpr, IEEE: tl.constexpr,
                          INTERPRET: tl.constexpr, EVEN_K: tl.constexpr):
    """One K block of the plane tensor-core tile (``PLANE_TILE``) for one weight matrix: ``w_ptrs`` [BK/8, BN]
    the words in their load layout (K along dim 0), ``s_ptrs`` [BK/8, BN] each word's group scale, ``a_ptrs``
    [BLOCK_M, BK/8] plane 0 of the rows' activations in unscaled plane order (``plane_order(..., scaled=False)``,
    plane i at +PLANE_WORDS·i), ``a_ok`` its mask (rows; words past K unless EVEN_K). Per plane i: the codes
    of nibble i as DT from 16-bit lanes (``int4_codes``), times the word's scale (rounded once to DT, as the
    dequantized tile), and one ``tl.dot(a_plane_i, w_i)`` [BLOCK_M, BK/8] x [BK/8, BN]: no [BN, BK] weight
    tile is ever assembled. A group (32 K = 4 words) spans all 8 planes and each dot's K (BK/8 ≥ 16 words)
    spans several groups, so the scale goes on the codes (bf16x2 HADD2 + HMUL2 per pair of weights)."""
    words = load_k(w_ptrs, w_ok, EVEN_K)
    s = load_k(s_ptrs, w_ok, EVEN_K)  # masked words: scale 0, so w_i = 0 (the activation is 0 there too)
    for i in tl.static_range(8):
        if DT == tl.bfloat16 and not INTERPRET:
            q = _bf16_plane_codes(words, i)
        else:
            q = int4_codes((words >> (4 * i)) & 0xF, DT, INTERPRET, False)
        if s.dtype == DT:  # bf16 codes x bf16 scales: q·s is exact before its one rounding
            w = (q * s).to(DT)
        else:
            w = (q.to(tl.float32) * s.to(tl.float32)).to(DT)
        a = tl.load(a_ptrs + i * PLANE_WORDS, mask=a_ok, other=0.0)
        if INTERPRET:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
        elif IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _store_pairs(h, row, row_ok, n0, N, pairs_ptr, stride_p, scales_ptr, stride_s, BLOCK_N: tl.constexpr):
    """Columns n0..n0+BLOCK_N of one h row (fp32 [1, BLOCK_N], already rounded to h's dtype; BLOCK_N whole runs of
    32) stored in pair order (``_half2_gemv`` layout, as its ``_pair_order_kernel`` computes it): each run's power
    of two from its largest magnitude, the 16 scaled fp16 pairs of each pair plane. Runs past N are not stored."""
    R: tl.constexpr = BLOCK_N // 32
    x = tl.reshape(h, (R, 4, 2, 4))  # column 32r + 8u + 4·lane + i as [r, u, lane, i]
    m = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)
    down, up = run_exponent(m)
    pairs = f16_pairs(tl.permute(x * down[:, None, None, None], (0, 3, 1, 2)))  # [r, i, u]
    run = n0 // 32 + tl.arange(0, R)
    pos = (run // 8 * PAIR_BLOCK + run % 8 * 4)[:, None, None] + 32 * tl.arange(0, 4)[None, :, None] \
        + tl.arange(0, 4)[None, None, :]
    ok = run < (N // 32) * row_ok  # row_ok: 1, or 0 for a padding slot of an aligned block (nothing stored)
    tl.store(pairs_ptr + row * stride_p + pos, pairs, mask=ok[:, None, None])
    tl.store(scales_ptr + row * stride_s + run, up, mask=ok)


@triton.jit
def _zero_counters(count_ptr, pid_m, pid_n, num_counters, COUNTERS: tl.constexpr):
    """The gate-up launch's program (m, 0) zeroes counters m·COUNTERS.. of the down launch (DIRECT; COUNTERS 0:
    none)."""
    if COUNTERS > 0:
        if pid_n == 0:
            c = pid_m * COUNTERS + tl.arange(0, COUNTERS)
            tl.store(count_ptr + c, tl.zeros((COUNTERS,), dtype=tl.int32), mask=c < num_counters)


@triton.jit
def _combine_on_arrival(res, pid_m, pid_n, rn, N, y_ptr, stride_yt, count_ptr, res_ptr, stride_rt, shared_ptr,
                        stride_st, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The combine of the direct down GEMV (``DIRECT``, not GATED). ``res`` [1, BLOCK_N]: assignment ``pid_m``'s
    weighted fp32 row at columns ``rn`` (zeros for a dropped id), written to its row of ``y`` [T·k, N]; the last of
    token t = pid_m // TOP_K's TOP_K programs of this column tile to arrive at its counter (one per token and tile)
    sums the token's rows in j order — 0 + y_0 + ... + y_{k-1}, as ``_moe_combine_kernel`` does — adds ``shared``
    and rounds once into ``res_ptr`` [T, N]; then resets the counter (``_gemm_utils.reduce_arrivals``)."""
    t = pid_m // TOP_K
    n_ok = (rn < N)[None, :]
    last, total = reduce_arrivals(res, y_ptr + (t * TOP_K).to(tl.int64) * stride_yt + rn[None, :], stride_yt,
                                  pid_m % TOP_K, n_ok, count_ptr + t * tl.cdiv(N, BLOCK_N) + pid_n, TOP_K)
    if last:
        if HAS_SHARED:
            total += tl.load(shared_ptr + t.to(tl.int64) * stride_st + rn[None, :], mask=n_ok,
                             other=0.0).to(tl.float32)
        tl.store(res_ptr + t.to(tl.int64) * stride_rt + rn[None, :], total.to(res_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_gemm_kernel(
        a_ptr, as_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, out_ptr, topk_w_ptr,
        sorted_ptr, expert_ids_ptr, num_padded_ptr, count_ptr, res_ptr, shared_ptr, hs_ptr,
        A, N, K, a_div, E, num_counters,
        stride_at, stride_ast, stride_we, stride_wn, stride_se, stride_sn, stride_ot, stride_rt, stride_st, stride_hs,
        KIND: tl.constexpr, W8A8: tl.constexpr, GATED: tl.constexpr,
        GROUP: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, ACT_G: tl.constexpr,
        IEEE: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        PLANES: tl.constexpr = False, H_DT: tl.constexpr = tl.float32,
        PREFETCH: tl.constexpr = False, PLANE_TILE: tl.constexpr = False, HALF2: tl.constexpr = False,
        DIRECT: tl.constexpr = False, COUNTERS: tl.constexpr = 0, TOP_K: tl.constexpr = 1,
        HAS_SHARED: tl.constexpr = False, PDL: tl.constexpr = False, HALF2_ROWS: tl.constexpr = False,
        WEIGHTS_FIRST: tl.constexpr = False, PAIRS_OUT: tl.constexpr = False, STREAM: tl.constexpr = False,
        INLINE_X: tl.constexpr = False):
    # a: [*, K] activations, row of assignment r = r // a_div (tokens for gate-up, assignments for down).
    # w1 (and w3 when GATED): [E, N, K] stacked weights; out: [A, N]. HALF2: a in pair order, as_ptr its run
    # scales.
    # DIRECT (BLOCK_M == 1, no moe_align): program m takes assignment m, its expert expert_ids[m] (topk_ids flat;
    # ids outside [0, E) skipped); the gate-up launch zeroes the down launch's counters (COUNTERS per program m),
    # the down launch combines each token's rows into res (+ shared) as they arrive (_combine_on_arrival).
    # WEIGHTS_FIRST (HALF2 with PREFETCH, launched with PDL): the routing (expert and row ids) and the first K
    # block's weights are read before the PDL wait, everything else after it. The host guarantees that every
    # kernel which may still run at that point writes neither (fused_moe: "Weights before the wait").
    # STREAM (HALF2): the expert weights' words and scales are loaded without L1 lines (fused_moe.HALF2_STREAM_WEIGHTS).
    # PAIRS_OUT (the half2 gate-up): h leaves in pair order, out_ptr its pairs and hs_ptr its run scales, exactly
    # what _half2_gemv.pair_order makes of h rounded to H_DT (_store_pairs), so no pair_order launch follows.
    # INLINE_X (the half2 gate-up): a is x itself (bf16 / fp16), put in pair order in registers; as_ptr unread.
    tl.static_assert(not INLINE_X or (HALF2 and not WEIGHTS_FIRST), "INLINE_X: half2, x read after the wait")
    tl.static_assert(not PAIRS_OUT or (HALF2 and GATED and BLOCK_N % 32 == 0), "PAIRS_OUT: half2 gate-up, whole runs")
    tl.static_assert(not WEIGHTS_FIRST or (HALF2 and PREFETCH), "WEIGHTS_FIRST is a half2_prefetch GEMV mode")
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if not WEIGHTS_FIRST:
        grid_dependency_sync(PDL)
        _zero_counters(count_ptr, pid_m, pid_n, num_counters, COUNTERS)
    if DIRECT:
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        rows = pid_m + tl.arange(0, BLOCK_M)
        if (e < 0) | (e >= E):  # dropped, as moe_align drops it: no products; the combine adds a zero row
            if WEIGHTS_FIRST:
                grid_dependency_sync(PDL)
                _zero_counters(count_ptr, pid_m, pid_n, num_counters, COUNTERS)
            if not GATED:
                _combine_on_arrival(tl.zeros((1, BLOCK_N), dtype=tl.float32), pid_m, pid_n,
                                    pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, out_ptr, stride_ot, count_ptr,
                                    res_ptr, stride_rt, shared_ptr, stride_st, TOP_K, HAS_SHARED, BLOCK_N)
            return
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < A
    a_rows = (rows // a_div).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w1_ptr += e * stride_we
    s1_ptr += e * stride_se
    w3_ptr += e * stride_we
    s3_ptr += e * stride_se
    if HALF2:  # INT4 half2 GEMV (BLOCK_M == 1): a separate loop, see _int4_half2_gemv
        acc1, acc3 = _int4_half2_gemv(a_ptr, as_ptr, tl.sum(tl.where(row_ok, a_rows, 0)), w1_ptr, s1_ptr, w3_ptr,
                                      s3_ptr, pid_n * BLOCK_N, N, K, stride_at, stride_ast, stride_wn, stride_sn,
                                      GATED, GROUP, BLOCK_N, BLOCK_K, EVEN_K, INTERPRET, PREFETCH, HALF2_ROWS,
                                      PDL if WEIGHTS_FIRST else 0, STREAM, INLINE_X)
        if WEIGHTS_FIRST:
            _zero_counters(count_ptr, pid_m, pid_n, num_counters, COUNTERS)
    elif PLANES:  # INT4 plane GEMV (BLOCK_M == 1): a separate loop, see _int4_plane_gemv
        acc1, acc3 = _int4_plane_gemv(a_ptr, tl.where(row_ok, a_rows, 0), w1_ptr, s1_ptr, w3_ptr, s3_ptr, rn, N, K,
                                      stride_at, stride_wn, stride_sn, GATED, GROUP, BLOCK_N, BLOCK_K, EVEN_K,
                                      INTERPRET, PREFETCH)
    elif BLOCK_M == 1:  # GEMV: products accumulate elementwise, reduced once after the loop
        acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PLANE_TILE:  # INT4 tensor-core tile on nibble planes (BLOCK_M > 1), see _int4_plane_tile_step
        n_rows = tl.minimum(rn, N - 1).to(tl.int64)[None, :]  # rows past N re-read row N - 1 (never stored)
        rw = tl.arange(0, BLOCK_K // 8)
        w_off = n_rows * stride_wn + rw[:, None]
        s_off = n_rows * stride_sn + (8 * rw // GROUP)[:, None]
        for k0 in range(0, K, BLOCK_K):
            w_in = k0 // 8 + rw < K // 8
            w_ok = w_in[:, None]
            a_ok = row_ok[:, None] if EVEN_K else row_ok[:, None] & w_in[None, :]
            a_ptrs = a_ptr + a_rows[:, None] * stride_at + plane_offsets(k0 // 8 + rw)[None, :]
            acc1 = _int4_plane_tile_step(a_ptrs, a_ok, w1_ptr + w_off + k0 // 8, s1_ptr + s_off + k0 // GROUP,
                                         w_ok, acc1, a_ptr.dtype.element_ty, IEEE, INTERPRET, EVEN_K)
            if GATED:
                acc3 = _int4_plane_tile_step(a_ptrs, a_ok, w3_ptr + w_off + k0 // 8, s3_ptr + s_off + k0 // GROUP,
                                             w_ok, acc3, a_ptr.dtype.element_ty, IEEE, INTERPRET, EVEN_K)
    elif not (PLANES or HALF2):
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = (rk < K)[None, :]
            a = _load(a_ptr + a_rows[:, None] * stride_at + rk[None, :], row_ok[:, None], k_ok, EVEN_K)
            if BLOCK_M == 1:
                a = a.to(tl.float32)
                if W8A8:
                    a *= _load(as_ptr + a_rows[:, None] * stride_ast + (rk // ACT_G)[None, :], row_ok[:, None],
                               k_ok, EVEN_K)
                w1 = _weight_tile(w1_ptr, s1_ptr, rn, k0, N, K, stride_wn, stride_sn,
                                  KIND, False, GROUP, SBN, SBK, BLOCK_N, BLOCK_K, EVEN_K)
                acc1 += w1.to(tl.float32) * a
                if GATED:
                    w3 = _weight_tile(w3_ptr, s3_ptr, rn, k0, N, K, stride_wn, stride_sn,
                                      KIND, False, GROUP, SBN, SBK, BLOCK_N, BLOCK_K, EVEN_K)
                    acc3 += w3.to(tl.float32) * a
            else:
                w1 = _weight_tile(w1_ptr, s1_ptr, rn, k0, N, K, stride_wn, stride_sn,
                                  KIND, W8A8, GROUP, SBN, SBK, BLOCK_N, BLOCK_K, EVEN_K)
                if GATED:
                    w3 = _weight_tile(w3_ptr, s3_ptr, rn, k0, N, K, stride_wn, stride_sn,
                                      KIND, W8A8, GROUP, SBN, SBK, BLOCK_N, BLOCK_K, EVEN_K)
                if W8A8:
                    # e4m3 × e4m3 -> fp32 per K block, × activation scale (row) × weight block scale (column)
                    a_s = tl.load(as_ptr + a_rows * stride_ast + k0 // ACT_G, mask=row_ok, other=0.0)
                    s_off = (rn // SBN).to(tl.int64) * stride_sn + k0 // SBK
                    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    w1_s = tl.load(s1_ptr + s_off, mask=rn < N, other=0.0)
                    acc1 += _mma(a, w1, zero, IEEE, INTERPRET) * a_s[:, None] * w1_s[None, :]
                    if GATED:
                        w3_s = tl.load(s3_ptr + s_off, mask=rn < N, other=0.0)
                        acc3 += _mma(a, w3, zero, IEEE, INTERPRET) * a_s[:, None] * w3_s[None, :]
                else:
                    acc1 = _mma(a, w1.to(a_ptr.dtype.element_ty), acc1, IEEE, INTERPRET)
                    if GATED:
                        acc3 = _mma(a, w3.to(a_ptr.dtype.element_ty), acc3, IEEE, INTERPRET)
    if BLOCK_M == 1 and not (PLANES or HALF2):
        acc1 = tl.reshape(tl.sum(acc1, axis=1), (1, BLOCK_N))
        acc3 = tl.reshape(tl.sum(acc3, axis=1), (1, BLOCK_N))
    if GATED and (PLANES or PLANE_TILE):  # h in plane order for the down projection's plane GEMV / tile
        res = acc1 * tl.sigmoid(acc1) * acc3
        i = rn % 8
        if PLANES:  # rounded to H_DT, stored as fp32 planes (scaled by 16^-j)
            res = res.to(H_DT).to(tl.float32) * plane_scale(i)[None, :]
        pos = plane_offsets(rn // 8) + PLANE_WORDS * i  # column n = 8w + i of h
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + pos[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < N))
    elif PAIRS_OUT:
        _store_pairs((acc1 * tl.sigmoid(acc1) * acc3).to(H_DT).to(tl.float32), tl.sum(rows).to(tl.int64),
                     tl.sum(row_ok.to(tl.int32)), pid_n * BLOCK_N, N, out_ptr, stride_ot, hs_ptr, stride_hs,
                     BLOCK_N)
    else:
        if GATED:
            res = acc1 * tl.sigmoid(acc1) * acc3  # silu(gate) * up
        else:
            res = acc1 * tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        if DIRECT and not GATED:
            _combine_on_arrival(res, pid_m, pid_n, rn, N, out_ptr, stride_ot, count_ptr, res_ptr, stride_rt,
                                shared_ptr, stride_st, TOP_K, HAS_SHARED, BLOCK_N)
        else:
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + rn[None, :],
                     res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (rn[None, :] < N))


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, shared_ptr, out_ptr, H, E,
                        stride_yt, stride_st, stride_ot,
                        TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t] = sum_j y[t * TOP_K + j] (j in order; dropped expert ids skipped) (+ shared[t]), rounded once.
    # The j loop is unrolled (TOP_K constexpr), so the TOP_K row loads are independent instructions that can be
    # in flight together instead of one memory round trip per expert (a loop over a runtime top_k was 8 round
    # trips: 4.0 µs of the one-token MoE on the H200 for 230 KB).
    t = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = rh < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        eid = tl.load(ids_ptr + t * TOP_K + j + tl.zeros_like(rh))  # broadcast: one id for the whole row
        kept = h_ok & (eid >= 0) & (eid < E)
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_yt + rh, mask=kept, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + t * stride_st + rh, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + rh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _configs(shapes) -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bn, bk, w, st in shapes]


# (BLOCK_N, BLOCK_K, num_warps, num_stages). GEMV (BLOCK_M == 1) keeps [BN, BK] fp32 products per
# accumulator in registers; dot tiles: narrow N with long K at decode (many programs, each expert's weights
# read once), square-ish tiles for prefill.
GEMV_CONFIGS = _configs([(16, 256, 4, 3), (32, 128, 4, 3), (32, 256, 8, 2), (64, 128, 8, 2),
                         # INT4 moves 4x fewer bytes per tile than bf16: longer K tiles keep as many in flight
                         (16, 512, 8, 2), (8, 512, 4, 3), (8, 1024, 8, 2)])
DOT_CONFIGS = _configs([(32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4),
                        (256, 64, 8, 3)])


SMEM_BUDGET = 200 * 1024  # of the H100/H200's 227 KB per block, leaving room for the epilogue


def _smem_bytes(meta: dict, bn: int, bk: int, stages: int) -> int:
    """Pipelined operand tiles: an A tile and one (two when GATED) weight tiles per stage."""
    a_bytes = 1 if meta["W8A8"] else meta["a_ptr"].element_size()
    w_bits = {KIND_DENSE: 8 * meta["w1_ptr"].element_size(), KIND_FP8: 8, KIND_INT4: 4}[meta["KIND"]]
    if meta["IEEE"]:  # fp32 compute: weight tiles are staged already widened to fp32 (256 KB seen on the H200)
        w_bits = 32
    elif meta["KIND"] == KIND_FP8 and not meta["W8A8"]:  # weight-only e4m3: staged as the scaled fp32 tile
        w_bits = 32                                          # (245760 B at 64x128x128, 3 stages, Triton 3.6)
    w_tiles = 2 if meta["GATED"] else 1
    return stages * (meta["BLOCK_M"] * bk * a_bytes + w_tiles * bn * bk * w_bits // 8)


def _legal(bn: int, bk: int, meta: dict) -> bool:
    """Format rules of a tile: INT4 K tiles hold whole groups; W8A8 dots keep each K tile inside one
    activation group and one weight scale block (one scale pair per partial product)."""
    if meta["KIND"] == KIND_INT4 and bk % meta["GROUP"]:
        return False
    if meta.get("PAIRS_OUT") and bn % 32:  # h's pairs from whole runs of 32 columns
        return False
    return not (meta["W8A8"] and meta["BLOCK_M"] > 1 and (meta["ACT_G"] % bk or meta["SBK"] % bk))


def _prune(configs, named_args, **kwargs):
    """Keep the tiles the format can use (``_legal``); wide N tiles only pay off with many rows per block;
    the pipelined tiles must fit in shared memory (Triton 3.6 raised OutOfResources at launch for a bf16
    gate-up tile here)."""
    meta = {**named_args, **kwargs}
    bm = meta["BLOCK_M"]
    out = []
    for c in configs:
        bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        if _smem_bytes(meta, bn, bk, c.num_stages) > SMEM_BUDGET or not _legal(bn, bk, meta):
            continue
        if 1 < bm <= 16 and bn > 64 or bm >= 64 and bn < 64:
            continue
        out.append(c)
    # The estimate is a model: a fitting fallback always joins, so the autotuner times at least two tiles and
    # scores one that still overflows shared memory as infinitely slow instead of launching it untimed.
    fallback = _smallest_fitting(configs, meta)
    if all(c.kwargs != fallback.kwargs or c.num_stages != fallback.num_stages for c in out):
        out.append(fallback)
    return out


def _smallest_fitting(configs, meta: dict) -> triton.Config:
    """The legal config with the least shared memory (K tile cut to a legal size where none is legal), its
    pipeline shortened until it fits in 3/4 of the budget."""
    def smem(c):
        return _smem_bytes(meta, c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages)
    legal = [c for c in configs if _legal(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], meta)]
    best = min(legal or configs, key=smem)
    kwargs = dict(best.kwargs)
    if not legal:  # the largest legal K tile: a group (INT4) or the scale block (W8A8)
        kwargs["BLOCK_K"] = meta["GROUP"] if meta["KIND"] == KIND_INT4 else min(meta["ACT_G"], meta["SBK"])
    stages = best.num_stages
    while stages > 1 and _smem_bytes(meta, kwargs["BLOCK_N"], kwargs["BLOCK_K"], stages) > SMEM_BUDGET * 3 // 4:
        stages -= 1
    return triton.Config(kwargs, num_warps=best.num_warps, num_stages=stages)


def _autotuned(configs):
    return triton.autotune(configs=configs, key=["N", "K", "KIND", "W8A8", "GATED", "GROUP", "BLOCK_M", "DIRECT",
                                                    "PAIRS_OUT"],
                           prune_configs_by={"early_config_prune": _prune},
                           do_bench=partial(autotune_bench, warmup=25, rep=100))(
        triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(_moe_gemm_kernel))


# INT4 plane GEMV (PLANES): per thread 4 words (16 B) of each projection per row and K block; longer K
# blocks and more rows per program put more bytes in flight (no pipelining: plain register loads). BLOCK_K: a
# multiple of PLANE_BLOCK_K (256), and BLOCK_K/8 < 32·num_warps (w4a16_gemm.kernel.planes_tile_ok).
GEMV_PLANES_CONFIGS = _configs([(16, 256, 4, 1), (16, 512, 4, 1), (32, 256, 4, 1), (32, 512, 8, 1),
                                (16, 1024, 8, 1), (64, 256, 8, 1)])

# INT4 half2 GEMV (HALF2): [BLOCK_K/32, BLOCK_N/2] runs per column tile (even / odd columns), BLOCK_K a multiple of
# 256. Narrow N tiles: at one Kimi token the gate-up has 8 x 2048 / BLOCK_N programs, and 32-wide tiles (512
# programs, under four per SM) measured 1.35x the plane GEMV's time.
GEMV_HALF2_CONFIGS = [triton.Config({**c.kwargs, "HALF2": True}, num_warps=c.num_warps, num_stages=c.num_stages)
                      for c in _configs([(8, 512, 2, 1), (8, 1024, 2, 1), (8, 1024, 1, 1), (4, 1024, 1, 1),
                                         (4, 1024, 2, 1), (4, 512, 1, 1), (16, 512, 4, 1)])]

# INT4 plane tensor-core tile (PLANE_TILE, BLOCK_M > 1, fused_moe(..., int4_tile="planes")): each dot's K is
# BLOCK_K/8 words (>= 16 for the bf16 MMA), so BLOCK_K >= 128; the usual pruning (_prune) applies. 64x512 spilled
# (228 B, gate-up at BLOCK_M 16, Triton 3.6): not a candidate.
PLANE_TILE_CONFIGS = [triton.Config({**c.kwargs, "PLANE_TILE": True}, num_warps=c.num_warps, num_stages=c.num_stages)
                      for c in _configs([(32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 3),
                                         (128, 256, 8, 3)])]

moe_gemv_autotuned = _autotuned(GEMV_CONFIGS)
moe_gemm_plane_tile_autotuned = _autotuned(PLANE_TILE_CONFIGS)
moe_gemv_planes_autotuned = _autotuned(GEMV_PLANES_CONFIGS)
moe_gemv_half2_autotuned = _autotuned(GEMV_HALF2_CONFIGS)
# gemv="half2_prefetch": the half2 GEMV with a register double buffer of the next K block's words (PREFETCH), its
# tiles as [columns, runs] (HALF2_ROWS: a warp's lanes on consecutive runs of one weight row, 512 contiguous bytes
# per load). H200, one Kimi token, interleaved rounds (results/sweep_moe_half2_h200.json, session27_call3): pinned
# 32 x 512 on 4 warps 61.8 µs, 16 x 512 / 2 warps 62.6, 64 x 512 / 8 warps 63.8, against 68.7 for the column
# orientation's autotuned tiles (its best pinned 68.8); BF16 175.6. Wider tiles (32 x 512 on 2 warps, 64 x 512 on
# 4) take 254 registers at the gate-up (sm_90, Triton 3.9).
GEMV_HALF2_ROWS_TILES = [(32, 512, 4), (16, 512, 2), (64, 512, 8), (32, 256, 2), (64, 256, 4), (16, 1024, 4)]
moe_gemv_half2_prefetch_autotuned = _autotuned([
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "HALF2": True, "PREFETCH": True, "HALF2_ROWS": True},
                  num_warps=w, num_stages=1) for bn, bk, w in GEMV_HALF2_ROWS_TILES])
# gemv="prefetch": the plane GEMV with a register double buffer of the next K block's words (PREFETCH)
moe_gemv_prefetch_autotuned = _autotuned([triton.Config({**c.kwargs, "PREFETCH": True}, num_warps=c.num_warps,
                                                        num_stages=c.num_stages) for c in GEMV_PLANES_CONFIGS])
moe_gemm_autotuned = _autotuned(DOT_CONFIGS)
