"""Triton W4A16 GEMM: y = x @ W.T with W held as INT4 nibbles (compressed-tensors ``pack-quantized``).

The weight never exists in bf16 outside registers. A tile of int32 words ``[BN, BK/8]`` is loaded with wide
vector loads; nibbles become floats by the exponent trick ``float(0x4B000000 | n) - (2^23 + 8) = n - 8``
(one OR and one subtract: no int->float conversion, which runs at a quarter of the FP32 rate) and are scaled
by their group's scale.

One kernel, three shapes of work picked by constexprs:

* ``BM == 1`` (one token, decode GEMV) and ``BM == 16`` (2-16 tokens) work on *nibble planes*: plane
  ``i`` of a word tile holds the elements ``k0 + 8·w + i``. A dot product does not care about the order of
  K, so x is read in the same permuted order (a strided load of a tiny operand) instead of interleaving the
  nibbles back into K order: no reshape, no layout shuffle. The one-token path accumulates
  ``codes · x`` in fp32 registers and applies the scale once per word (no tensor cores, no shared memory);
  the small-batch path scales, rounds to the activation dtype (as ``int4_dequantize`` stores the weight)
  and runs ``mma`` on each plane. A plane is BK/8 long and ``tl.dot`` needs K ≥ 16 on the GPU, so that
  path takes BK ≥ 128 (``dot_k``; the launcher, the config prune and ``_dot`` check it).
* ``BM >= 32`` (prefill): a tiled GEMM on the dequantized ``[BN, BK]`` tile, grouped tile order for L2 reuse.

``PLANES`` (one token, ``w4a16_gemm(..., gemv="planes")``) replaces the ``BM == 1`` loop by the
plane GEMV core shared with ``fused_moe`` (``_gemm_utils.int4_plane_gemv_step``): x arrives as fp32 nibble
planes (``_gemm_utils.plane_order``), words stay in their ``[BK/8, BN]`` load layout, one LOP3 + FADD + FFMA
per weight, the scale once per 32 K (docs/moe.md "The INT4 plane GEMV").

``PLANES1`` (``gemv="planes1"``; the default at one token until ``gemv.py``'s whole-row GEMV) is that GEMV in one
launch: no ``plane_order``; each thread reads its words' activations from x (``int4_x_plane_dot``: one 128-bit load
per word when x is 16-byte aligned, ``X_VEC``) and the plane scale 16^-j goes onto the codes (``_x_products``); its
own configs and split-K (``planes1_split``: ~4 programs per SM). docs/moe.md "W4A16 at M = 1 in one launch".

``FAST_DEQUANT`` (0 = off, the default; ``w4a16_gemm(..., fast_dequant=1 or 2)`` or ``config["FAST_DEQUANT"]``)
changes the tensor-core paths (``BM >= 16``; also usable at one token, the row tile then re-reading the one
row) to the group-scaled form: per group, the codes ``q = n - 8`` are made directly in the activation dtype
from 16-bit lanes (``_gemm_utils.int4_codes``: bf16 bits ``0x4300 | n`` = 128 + n, minus 136; exact), fed
in K order to ``tl.dot(x_group, q.T)`` into a fresh fp32 tile, and the group's scale multiplies that
partial once per output (not once per weight): no fp32 weight tile, no per-weight multiply or rounding.
The weight is then not rounded to the activation dtype before the product (the reference does round it),
so bf16 results differ from the default path within the bf16 tolerance; fp32 results match to rounding
order. The one-token GEMV (``BM == 1``) already applies the scale once per word and is unchanged by it.
Level 2 also drops the subtraction: the 16-bit lanes ``128 + n`` (= q + 136) go to the dot as they are,
and ``136 · Σ x_group`` (one row sum per group) is subtracted from the partial — no floating-point op per
weight at all; the products are exact and the cancellation costs ~5 of fp32's 24 bits.

A second kernel, ``_w4a16_swap_kernel`` (the default for 2-16 tokens of bf16 / fp16, ``w4a16_gemm(..., swap_ab=)``),
swaps the operands: y^T = W · x^T with the weight as the wgmma A operand in registers, one pair of K = 16 dots per
group on the group's packed bytes (low and high nibbles), the group scale on the fp32 partial (end of this file;
docs/moe.md "W4A16 at 2-16 tokens: swapped operands").

Split-K (``SPLIT_K > 1``) fills the SMs when there are few output tiles: each program writes its fp32 partial
``[BM, BN]`` to a workspace, and the last program to arrive at a tile (an atomic counter) sums the partials
in a fixed order — deterministic — writes the output and resets the counter for the next launch.
"""
import triton
import triton.language as tl

from .._gemm_utils import (PLANE_BLOCK_K, _load_in_place, _nibble_products, autotune_bench, grouped_tile, int4_codes,
                           int4_plane_gemv_step, ld4, load_k, m_bucket, plane_offsets, split_k_for, store_split_k)
