"""MLA decode over fp8_e4m3 pages at up to 16 query rows on ``mma.sync`` fragments built in registers
(``mla_decode(..., fp8_dequant="fragments")``; opt-in, session 15; **not yet run on a GPU**: checked in the CPU
interpreter against the reference and compiled for sm_90 — 164 registers, no spills, 452 SASS instructions per warp
and 16-token tile, ~113 warp instructions per KV token against 171 for the TMA bitcast; docs/mla.md "FP8 pages on MMA
fragments").

The route is the W4A16 fragment kernel's (``w4a16_gemm/fragments.py``): 1-D tensors of one element per thread, each
lane building its own operand fragments, the MMAs as inline PTX (``_mma``; ``_mma_emulated`` under the
interpreter). The order of K inside an MMA is free as long as A and B agree, which gives the transposition of V that
``tl.dot`` cannot do without staging bytes through shared memory.

Program (split, request), 4 warps; warp w owns latent columns 128w .. 128w + 127 (and rope 16w .. 16w + 15) of the
scores and latent columns 128w .. of the output. Per tile of 16 tokens (one page holds them: page size % 16 == 0):

* scores S_w [16 rows, 16 tokens] = q[:, cols_w] · K[tokens, cols_w]^T: A = q (rows r, r + 8; held in registers
  for the whole split, pre-scaled by the softmax scale in log2 units, fp16), B = K^T: lane (r, c) holds token r
  (n-tile 0) and 8 + r (n-tile 1) at latent columns 128w + 32c + 4j .. + 3 (k-step j < 8; two 128-bit loads) and
  rope columns 512 + 16w + 4c .. + 3 (k-step 8), each byte pair converted by ``cvt.rn.f16x2.e4m3x2``;
* S = Σ_w S_w (a cross-warp sum through shared memory), times the token scales, masked (causal among the S_Q
  query tokens, the end of the sequence);
* online softmax on the accumulator layout: lane (r, c) holds rows r, r + 8 at tokens 2c, 2c + 1 of each n-tile;
  row max and sum by two ``shfl.sync.bfly`` in the quad;
* O_w [16 rows, 128 columns] += P · V[:, cols_w]: A = P straight from the S accumulators (tokens 2c, 2c + 1,
  2c + 8, 2c + 9 are the lane's own), times the token scales, fp16; B = V: lane (r, c) holds columns 16r .. 16r + 15
  of its four tokens (one 128-bit load each), PRMT pairs a column of two tokens, ``cvt.rn.f16x2.e4m3x2`` converts.
  Output accumulator n-tile j: rows r / r + 8, columns 128w + 16 (2c) + j and 128w + 16 (2c + 1) + j.

Partials per split as ``mla_decode``'s (o fp32 [B, splits, M, 512], lse log2 [B, splits, M]); ``combine_splits``
merges them.
"""
import triton
import triton.language as tl

from ..w4a16_gemm.fragments import _mma, _mma_emulated, _stacked
from ..w4a16_gemm.kernel import _ld4


@triton.jit
def _unstacked(x, COUNT: tl.constexpr):
    """Inverse of ``_stacked``: the COUNT tensors joined into x, in order."""
    parts = (x,)
    for level in tl.static_range(COUNT.bit_length() - 1):
        nxt = ()
        for i in tl.static_range(len(parts)):
            lo, hi = tl.split(parts[i])
            nxt = nxt + (lo, hi)
        parts = nxt
    return parts   # level by level the splits come out in the order the joins took them