from .._host import cdiv


@triton.jit
def int4_x_plane_dot(words, x_ptrs, x_mask, EVEN: tl.constexpr, INTERPRET: tl.constexpr, VEC: tl.constexpr):
    """``_gemm_utils.int4_plane_dot`` reading the activation row as it is (no ``plane_order`` launch): ``x_ptrs``
    [BK/8, 1] point at element 8w of each word w, so plane i is ``x_ptrs + i``, loaded in the words' row layout
    (the row is L1/L2-resident) and converted to fp32; the plane scale 16^-j(i) goes onto the codes
    (:func:`_x_products`), not the activations. The same exact products, in the same order. ``VEC`` (x 16-byte
    aligned, unmasked, compiled): each word's 8 activations come in 128-bit loads (``ld4``: one for bf16/fp16,
    two for fp32) and are split in registers (bf16: a shift or a mask per value); otherwise one strided scalar
    load per plane."""
    hi = words >> 20
    if VEC and EVEN and not INTERPRET:
        DT: tl.constexpr = x_ptrs.dtype.element_ty
        v0, v1, v2, v3 = ld4(x_ptrs, CONSTANT=False)
        if DT == tl.float32:
            v4, v5, v6, v7 = ld4(x_ptrs + 4, CONSTANT=False)
            acc = _x_products(words, hi, v0.to(tl.float32, bitcast=True), 0, INTERPRET)
            acc += _x_products(words, hi, v1.to(tl.float32, bitcast=True), 1, INTERPRET)
            acc += _x_products(words, hi, v2.to(tl.float32, bitcast=True), 2, INTERPRET)
            acc += _x_products(words, hi, v3.to(tl.float32, bitcast=True), 3, INTERPRET)
            acc += _x_products(words, hi, v4.to(tl.float32, bitcast=True), 4, INTERPRET)
            acc += _x_products(words, hi, v5.to(tl.float32, bitcast=True), 5, INTERPRET)
            acc += _x_products(words, hi, v6.to(tl.float32, bitcast=True), 6, INTERPRET)
            acc += _x_products(words, hi, v7.to(tl.float32, bitcast=True), 7, INTERPRET)
        else:  # two 16-bit activations per 32-bit lane: element 2p low, 2p + 1 high
            acc = _x_products(words, hi, _half(v0, False, DT), 0, INTERPRET)
            acc += _x_products(words, hi, _half(v0, True, DT), 1, INTERPRET)
            acc += _x_products(words, hi, _half(v1, False, DT), 2, INTERPRET)
            acc += _x_products(words, hi, _half(v1, True, DT), 3, INTERPRET)
            acc += _x_products(words, hi, _half(v2, False, DT), 4, INTERPRET)
            acc += _x_products(words, hi, _half(v2, True, DT), 5, INTERPRET)
            acc += _x_products(words, hi, _half(v3, False, DT), 6, INTERPRET)
            acc += _x_products(words, hi, _half(v3, True, DT), 7, INTERPRET)
    else:
        acc = _x_products(words, hi, load_k(x_ptrs, x_mask, EVEN).to(tl.float32), 0, INTERPRET)
        for i in tl.static_range(1, 8):
            a_i = load_k(x_ptrs + i, x_mask, EVEN).to(tl.float32)
            acc += _x_products(words, hi, a_i, i, INTERPRET)
    return acc


@triton.jit
def _x_products(words, hi, a, I: tl.constexpr, INTERPRET: tl.constexpr):
    """(n_I - 8) · a for nibble I of every word, ``a`` the activation itself (not a plane value a·16^-j): the
    16^-j moves from the activation onto the in-place code, ``v · 16^-j - (2^23 + 8·16^j) · 16^-j`` = n - 8
    exactly (v = 2^23 + n·16^j; powers of two), one FFMA where ``_gemm_utils._nibble_products`` has an FADD —
    so no multiply per activation. j = I for I < 5, I - 5 after."""
    J: tl.constexpr = I if I < 5 else I - 5
    if J == 0:
        return _nibble_products(words, hi, a, I, INTERPRET)
    src = words if I < 5 else hi
    mask = tl.full(src.shape, 0xF << (4 * J), tl.int32)
    if INTERPRET:
        bits = (src & mask) | 0x4B000000
    else:  # one LOP3, as in _gemm_utils._nibble_products
        bits = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, 0x4B000000, 0xEA;", "=r,r,r", [src, mask],
                                         dtype=tl.int32, is_pure=True, pack=1)
    inv: tl.constexpr = 1.0 / (16 ** J)
    return tl.fma(bits.to(tl.float32, bitcast=True), inv, -(8388608.0 + 8.0 * (16 ** J)) * inv) * a