@triton.jit
def _e4m3_word(word, INTERPRET: tl.constexpr):
    """A word's 4 e4m3 bytes: GPU two f16x2 pairs (bytes 0-1, 2-3); interpreter 4 fp32 values."""
    if INTERPRET:
        vals = ()
        for i in tl.static_range(4):
            v = (word >> (8 * i)) & 0xFF
            s = tl.where((v >> 7) != 0, -1.0, 1.0)
            e = (v >> 3) & 0xF
            m = (v & 7).to(tl.float32)
            mag = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2(e.to(tl.float32) - 7.0))
            vals = vals + (s * mag,)
        return vals
    return tl.inline_asm_elementwise(
        "{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, $2;\n\tcvt.rn.f16x2.e4m3x2 $0, lo;\n\t"
        "cvt.rn.f16x2.e4m3x2 $1, hi;\n\t}", "=r,=r,r", [word], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _v_pairs(wa, wb, INTERPRET: tl.constexpr):
    """The 4 column pairs (token a, token b) of two words (4 columns each): GPU 4 f16x2 (PRMT + cvt); interpreter
    4 tuples (a, b) in fp32."""
    if INTERPRET:
        va = _e4m3_word(wa, True)
        vb = _e4m3_word(wb, True)
        return (va[0], vb[0]), (va[1], vb[1]), (va[2], vb[2]), (va[3], vb[3])
    return tl.inline_asm_elementwise(
        "{\n\t.reg .b32 t0, t1;\n\t.reg .b16 l0, h0, l1, h1;\n\tprmt.b32 t0, $4, $5, 0x5140;\n\t"
        "prmt.b32 t1, $4, $5, 0x7362;\n\tmov.b32 {l0, h0}, t0;\n\tmov.b32 {l1, h1}, t1;\n\t"
        "cvt.rn.f16x2.e4m3x2 $0, l0;\n\tcvt.rn.f16x2.e4m3x2 $1, h0;\n\tcvt.rn.f16x2.e4m3x2 $2, l1;\n\t"
        "cvt.rn.f16x2.e4m3x2 $3, h1;\n\t}", "=r,=r,=r,=r,r,r", [wa, wb],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _f16_pair(lo, hi, INTERPRET: tl.constexpr):
    """Two fp32 values as one f16x2 (GPU) or as the fp16-rounded fp32 pair (interpreter)."""
    if INTERPRET:
        return lo.to(tl.float16).to(tl.float32), hi.to(tl.float16).to(tl.float32)
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _quad(x, MAX: tl.constexpr, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Max (or sum) over the 4 lanes of each quad, in every lane."""
    if INTERPRET:
        y = tl.reshape(x, (W * 8, 4))
        red = tl.max(y, axis=1) if MAX else tl.sum(y, axis=1)
        return tl.reshape(tl.broadcast_to(red[:, None], (W * 8, 4)), (W * 32,))
    op: tl.constexpr = "max.f32" if MAX else "add.f32"
    return tl.inline_asm_elementwise(
        "{\n\t.reg .f32 t;\n\tshfl.sync.bfly.b32 t, $1, 1, 0x1f, 0xffffffff;\n\t" + op + " $0, $1, t;\n\t"
        "shfl.sync.bfly.b32 t, $0, 2, 0x1f, 0xffffffff;\n\t" + op + " $0, $0, t;\n\t}",
        "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mma16(a, b, acc, W: tl.constexpr, INTERPRET: tl.constexpr):
    """One m16n8k16 (f16 in, fp32 out). a: (row r k-lo, row r+8 k-lo, row r k-hi, row r+8 k-hi), b: (k-lo, k-hi)
    as f16x2 (GPU) or fp32 pairs (interpreter)."""
    if INTERPRET:
        top = (a[0][0], a[0][1], a[2][0], a[2][1])
        bot = (a[1][0], a[1][1], a[3][0], a[3][1])
        bb = (b[0][0], b[0][1], b[1][0], b[1][1])
        return _mma_emulated(top, bot, bb, acc, W)
    return _mma(a[0], a[1], a[2], a[3], b[0], b[1], acc[0], acc[1], acc[2], acc[3], tl.float16)


@triton.jit
def _tile_page(bt_row, tile, n_tiles, TILE: tl.constexpr, PAGE: tl.constexpr):
    """The page (int64) holding tile ``tile``, clamped to the sequence's last tile (page 0 for an empty sequence):
    a prefetch past the end re-reads a page it does not use."""
    t = tl.maximum(tl.minimum(tile, n_tiles - 1), 0)
    return tl.load(bt_row + t * TILE // PAGE, mask=n_tiles > 0, other=0).to(tl.int64)


@triton.jit
def _tile_loads(kv_ptr, sc_ptr, page, tile, n_tiles, seq, r, c, w, stride_kp, stride_kr, stride_sp, stride_sr,
                TILE: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr):
    """The K words and token scales of tile ``tile`` (clamped as in :func:`_tile_page`) that lane (r, c) of warp w
    needs: words[9 (2u + n) + j] = k-step j of n-tile n in sub-tile u (tokens 16u + 8n + r: latent 128w + 32c + 4j
    .. + 3 for j < 8, rope 512 + 16w + 4c .. + 3 for j = 8); scales[4u + i] = token 16u + 2c + i % 2 + 8 (i // 2)
    (the lane's score columns). Tokens past the end re-read the last one."""
    KS: tl.constexpr = TILE // 16
    t0 = tl.maximum(tl.minimum(tile, n_tiles - 1), 0) * TILE
    kv_page = kv_ptr + page * stride_kp
    sc_page = sc_ptr + page * stride_sp
    slot0 = t0 % PAGE
    last = tl.maximum(seq - 1 - t0, 0)
    words = ()
    for u in tl.static_range(KS):
        for n in tl.static_range(2):
            row = kv_page + (slot0 + tl.minimum(16 * u + 8 * n + r, last)) * stride_kr
            if INTERPRET:
                lat = ()
                for i in tl.static_range(8):
                    lat = lat + (tl.load(row + 32 * w + 8 * c + i),)
            else:
                lat = _ld4(row + 32 * w + 8 * c) + _ld4(row + 32 * w + 8 * c + 4)
            words = words + lat + (tl.load(row + 128 + 4 * w + c),)
    scales = ()
    for u in tl.static_range(KS):
        for i in tl.static_range(4):
            slot = slot0 + tl.minimum(16 * u + 2 * c + (i % 2) + 8 * (i // 2), last)
            scales = scales + (tl.load(sc_page + slot * stride_sr),)
    return words, scales


@triton.jit
def _v_loads(kv_ptr, page, tile, seq, r, c, w, stride_kp, stride_kr, TILE: tl.constexpr, PAGE: tl.constexpr,
             INTERPRET: tl.constexpr):
    """V of tile ``tile`` (in the sequence) for lane (r, c) of warp w: vw[4u + i] = latent columns 128w + 16r ..
    + 15 (4 words) of token 16u + 2c + i % 2 + 8 (i // 2). The bytes K read: L1 hits."""
    KS: tl.constexpr = TILE // 16
    t0 = tile * TILE
    kv_page = kv_ptr + page * stride_kp
    slot0 = t0 % PAGE
    last = seq - 1 - t0
    vw = ()
    for u in tl.static_range(KS):
        for i in tl.static_range(4):
            vp = kv_page + (slot0 + tl.minimum(16 * u + 2 * c + (i % 2) + 8 * (i // 2), last)) * stride_kr + 32 * w \
                + 4 * r
            if INTERPRET:
                vw = vw + ((tl.load(vp), tl.load(vp + 1), tl.load(vp + 2), tl.load(vp + 3)),)
            else:
                vw = vw + (_ld4(vp),)
    return vw


@triton.jit
def _stacked_flat(vals, COUNT: tl.constexpr):
    """The COUNT (a power of two) tensors of ``vals`` joined so that ``tl.reshape(x, (T, COUNT))`` lists them in order:
    each level joins i with i + half (``_stacked`` joins neighbours, which reverses the bits of the flat index)."""
    out = vals
    for level in tl.static_range(COUNT.bit_length() - 1):
        pairs = ()
        for i in tl.static_range(len(out) // 2):
            pairs = pairs + (tl.join(out[i], out[i + len(out) // 2]),)
        out = pairs
    return out[0]


@triton.jit
def _mla_frag_kernel(q_ptr, kv_ptr, sc_ptr, bt_ptr, seq_ptr, o_ptr, lse_ptr, sm_scale_log2, S_Q, H, NUM_SPLITS,
                     stride_qb, stride_qs, stride_qh, stride_kp, stride_kr, stride_sp, stride_sr, stride_bt,
                     PAGE: tl.constexpr, INTERPRET: tl.constexpr, W: tl.constexpr = 4, TILE: tl.constexpr = 16,
                     PREFETCH: tl.constexpr = True):
    """q [B, S_Q, H, 576] (S_Q · H <= 16 rows); kv int32 words [pages, PAGE, 144] (the e4m3 bytes); sc fp32 token
    scales [pages, PAGE] (strides 0 for one per-tensor scale); o fp32 [B, NUM_SPLITS, M, 512] partials, lse fp32
    [B, NUM_SPLITS, M] (log2), M = S_Q · H. TILE: tokens per softmax step (16 or 32; PAGE % TILE == 0). PREFETCH:
    the next tile's K words and scales are loaded before this tile's math (and the page of the one after), so
    their latency overlaps it; otherwise they are loaded at the top of their own step."""
    tl.static_assert(W == 4, "4 warps: 128 latent columns each")
    T: tl.constexpr = 32 * W
    pid_split, b = tl.program_id(0), tl.program_id(1)
    idx = tl.arange(0, T)
    lane = idx % 32
    w = idx // 32
    r = lane // 4
    c = lane % 4
    M = S_Q * H
    seq = tl.load(seq_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # rows r and r + 8: their query pointer and causal limit (tokens < limit)
    row_lo, row_hi = r, r + 8
    ok_lo, ok_hi = row_lo < M, row_hi < M
    q_lo = q_ptr + b.to(tl.int64) * stride_qb + (row_lo // H) * stride_qs + (row_lo % H) * stride_qh
    q_hi = q_ptr + b.to(tl.int64) * stride_qb + (row_hi // H) * stride_qs + (row_hi % H) * stride_qh
    lim_lo = seq - S_Q + 1 + row_lo // H
    lim_hi = seq - S_Q + 1 + row_hi // H
    # q A-fragments of the warp's columns: k-step j < 8 latent 128w + 32c + 4j, k-step 8 rope 512 + 16w + 4c
    qa = ()
    for j in tl.static_range(9):
        col = 128 * w + 32 * c + 4 * j if j < 8 else 512 + 16 * w + 4 * c
        v = ()
        for qp in tl.static_range(2):   # row r / r + 8
            base = q_lo if qp == 0 else q_hi
            okq = ok_lo if qp == 0 else ok_hi
            x0 = tl.load(base + col, mask=okq, other=0.0).to(tl.float32) * sm_scale_log2   # scores in log2 units
            x1 = tl.load(base + col + 1, mask=okq, other=0.0).to(tl.float32) * sm_scale_log2
            x2 = tl.load(base + col + 2, mask=okq, other=0.0).to(tl.float32) * sm_scale_log2
            x3 = tl.load(base + col + 3, mask=okq, other=0.0).to(tl.float32) * sm_scale_log2
            v = v + (_f16_pair(x0, x1, INTERPRET), _f16_pair(x2, x3, INTERPRET))
        qa = qa + ((v[0], v[2], v[1], v[3]),)     # (r k-lo, r+8 k-lo, r k-hi, r+8 k-hi)
    # this split's tiles of TILE tokens (KS sub-tiles of 16: one k-step of the PV MMAs each)
    KS: tl.constexpr = TILE // 16
    COUNT: tl.constexpr = 8 * KS     # score values per lane and tile
    n_tiles = tl.cdiv(seq, TILE)
    per = tl.cdiv(n_tiles, NUM_SPLITS)
    t_lo = pid_split * per
    t_hi = tl.minimum(t_lo + per, n_tiles)
    zero = tl.zeros((T,), dtype=tl.float32)
    m_lo = zero - float("inf")
    m_hi = zero - float("inf")
    l_lo = zero
    l_hi = zero
    acc = ()
    for j in tl.static_range(64):
        acc = acc + (zero,)
    # PAGE % TILE == 0: a tile's tokens share one page (one block-table read per tile, one tile ahead)
    page = _tile_page(bt_row, t_lo, n_tiles, TILE, PAGE)
    page_next = _tile_page(bt_row, t_lo + 1, n_tiles, TILE, PAGE)
    if PREFETCH:
        words_next, scl_next = _tile_loads(kv_ptr, sc_ptr, page, t_lo, n_tiles, seq, r, c, w, stride_kp, stride_kr,
                                           stride_sp, stride_sr, TILE, PAGE, INTERPRET)
    for tile in range(t_lo, t_hi):
        t0 = tile * TILE
        if PREFETCH:   # this tile's bytes arrived during the last step; issue the next tile's now
            words, scl = words_next, scl_next
            words_next, scl_next = _tile_loads(kv_ptr, sc_ptr, page_next, tile + 1, n_tiles, seq, r, c, w, stride_kp,
                                               stride_kr, stride_sp, stride_sr, TILE, PAGE, INTERPRET)
        else:
            words, scl = _tile_loads(kv_ptr, sc_ptr, page, tile, n_tiles, seq, r, c, w, stride_kp, stride_kr,
                                     stride_sp, stride_sr, TILE, PAGE, INTERPRET)
        vw = _v_loads(kv_ptr, page, tile, seq, r, c, w, stride_kp, stride_kr, TILE, PAGE, INTERPRET)
        page = page_next
        page_next = _tile_page(bt_row, tile + 2, n_tiles, TILE, PAGE)
        # --- scores of this warp's columns: sub-tile u, n-tile n = tokens t0 + 16u + 8n + r
        s_part = ()
        for u in tl.static_range(KS):
            for n in tl.static_range(2):
                s4 = (zero, zero, zero, zero)
                for j in tl.static_range(9):
                    kv = _e4m3_word(words[9 * (2 * u + n) + j], INTERPRET)
                    if INTERPRET:
                        bb = ((kv[0], kv[1]), (kv[2], kv[3]))
                    else:
                        bb = (kv[0], kv[1])
                    s4 = _mma16(qa[j], bb, s4, W, INTERPRET)
                s_part = s_part + s4
        # --- the four warps' partial scores summed (each warp gets the whole S)
        stacked = _stacked(s_part, COUNT)
        total = tl.sum(tl.reshape(stacked, (W, 32, COUNT)), axis=0)
        s = _unstacked(tl.reshape(tl.broadcast_to(total[None, :, :], (W, 32, COUNT)), stacked.shape), COUNT)
        # s[8u + 4n + q]: sub-tile u, n-tile n, q -> (row r: q 0, 1 / row r+8: q 2, 3), token 16u + 8n + 2c + q % 2
        sv = ()
        for u in tl.static_range(KS):
            for n in tl.static_range(2):
                for qq in tl.static_range(4):
                    lim = lim_lo if qq < 2 else lim_hi
                    tk = t0 + 16 * u + 8 * n + 2 * c + qq % 2
                    val = s[8 * u + 4 * n + qq] * scl[4 * u + 2 * n + qq % 2]
                    sv = sv + (tl.where(tk < lim, val, float("-inf")),)
        # --- online softmax per row (r: the q < 2 entries; r+8: q >= 2)
        mx_lo = sv[0]
        mx_hi = sv[2]
        for k in tl.static_range(COUNT):
            if k % 4 < 2:
                mx_lo = tl.maximum(mx_lo, sv[k])
            else:
                mx_hi = tl.maximum(mx_hi, sv[k])
        mx_lo = _quad(mx_lo, True, W, INTERPRET)
        mx_hi = _quad(mx_hi, True, W, INTERPRET)
        new_lo = tl.maximum(m_lo, mx_lo)
        new_hi = tl.maximum(m_hi, mx_hi)
        use_lo = tl.where(new_lo == float("-inf"), 0.0, new_lo)
        use_hi = tl.where(new_hi == float("-inf"), 0.0, new_hi)
        a_lo = tl.exp2(m_lo - use_lo)
        a_hi = tl.exp2(m_hi - use_hi)
        p = ()
        sum_lo = zero
        sum_hi = zero
        for k in tl.static_range(COUNT):
            if k % 4 < 2:
                pk = tl.exp2(sv[k] - use_lo)
                sum_lo += pk
            else:
                pk = tl.exp2(sv[k] - use_hi)
                sum_hi += pk
            p = p + (pk,)
        l_lo = l_lo * a_lo + _quad(sum_lo, False, W, INTERPRET)
        l_hi = l_hi * a_hi + _quad(sum_hi, False, W, INTERPRET)
        m_lo, m_hi = new_lo, new_hi
        # P (A of PV) per sub-tile, value scales folded in: k-lo = tokens 2c, 2c+1 (n-tile 0), k-hi = 8 + 2c, 9 + 2c
        pa = ()
        for u in tl.static_range(KS):
            pa = pa + ((_f16_pair(p[8 * u] * scl[4 * u], p[8 * u + 1] * scl[4 * u + 1], INTERPRET),
                        _f16_pair(p[8 * u + 2] * scl[4 * u], p[8 * u + 3] * scl[4 * u + 1], INTERPRET),
                        _f16_pair(p[8 * u + 4] * scl[4 * u + 2], p[8 * u + 5] * scl[4 * u + 3], INTERPRET),
                        _f16_pair(p[8 * u + 6] * scl[4 * u + 2], p[8 * u + 7] * scl[4 * u + 3], INTERPRET)),)
        new = ()
        for qw in tl.static_range(4):              # word qw: n-tiles 4 qw .. 4 qw + 3
            pairs = ()
            for u in tl.static_range(KS):          # tokens (2c, 2c+1) and (2c+8, 2c+9) of sub-tile u, paired
                pairs = pairs + ((_v_pairs(vw[4 * u][qw], vw[4 * u + 1][qw], INTERPRET),
                                  _v_pairs(vw[4 * u + 2][qw], vw[4 * u + 3][qw], INTERPRET)),)
            for jj in tl.static_range(4):
                a4 = (acc[16 * qw + 4 * jj] * a_lo, acc[16 * qw + 4 * jj + 1] * a_lo,
                      acc[16 * qw + 4 * jj + 2] * a_hi, acc[16 * qw + 4 * jj + 3] * a_hi)
                for u in tl.static_range(KS):
                    a4 = _mma16(pa[u], (pairs[u][0][jj], pairs[u][1][jj]), a4, W, INTERPRET)
                new = new + a4
        acc = new
    # --- epilogue: o = acc / l, lse2 = m + log2 l (partials of this split). n-tile j of the lane holds columns
    # 128w + 32c + j (acc[4j], acc[4j + 2]) and + 16 (acc[4j + 1], acc[4j + 3]): a row's 32 columns 128w + 32c ..
    # are the lane's own, stored as one contiguous run (vector stores)
    e_lo = l_lo == 0.0
    e_hi = l_hi == 0.0
    d_lo = tl.where(e_lo, 1.0, l_lo)
    d_hi = tl.where(e_hi, 1.0, l_hi)
    base = (b * NUM_SPLITS + pid_split).to(tl.int64) * M
    run = tl.arange(0, 32)[None, :]
    for half in tl.static_range(2):   # row r (acc[4j], acc[4j + 1]) / row r + 8 (acc[4j + 2], acc[4j + 3])
        vals = ()
        for j in tl.static_range(32):
            vals = vals + (acc[4 * (j % 16) + 2 * half + j // 16],)
        d = d_lo if half == 0 else d_hi
        row = row_lo if half == 0 else row_hi
        ok = ok_lo if half == 0 else ok_hi
        out = tl.reshape(_stacked_flat(vals, 32), (T, 32)) / d[:, None]
        offs = (base + row) * 512 + 128 * w + 32 * c
        tl.store(o_ptr + offs[:, None] + run, out, mask=ok[:, None])
    first = (w == 0) & (c == 0)
    tl.store(lse_ptr + base + row_lo, tl.where(e_lo, float("-inf"), m_lo + tl.log2(d_lo)), mask=first & ok_lo)
    tl.store(lse_ptr + base + row_hi, tl.where(e_hi, float("-inf"), m_hi + tl.log2(d_hi)), mask=first & ok_hi)