@triton.jit
def _half(v, HIGH: tl.constexpr, DT: tl.constexpr):
    """The low or high 16-bit lane of int32 ``v`` read as DT (bf16 / fp16), in fp32: bf16 is the top half of an
    fp32, so one shift (low lane) or mask (high lane) makes it; fp16 converts."""
    if DT == tl.bfloat16:
        bits = (v & -65536) if HIGH else (v << 16)
        return bits.to(tl.float32, bitcast=True)
    lane = (v >> 16) if HIGH else v
    return lane.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def int4_x_gemv_step(words, s_ptrs, x_ptrs, k_mask, s_mask, EVEN: tl.constexpr, INTERPRET: tl.constexpr,
                     VEC: tl.constexpr):
    """``_gemm_utils.int4_plane_gemv_step`` with the activation read in place (:func:`int4_x_plane_dot`):
    words int32 [BK/8, BN], s_ptrs [BK/32, BN] (one scale per run of 4 words); returns fp32 [BK/32, BN]."""
    inner = int4_x_plane_dot(words, x_ptrs, k_mask, EVEN, INTERPRET, VEC)
    runs = tl.sum(tl.reshape(inner, (words.shape[0] // 4, 4, words.shape[1])), axis=1)
    return runs * _load_in_place(s_ptrs, s_mask, EVEN, INTERPRET)


@triton.jit
def _dequant_tile(words, scales, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    """words int32 [BN, BK/8], scales fp32 [BN, BK/GROUP] -> fp32 [BN, BK]: (nibble - 8) * scale."""
    shifts = tl.arange(0, 8) * 4
    nib = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # element j: word j // 8, bits 4·(j % 8)
    codes = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # (2^23 + n) - (2^23 + 8) = n - 8
    w = tl.reshape(codes, (BN, BK // GROUP, GROUP)) * scales[:, :, None]
    return tl.reshape(w, (BN, BK))


# The shortest K extent a tensor-core tl.dot accepts on the GPU (16-bit and, in Triton 3.6, fp32 operands);
# the interpreter does not check it, so _dot asserts it at compile time on both.
MIN_DOT_K = tl.constexpr(16)


@triton.jit
def _dot(a, b, acc, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr):
    tl.static_assert(a.shape[1] >= MIN_DOT_K, "tl.dot: K extent < 16 (the BM=16 nibble planes need BK >= 128)")
    if INTERPRET:  # the interpreter's bf16 dot is wrong; fp32 operands hold the same values
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _group_scaled_dots(x_rows, w_rows, s_vec, acc, k0, K, GROUP: tl.constexpr, BN: tl.constexpr,
                       EVEN_K: tl.constexpr, GROUPS: tl.constexpr, INTERPRET: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, BIASED: tl.constexpr):
    """FAST_DEQUANT step over K block k0..k0+GROUPS·GROUP: for each group, acc += (x_g @ q_g.T) · s_g.
    x_rows [BM, 1] / w_rows [BN, 1] / s_vec [BN] pointers; q_g [BN, GROUP] codes in the activation dtype,
    in K order (word w, nibble i -> element 8w + i); the scale multiplies the group's fp32 partial once.
    BIASED (FAST_DEQUANT=2): the codes are q + bias, and bias · Σ x_g is subtracted from each partial."""
    # [1]: the code of nibble 8 (q = 0) is the bias: 136 (bf16), 1032 (fp16), 0 (fp32 or not BIASED)
    bias = int4_codes(tl.full((1,), 8, tl.int32), x_rows.dtype.element_ty, INTERPRET, BIASED).to(tl.float32)
    for g in tl.static_range(GROUPS):
        kg = k0 + g * GROUP
        gw = kg // 8 + tl.arange(0, GROUP // 8)
        words = load_k(w_rows + gw[None, :], (gw < K // 8)[None, :], EVEN_K)         # int32 [BN, GROUP/8]
        nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        q = tl.reshape(int4_codes(nib, x_rows.dtype.element_ty, INTERPRET, BIASED), (BN, GROUP))
        rk = kg + tl.arange(0, GROUP)
        x = load_k(x_rows + rk[None, :], (rk < K)[None, :], EVEN_K)                   # [BM, GROUP]
        s = load_k(s_vec + kg // GROUP, kg + tl.zeros((BN,), dtype=tl.int32) < K, EVEN_K).to(tl.float32)  # [BN]
        part = _dot(x, tl.trans(q), tl.zeros(acc.shape, dtype=tl.float32), INTERPRET, DOT_PRECISION)
        if BIASED:
            part -= tl.sum(x.to(tl.float32), axis=1)[:, None] * bias[None, :]
        acc += part * s[None, :]
    return acc


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_ym, stride_part,
    M_BUCKET, NUM_SMS,  # autotuning key / split-K heuristic input only
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FAST_DEQUANT: tl.constexpr = False, PLANES: tl.constexpr = False, PLANES1: tl.constexpr = False,
    X_VEC: tl.constexpr = False,
):
    # x [M, K] (row stride stride_xm; with PLANES the one row's fp32 nibble planes, _gemm_utils.plane_order),
    # w [N, K/8] int32, s [N, K/GROUP], y [M, N]; part [SPLIT_K, M, N] fp32.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    pid_m, pid_n = grouped_tile(pid, grid_m, grid_n, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    # Rows / columns past the edge re-read valid ones (no masks in the loop); they are never stored.
    x_rows = x_ptr + (rm % M)[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + (rn % N)[:, None].to(tl.int64) * (K // 8)
    s_rows = s_ptr + (rn % N)[:, None].to(tl.int64) * (K // GROUP)
    s_vec = s_ptr + (rn % N).to(tl.int64) * (K // GROUP)  # [BN]: one scale per column (FAST_DEQUANT)
    rk = tl.arange(0, BK)
    rw = tl.arange(0, BK // 8)
    rg = tl.arange(0, BK // GROUP)

    k_iters = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_iters, SPLIT_K)
    it_lo = pid_k * per_split
    it_hi = tl.minimum(it_lo + per_split, k_iters)

    if PLANES or PLANES1:  # one row (PLANES: its fp32 nibble planes); [BK/8, BN] tiles (_gemm_utils.int4_plane_dot)
        w_cols = w_ptr + (rn % N)[None, :].to(tl.int64) * tl.multiple_of(K // 8, GROUP // 8)  # 16-byte aligned
        s_cols = s_ptr + (rn % N)[None, :].to(tl.int64) * (K // GROUP)
        acc_e = tl.zeros((BK // 32, BN), dtype=tl.float32)
    elif BM == 1:
        acc_e = tl.zeros((BN, BK // 8), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for it in range(it_lo, it_hi):
        k0 = it * BK
        if PLANES or PLANES1:  # one token: the plane GEMV core shared with fused_moe, on a [BK/8, BN] word tile
            kmask_t = (k0 // 8 + rw < K // 8)[:, None]
            runs = tl.arange(0, BK // 32)[:, None]  # runs of 4 words (32 K), one scale each
            words_t = load_k(w_cols + (k0 // 8 + rw)[:, None], kmask_t, EVEN_K)
            if PLANES1:  # x read in place: element 8w of word w (one launch, no plane_order)
                acc_e += int4_x_gemv_step(words_t, s_cols + (k0 + 32 * runs) // GROUP,
                                          x_ptr + k0 + 8 * rw[:, None], kmask_t, k0 // 32 + runs < K // 32,
                                          EVEN_K, INTERPRET, X_VEC)
            else:
                acc_e += int4_plane_gemv_step(words_t, s_cols + (k0 + 32 * runs) // GROUP,
                                              x_ptr + k0 + plane_offsets(rw)[:, None],  # BK % 256 == 0: whole blocks
                                              kmask_t, k0 // 32 + runs < K // 32, EVEN_K, INTERPRET)
        elif FAST_DEQUANT and BM > 1:
            acc = _group_scaled_dots(x_rows, w_rows, s_vec, acc, k0, K, GROUP, BN, EVEN_K, BK // GROUP,
                                     INTERPRET, DOT_PRECISION, FAST_DEQUANT == 2)
        else:
            kmask = (k0 // 8 + rw < K // 8)[None, :]  # per word; K % 8 == 0, so also per element of a word
            words = load_k(w_rows + (k0 // 8 + rw)[None, :], kmask, EVEN_K)             # int32 [BN, BK/8]
            if BM <= 16:
                # Nibble planes: plane i holds the elements k0 + 8·w + i. A dot product does not care about the
                # order of K, so x is read in the same permuted order instead of interleaving the nibbles back
                # into K order (no reshape, no layout shuffle); the group scale is the same for a whole word.
                sw = load_k(s_rows + ((k0 + 8 * rw) // GROUP)[None, :], kmask, EVEN_K).to(tl.float32)
                if BM == 1:
                    inner = tl.zeros((BN, BK // 8), dtype=tl.float32)
                for i in tl.static_range(8):
                    codes = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                    xi = load_k(x_rows + (k0 + 8 * rw + i)[None, :], kmask, EVEN_K)     # [BM, BK/8]
                    if BM == 1:
                        inner += codes * xi.to(tl.float32)
                    else:  # scaled and rounded like int4_dequantize's output, then mma
                        wt = tl.trans((codes * sw).to(x_ptr.dtype.element_ty))
                        acc = _dot(xi, wt, acc, INTERPRET, DOT_PRECISION)
                if BM == 1:
                    acc_e += inner * sw
            else:
                scales = load_k(s_rows + (k0 // GROUP + rg)[None, :], (k0 // GROUP + rg < K // GROUP)[None, :],
                                EVEN_K).to(tl.float32)
                x = load_k(x_rows + (k0 + rk)[None, :], (k0 + rk < K)[None, :], EVEN_K)  # [BM, BK]
                w = _dequant_tile(words, scales, BN, BK, GROUP)                          # fp32 [BN, BK]
                acc = _dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc, INTERPRET, DOT_PRECISION)
    if PLANES or PLANES1:
        acc = tl.reshape(tl.sum(acc_e, axis=0), (1, BN))
    elif BM == 1:
        acc = tl.reshape(tl.sum(acc_e, axis=1), (1, BN))

    out_mask = (rm < M)[:, None] & (rn < N)[None, :]
    store_split_k(acc, y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], out_mask,
                  part_ptr + (rm[:, None].to(tl.int64) * N + rn[None, :]), stride_part, pid_k, count_ptr + pid,
                  SPLIT_K)


def _configs(fast: int = 0) -> list[triton.Config]:
    """A few sensible configs per regime; the launcher keeps those whose BM suits the token count. With
    ``fast`` (a FAST_DEQUANT level) every config sets it (the GEMV ones are unaffected) and the 16-row tiles are
    also tried at one token."""
    def c(kw, num_warps, num_stages):
        return triton.Config({**kw, "FAST_DEQUANT": fast} if fast else kw, num_warps=num_warps,
                             num_stages=num_stages)
    gemv = [c({"BM": 1, "BN": bn, "BK": bk, "GROUP_M": 1}, num_warps=w, num_stages=s)
            for bn, bk, w, s in ((16, 512, 4, 2), (32, 512, 4, 2), (16, 1024, 4, 2), (64, 256, 4, 3),
                                 (32, 1024, 8, 2))]
    small = [c({"BM": 16, "BN": bn, "BK": bk, "GROUP_M": 1}, num_warps=w, num_stages=s)
             for bn, bk, w, s in ((16, 256, 4, 2), (32, 256, 4, 2), (64, 256, 4, 3), (32, 512, 8, 2))]
    # tiled: the accumulator and the dequantized fp32 tile each stay within ~64 registers per thread
    tiled = [c({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
             for bm, bn, bk, w, s in ((32, 64, 64, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 4, 4),
                                      (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3))]
    return gemv + small + tiled


def regime_bm(m_bucket: int) -> tuple[int, ...]:
    """Tile heights that suit a token-count bucket (used to prune the configs)."""
    if m_bucket == 1:
        return (1,)
    if m_bucket <= 16:
        return (16,)
    if m_bucket <= 64:
        return (32, 64)
    return (64, 128)


def dot_k(bm: int, bk: int, group: int, fast: int = 0) -> int | None:
    """The K extent of the kernel's ``tl.dot`` for a config (None: the one-token GEMV has no dot). The
    FAST_DEQUANT tiles dot one group at a time, the 16-row tile one nibble plane (BK/8) at a time, the tiled
    path the whole BK. It must be at least ``MIN_DOT_K`` for the kernel to compile on the GPU."""
    if bm == 1:
        return None
    if fast:
        return group
    return bk // 8 if bm <= 16 else bk


def dot_k_ok(bm: int, bk: int, group: int, fast: int = 0) -> bool:
    kd = dot_k(bm, bk, group, fast)
    return kd is None or kd >= MIN_DOT_K.value


def planes_tile_ok(bk: int, num_warps: int) -> bool:
    """K tiles of the plane GEMV: whole plane blocks (PLANE_BLOCK_K), and an activation vector (BK/8 fp32) that
    loads straight into the words' layout, which needs fewer elements than the program has threads (Triton
    then re-materialises the small load in that layout; at 16x1024 with 4 warps it went through shared memory
    instead: static sm_90 count)."""
    return bk % PLANE_BLOCK_K == 0 and bk // 8 < 32 * num_warps


def planes1_tile_ok(bk: int, num_warps: int, vec: bool = False) -> bool:
    """K tiles of the one-launch plane GEMV (``PLANES1``): runs of 4 words (32 K). Without ``vec`` (the strided
    per-plane loads: x not 16-byte aligned) also an activation vector (BK/8 per plane) that Triton
    re-materialises in the words' layout, as :func:`planes_tile_ok` (at 16x1024 with 4 warps it went through
    shared memory: static sm_90 count); the 128-bit inline-asm loads have no layout of their own."""
    return bk % 32 == 0 and (vec or bk // 8 < 32 * num_warps)


def planes1_split(n: int, k: int, bn: int, bk: int, sms: int, per_sm: int = 4) -> int:
    """Split-K of the one-launch plane GEMV: double while the grid stays within ~``per_sm`` programs per SM and
    every split keeps at least one K block (a split of one or two long K blocks keeps all its words in flight at
    once). The last program of a tile sums the partials in split order (deterministic)."""
    tiles, iters = cdiv(n, bn), cdiv(k, bk)
    split = 1
    while split * 2 <= iters and tiles * split * 2 <= per_sm * sms:
        split *= 2
    return split


def _planes1_configs() -> list[triton.Config]:
    """One token in one launch (``w4a16_gemm(..., gemv="planes1")``): narrow N tiles, K tiles of 512-1024."""
    return [triton.Config({"BM": 1, "BN": bn, "BK": bk, "GROUP_M": 1}, num_warps=w, num_stages=s)
            for bn, bk, w, s in PLANES1_TILES]


# (BN, BK, num_warps, num_stages) of the one-launch GEMV's autotune candidates: each thread loads >= 64 B of
# words per K block (docs/moe.md "W4A16 at M = 1 in one launch"); the two BK = 1024 tiles with 4 warps need the
# 128-bit activation loads (planes1_tile_ok)
PLANES1_TILES = ((16, 1024, 4, 2), (32, 512, 4, 2), (32, 1024, 4, 2), (64, 512, 8, 2), (64, 256, 4, 3))


def _prune(configs, named_args, **kwargs):
    bucket = named_args["M_BUCKET"]
    group = named_args.get("GROUP", kwargs.get("GROUP"))

    planes = kwargs.get("PLANES", named_args.get("PLANES", False))
    planes1 = kwargs.get("PLANES1", named_args.get("PLANES1", False))
    x_vec = kwargs.get("X_VEC", named_args.get("X_VEC", False))

    def suits(cfg):
        kw = cfg.kwargs
        fast_tile_at_one = bucket == 1 and kw.get("FAST_DEQUANT") and kw["BM"] == 16
        return ((kw["BM"] in regime_bm(bucket) or fast_tile_at_one) and kw["BK"] % group == 0
                and dot_k_ok(kw["BM"], kw["BK"], group, kw.get("FAST_DEQUANT", 0))
                and not (planes and not planes_tile_ok(kw["BK"], cfg.num_warps))
                and not (planes1 and not planes1_tile_ok(kw["BK"], cfg.num_warps, x_vec)))

    return [cfg for cfg in configs if suits(cfg)]


def split_k(m: int, n: int, k: int, bm: int, bn: int, bk: int, sms: int) -> int:
    """Split the K loop until there are ~4 programs per SM for a GEMV / small batch (memory-bound: more
    loads in flight) and ~2 for the tiled path."""
    tiles = cdiv(m, bm) * cdiv(n, bn)
    return split_k_for(tiles, cdiv(k, bk), (4 if bm <= 16 else 2) * sms)


def workspace_bounds(m: int, n: int, k: int, group: int, sms: int, fast: int = 0,
                     planes1: bool = False) -> tuple[int, int]:
    """(largest SPLIT_K, most output tiles) over the configs the autotuner may pick for this shape."""
    if planes1:
        cfgs = _prune(_planes1_configs(), {"M_BUCKET": 1, "GROUP": group}, PLANES1=True, X_VEC=True)  # superset
        splits = [planes1_split(n, k, c.kwargs["BN"], c.kwargs["BK"], sms) for c in cfgs]
    else:
        cfgs = _prune(_configs(fast), {"M_BUCKET": m_bucket(m), "GROUP": group})
        splits = [split_k(m, n, k, c.kwargs["BM"], c.kwargs["BN"], c.kwargs["BK"], sms) for c in cfgs]
    tiles = [cdiv(m, c.kwargs["BM"]) * cdiv(n, c.kwargs["BN"]) for c in cfgs]
    return max(splits), max(tiles)


def _autotuned(fast: int):
    return triton.autotune(
        configs=_configs(fast), key=["M_BUCKET", "N", "K", "GROUP"], prune_configs_by={"early_config_prune": _prune},
        do_bench=autotune_bench,
    )(triton.heuristics({
        "SPLIT_K": lambda a: split_k(a["M"], a["N"], a["K"], a["BM"], a["BN"], a["BK"], a["NUM_SMS"]),
        "EVEN_K": lambda a: a["K"] % a["BK"] == 0,
    })(_w4a16_gemm_kernel))


def _planes1_autotuned():
    return triton.autotune(
        configs=_planes1_configs(), key=["N", "K", "GROUP", "X_VEC"], prune_configs_by={"early_config_prune": _prune},
        do_bench=autotune_bench,
    )(triton.heuristics({
        "SPLIT_K": lambda a: planes1_split(a["N"], a["K"], a["BN"], a["BK"], a["NUM_SMS"]),
        "EVEN_K": lambda a: a["K"] % a["BK"] == 0,
    })(_w4a16_gemm_kernel))


w4a16_gemm_autotuned = _autotuned(fast=0)  # the default
w4a16_gemv_planes_autotuned = _autotuned(fast=0)  # one token, PLANES=True: its own tuning cache
# w4a16_gemm(..., fast_dequant=level): each FAST_DEQUANT level has its own configs and tuning cache
FAST_AUTOTUNED = {1: _autotuned(fast=1), 2: _autotuned(fast=2)}
w4a16_gemv_planes1_autotuned = _planes1_autotuned()  # one token in one launch (gemv="planes1")


# ------------------- 2-16 tokens (swap_ab=True: up to 128): swapped operands, a pair of dots per group of 32 K
# (BN, BK, num_warps, num_stages) of the swapped kernel and its largest split: on the H200 (c286741, bench gemm, bf16)
# 17.3 / 25.2 µs at 16 tokens x 2048 / 4096 x 7168 against tinygemm's 19.8 / 37.8 and the FAST_DEQUANT tile's
# 24.0 / 38.0; the best or within noise of every tile and split swept (results/sweep_w4a16_swap_h200.json)
SWAP_TILE = (64, 256, 4, 2)
SWAP_MAX_SPLIT = 16


# past 16 tokens (BM 32-128) each split writes fp32 partials [M, N]: the split is capped so the row tiles times the
# splits make about SWAP_WIDE_TOKEN_PROGRAMS / BM programs per SM (4 at 32 tokens, 2 at 64). H100, session 42
# (results/sweep_w4a16_frag_h200.json, session42_swap): the best split of the three swept at 3 of 4 shapes (at 64
# tokens half of 4 per SM: 33.5 against 41.5 µs at 4096 x 7168, 149.0 against 155.2 at 7168 x 18432)
SWAP_WIDE_TOKEN_PROGRAMS = 128
# from this many tokens the activations load as whole groups split into parities in registers (X_SPLIT), not as
# 2-byte gathers per parity: 1.2-1.6x faster at 32 and 64 tokens (same sweep)
SWAP_X_SPLIT_MIN_M = 17


def swap_split(k: int, bk: int, cap: int = SWAP_MAX_SPLIT) -> int:
    """Split-K of the swapped kernel: the largest power of two <= min(SWAP_MAX_SPLIT, cap) that leaves every split
    at least one K block (at 2048 x 7168, 4-8 splits were 1.2-1.7x slower than 16, and 32-64 splits of smaller blocks
    1.3-1.7x slower: results/sweep_w4a16_swap_h200.json)."""
    iters, split = cdiv(k, bk), 1
    while split * 2 <= min(SWAP_MAX_SPLIT, cap, iters):
        split *= 2
    return split


def swap_plan(m: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """(BM, split) of the swapped kernel for m tokens: BM the power of two >= m, at least 16 (the wgmma N side);
    up to 16 tokens :func:`swap_split`, past them also at most ``SWAP_WIDE_TOKEN_PROGRAMS / BM`` programs per SM (row
    tiles of ``SWAP_TILE``'s BN times splits), since every split's partials grow with M."""
    bm = max(16, 1 << max(0, m - 1).bit_length())
    bn, bk = SWAP_TILE[0], SWAP_TILE[1]
    if bm == 16:
        return bm, swap_split(k, bk)
    return bm, swap_split(k, bk, max(1, SWAP_WIDE_TOKEN_PROGRAMS // bm * sms // cdiv(n, bn)))


@triton.jit
def _x_parity_pair(x_cols, kg, K, c, EVEN: tl.constexpr, X_SPLIT: tl.constexpr = False):
    """The activations of one group as two B operands [16, BM]: elements kg + 2c (low nibbles) and kg + 2c + 1
    (high nibbles); zeros past K (a whole group is in or out, K being a multiple of 32). ``EVEN`` (BK divides K):
    no mask. ``X_SPLIT``: the group's 32 contiguous elements per token in one load [32, BM], split into the two
    parities in registers (2-byte gathers of each parity cost a load per element and token, which grows with BM)."""
    if X_SPLIT:
        k32 = kg + tl.arange(0, 32)
        xg = load_k(x_cols + k32[:, None], (k32 < K)[:, None], EVEN)                 # [32, BM]
        lo, hi = tl.split(tl.permute(tl.reshape(xg, (16, 2, xg.shape[1])), (0, 2, 1)))
    else:
        ok = (kg + 2 * c < K)[:, None]
        lo = load_k(x_cols + (kg + 2 * c)[:, None], ok, EVEN)
        hi = load_k(x_cols + (kg + 2 * c + 1)[:, None], ok, EVEN)
    return lo, hi


@triton.jit
def _byte_codes(b, HIGH: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """The signed codes q = n - 8 of the low (or high) nibbles of int8 ``b``, exact, in DT (bf16: bits 0x4300 | n
    = 128 + n, fp16: 0x6400 | n = 1024 + n, then one subtraction; fp32 under the interpreter, whose 16-bit bitcasts
    are wrong). Elementwise and widening only, so Triton keeps the whole chain in the wgmma A-operand registers."""
    nib = ((b >> 4) & 0xF) if HIGH else (b & 0xF)
    if INTERPRET:
        q = nib.to(tl.float32) - 8.0
    elif DT == tl.bfloat16:
        q = (nib.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
    else:
        q = (nib.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
    return q


@triton.jit
def _group_partial(w_rows, kg, K, c, xl, xh, DT: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """One group's unscaled fp32 partial [BN, BM]: lo(B_g) @ xl + hi(B_g) @ xh, B_g the group's int8 bytes [BN, 16]."""
    b = load_k(w_rows + (kg // 2 + c)[None, :], (kg // 2 + c < K // 2)[None, :], EVEN_K)
    lo, hi = _byte_codes(b, False, DT, INTERPRET), _byte_codes(b, True, DT, INTERPRET)
    if INTERPRET:  # the interpreter's 16-bit dots are wrong; fp32 operands hold the same values
        return tl.dot(hi, xh.to(tl.float32), tl.dot(lo, xl.to(tl.float32)))
    return tl.dot(hi, xh, tl.dot(lo, xl))


@triton.jit
def _w4a16_swap_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_ym, stride_part,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, X_SPLIT: tl.constexpr = False,
):
    """y^T tile [BN, BM] = Σ_groups s_g · (lo(B_g) @ x_even,g^T + hi(B_g) @ x_odd,g^T) for M <= BM tokens (BM a power
    of two, 16 to 128: the wgmma N side; rows past M re-read valid ones and are not stored).

    The weight is the A operand (wgmma: 64 rows per warp group, from registers), the tokens the N side. Per group
    of 32 K, B_g int8 [BN, 16] are the group's packed bytes: byte c holds elements 2c (low nibble) and 2c + 1 (high),
    so each nibble half is a K = 16 operand by an elementwise op and the group's scale multiplies the fp32 partial once
    per output (as FAST_DEQUANT). Groups go two per step (below)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    c = tl.arange(0, 16)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    w8 = w_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    w_rows = w8 + (rn % N)[:, None].to(tl.int64) * (K // 2)          # rows past N re-read valid ones (not stored)
    s_rows = s_ptr + (rn % N).to(tl.int64) * (K // GROUP)
    x_cols = x_ptr + (rm % M)[None, :].to(tl.int64) * stride_xm       # [1, BM]
    k_iters = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_iters, SPLIT_K)
    it_lo = pid_k * per_split
    it_hi = tl.minimum(it_lo + per_split, k_iters)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    # two groups per step: their four dots issue before either partial is scaled, and one barrier stages both
    # groups' activations (3-5 % faster than one group per step at 2048 / 4096 x 7168); the next pair's
    # activations are loaded while this pair computes (masked past the block's end: they may lie past K)
    tl.static_assert(BK % 64 == 0, "the swapped kernel takes K blocks of whole group pairs")
    x_lo0, x_hi0 = _x_parity_pair(x_cols, it_lo * BK, K, c, False, X_SPLIT)
    x_lo1, x_hi1 = _x_parity_pair(x_cols, it_lo * BK + 32, K, c, False, X_SPLIT)
    for it in range(it_lo, it_hi):
        k0 = it * BK
        for g in tl.static_range(0, BK // 32, 2):
            kg = k0 + 32 * g
            xl0, xh0, xl1, xh1 = x_lo0, x_hi0, x_lo1, x_hi1
            x_lo0, x_hi0 = _x_parity_pair(x_cols, kg + 64, K, c, EVEN_K and g + 2 < BK // 32, X_SPLIT)
            x_lo1, x_hi1 = _x_parity_pair(x_cols, kg + 96, K, c, EVEN_K and g + 2 < BK // 32, X_SPLIT)
            p0 = _group_partial(w_rows, kg, K, c, xl0, xh0, DT, EVEN_K, INTERPRET)
            p1 = _group_partial(w_rows, kg + 32, K, c, xl1, xh1, DT, EVEN_K, INTERPRET)
            s0 = load_k(s_rows + kg // GROUP, kg + 0 * rn < K, EVEN_K).to(tl.float32)            # [BN]
            s1 = load_k(s_rows + (kg + 32) // GROUP, kg + 32 + 0 * rn < K, EVEN_K).to(tl.float32)
            acc += p0 * s0[:, None] + p1 * s1[:, None]
    out_mask = (rm < M)[:, None] & (rn < N)[None, :]
    store_split_k(tl.trans(acc), y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], out_mask,
                  part_ptr + (rm[:, None].to(tl.int64) * N + rn[None, :]), stride_part, pid_k, count_ptr + pid_n,
                  SPLIT_K)
