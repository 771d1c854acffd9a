"""Triton kernels for absorbed MLA decode over paged latents (split-K / flash-decoding).

One program per (head block, KV split, request). The latent tile of BLOCK_N tokens is loaded once and used
by every head of the block twice: as K (scores = q_abs·latentᵀ + q_pe·k_peᵀ) and as V (out += p·latent) —
the point of MLA's absorbed form (with QK_SPLIT_LOAD, the score dot re-reads the tile transposed, from L2). FP8 pages are dequantized in registers right after the load: e4m3 → the
dot dtype, with a per-token scale folded into the score column and into p (never multiplied into K), a
per-tensor scale folded into the softmax scale and the output, and fp8_ds_mla's per-128 tile scales
multiplied in (power-of-two, so exact). Scores are kept in the log2 domain (exp2).

FP8_BITCAST (off by default; ``mla_decode(..., fp8_dequant="bitcast")``) replaces the conversion of FP8 tiles
by integer ops on 32-bit words (two 16-bit images per op): the e4m3 bits, shifted and masked, *are* the bf16
(or fp16) of the same value times 2^-120 (2^-8) — exact for every e4m3 number, subnormals included, because the
e4m3 exponent field lands in the low bits of the 16-bit exponent field (_load_e4m3_16). The 2^120 and every KV
scale go into the fp32 scores and into p, never into the tile: q and p are pre-multiplied by 2^64 (exact) so
the dots' products stay far from fp32 underflow, and the remaining 2^56 is folded into the score scale and the
output. fp8_ds_mla's tile scales are applied by batched dots over the D_LAT/128 tiles (scores:
Σ_t scale_t·(q_t·k_tᵀ); output: one [M, 128] accumulator per tile fed p·scale_t).

F16_DOTS (``fp8_dequant="fp16"``, 16-bit queries) converts FP8 tiles to fp16 dot operands instead (e4m3 ⊂ fp16: one
packed conversion per two values): q rows are pre-scaled by powers of two into [2^14, 2^15), p·scale/(the tile's
largest scale) by 2^15, and the accumulator is kept in units of that tile factor (the ratio joins alpha).
PREFETCH loads the next tile's bytes one iteration ahead into registers (docs/mla.md, "fp16 dot operands").
"""
import triton
import triton.language as tl

from .._triton_utils import cast_fp8_saturating, grid_dependency_sync, reciprocal, rint, sm_id, timeline_stamp

# how the latent part of a row is scaled (mirrors kv_layout.py)
SCALE_NONE = tl.constexpr(0)    # bf16
SCALE_TOKEN = tl.constexpr(1)   # fp8_e4m3, one fp32 per row (latent and rope)
SCALE_TENSOR = tl.constexpr(2)  # fp8_e4m3, one fp32 for the layer
SCALE_TILE = tl.constexpr(3)    # fp8_ds_mla, one fp32 per 128 latent values; rope is bf16
LN2 = tl.constexpr(0.6931471805599453)
# FP8_BITCAST: with bf16 lanes holding value·2^-120 (exponent biases 127 vs 7), q and p are pre-multiplied by
# 2^64 (exact) so the dots return (true value)·2^-56, undone by 2^56 on the fp32 scores / output. fp16 lanes
# hold value·2^-8 (biases 15 vs 7): nothing is pre-multiplied (fp16 could not hold it), 2^8 is undone.
BITCAST_PRE_BF16 = tl.constexpr(2.0 ** 64)
BITCAST_UNSCALE_BF16 = tl.constexpr(2.0 ** 56)
BITCAST_UNSCALE_FP16 = tl.constexpr(2.0 ** 8)
# F16_DOTS: p·(scale / tile max) is scaled to [0, 2^15] before its fp16 rounding (undone on the accumulator)
F16_TOP = tl.constexpr(2.0 ** 15)
F16_UNTOP = tl.constexpr(2.0 ** -15)
# FP8_MMA == 2: p·(scale / tile max) is scaled to [0, 2^8] before its e4m3 rounding (≤ 448: no saturation; e4m3
# subnormals reach 2^-9, so p down to 2^-17 of the tile's largest keeps a nonzero image)
P8_TOP = tl.constexpr(2.0 ** 8)
# FP8_MMA ≥ 3: q's residual after its e4m3 rounding, times 2^4, rounded to e4m3 again (≤ 16·16 = 256 < 448)
Q_LO_SCALE = tl.constexpr(16.0)
Q_LO_UNSCALE = tl.constexpr(1.0 / 16.0)
P8_UNTOP = tl.constexpr(2.0 ** -8)


@triton.jit
def _round_e4m3(x, f8_ty: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 x (finite, |x| ≤ 448) rounded to e4m3 (nearest, ties to even), as f8_ty. The interpreter's fp32 -> e4m3
    cast rounds wrongly (DESIGN.md), so it gets the rounding in fp32: x / ulp rounded to an integer, times the ulp
    of x's binade (2^(e-3); 2^-9 for e4m3's subnormals), both powers of two (exact)."""
    if INTERPRET:
        e = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)   # biased fp32 exponent, ≥ 2^-6's
        ulp = ((e - 3) << 23).to(tl.float32, bitcast=True)
        inv_ulp = ((257 - e) << 23).to(tl.float32, bitcast=True)         # 2^(3 - (e - 127))
        return tl.minimum(tl.maximum(rint(x * inv_ulp) * ulp, -448.0), 448.0).to(f8_ty)
    else:
        return cast_fp8_saturating(x).to(f8_ty)


@triton.jit
def _split_e4m3(x, f8_ty: tl.constexpr, LO: tl.constexpr, INTERPRET: tl.constexpr):
    """x (fp32, |x| ≤ 448) -> (hi, lo) as f8_ty holding e4m3 values: hi = e4m3(x), lo = e4m3((x - hi)·16)
    (x ≈ hi + lo/16: relative error ~2^-8 instead of e4m3's 2^-4); lo = hi when not LO (unused)."""
    hi = _round_e4m3(x, f8_ty, INTERPRET)
    if LO:
        lo = _round_e4m3((x - hi.to(tl.float32)) * Q_LO_SCALE, f8_ty, INTERPRET)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _widen_16(bits, TO_FP16: tl.constexpr, TO_F32: tl.constexpr):
    """int16 bit images -> bf16 / fp16 (TO_FP16), or fp32 exactly (TO_F32: fp32 dots; a bf16 image by a 16-bit
    shift, since the interpreter's bf16 -> fp32 conversion mangles bf16 subnormals)."""
    if TO_FP16:
        return bits.to(tl.float16, bitcast=True).to(tl.float32 if TO_F32 else tl.float16)
    elif TO_F32:
        return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def _load_e4m3_16(rows, tok_ok, D: tl.constexpr, BLOCK_N: tl.constexpr, TO_FP16: tl.constexpr,
                  TO_F32: tl.constexpr):
    """D e4m3 bytes from each of the BLOCK_N rows (8-bit pointers, 4-byte aligned; masked rows are not read)
    -> [BLOCK_N, D] bf16 holding value·2^-120 (TO_FP16: fp16 holding value·2^-8). Exact for every finite e4m3
    value, subnormals and ±0 included: the 7 exponent+mantissa bits are moved under the 16-bit format's
    exponent LSBs (e4m3 subnormals land on bf16/fp16 subnormals) and the sign to bit 15. The bytes are read as
    int32 words and each word gives two 32-bit words of two images each with 32-bit integer ops (shift + mask,
    ~2 ops per value) — no per-byte widening op, which Triton would sink past the shared-memory round trip of
    the dot operands (byte-wise shared loads). (e4m3's NaN bytes 0x7F/0xFF map to finite values: used slots never
    hold NaN, masked slots are never read.)"""
    j = tl.arange(0, D // 4)
    w = tl.load(rows.to(tl.pointer_type(tl.int32))[:, None] + j[None, :], mask=tok_ok[:, None], other=0)
    return _e4m3_words_16(w, D, BLOCK_N, TO_FP16, TO_F32)


@triton.jit
def _e4m3_words_16(w, D: tl.constexpr, BLOCK_N: tl.constexpr, TO_FP16: tl.constexpr, TO_F32: tl.constexpr):
    """int32 words [BLOCK_N, D/4] holding D e4m3 bytes per row -> their 16-bit images (_load_e4m3_16)."""
    # w = bytes b0..b3 (columns 4j..4j+3); `ev` = images of (b0, b2) in its 16-bit halves, `od` = of (b1, b3)
    if TO_FP16:  # sign -> bit 15 of the half, magnitude bits 0..6 -> 7..13
        ev = ((w << 7) & 0x3F803F80) | ((w << 8) & -0x7FFF8000)  # -0x7FFF8000 = 0x80008000 (the sign bits)
        od = ((w >> 1) & 0x3F803F80) | (w & -0x7FFF8000)
    else:        # sign -> bit 15 of the half, magnitude bits 0..6 -> 4..10
        ev = ((w << 4) & 0x07F007F0) | ((w << 8) & -0x7FFF8000)
        od = ((w >> 4) & 0x07F007F0) | (w & -0x7FFF8000)
    ev = tl.join(ev.to(tl.int16), (ev >> 16).to(tl.int16))  # [N, D/4, 2]: columns 4j, 4j+2
    od = tl.join(od.to(tl.int16), (od >> 16).to(tl.int16))  # columns 4j+1, 4j+3
    bits = tl.reshape(tl.join(ev, od), (BLOCK_N, D))         # [j, a, b] -> column 4j + 2a + b
    return _widen_16(bits, TO_FP16, TO_F32)


@triton.jit
def _load_latent_tile(lat_rows, sc_rows, tok_ok, d_lat, TRANSPOSED: tl.constexpr, SCALE_MODE: tl.constexpr,
                      D_LAT: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, dot_ty: tl.constexpr,
                      BITCAST: tl.constexpr = False, TO_FP16: tl.constexpr = False):
    """The latent part of BLOCK_N rows as a dot operand: [BLOCK_N, D_LAT] or, TRANSPOSED, [D_LAT, BLOCK_N].
    Masked rows (past seq_len) are never read. fp8_ds_mla tiles are multiplied by their power-of-two scales.
    BITCAST (FP8 only): the 16-bit image of the bytes (value·2^-120 or ·2^-8, _load_e4m3_16), no scale applied."""
    if BITCAST:  # (TRANSPOSED: the same load, transposed in registers)
        k = _load_e4m3_16(lat_rows, tok_ok, D_LAT, BLOCK_N, TO_FP16, dot_ty == tl.float32)
        if TRANSPOSED:
            k = tl.trans(k)
        return k
    if TRANSPOSED:
        k = tl.load(lat_rows[None, :] + d_lat[:, None], mask=tok_ok[None, :], other=0.0)
    else:
        k = tl.load(lat_rows[:, None] + d_lat[None, :], mask=tok_ok[:, None], other=0.0)
    if SCALE_MODE == SCALE_TILE:
        NT: tl.constexpr = D_LAT // TILE
        tiles = tl.arange(0, NT)
        if TRANSPOSED:
            sc = tl.load(sc_rows[None, :] + tiles[:, None], mask=tok_ok[None, :], other=0.0)      # [NT, N]
            k = tl.reshape(tl.reshape(k.to(tl.float32), (NT, TILE, BLOCK_N)) * sc[:, None, :], (D_LAT, BLOCK_N))
        else:
            sc = tl.load(sc_rows[:, None] + tiles[None, :], mask=tok_ok[:, None], other=0.0)      # [N, NT]
            k = tl.reshape(tl.reshape(k.to(tl.float32), (BLOCK_N, NT, TILE)) * sc[:, :, None], (BLOCK_N, D_LAT))
    return k.to(dot_ty)


@triton.jit
def _tile_rows(n0, end, bt_row, lat_ptr, rope_ptr, scale_ptr, stride_lat_page, stride_lat_row, stride_rope_page,
               stride_rope_row, stride_sc_page, stride_sc_row, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_PAGE: tl.constexpr, page_given=0, GIVEN: tl.constexpr = False):
    """Row pointers of the tile of BLOCK_N tokens at n0 (tokens ≥ end masked). MASK_PAGE: the tile may lie past
    the block table's used entries (a prefetch one tile ahead), so the one-page lookup is masked too. GIVEN: the
    tile lies in page ``page_given`` (looked up by the caller)."""
    toks = n0 + tl.arange(0, BLOCK_N)
    tok_ok = toks < end
    if GIVEN:
        page = page_given.to(tl.int64)
    elif PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one block-table lookup
        if MASK_PAGE:
            page = tl.load(bt_row + n0 // PAGE_SIZE, mask=n0 < end, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + n0 // PAGE_SIZE).to(tl.int64)
    else:
        page = tl.load(bt_row + toks // PAGE_SIZE, mask=tok_ok, other=0).to(tl.int64)
    slot = toks % PAGE_SIZE
    lat_rows = lat_ptr + page * stride_lat_page + slot * stride_lat_row
    rope_rows = rope_ptr + page * stride_rope_page + slot * stride_rope_row
    sc_rows = scale_ptr + page * stride_sc_page + slot * stride_sc_row
    return tok_ok, lat_rows, rope_rows, sc_rows


@triton.jit
def _load_tile_raw(lat_rows, rope_rows, sc_rows, tok_ok, d_lat, d_rope, SCALE_MODE: tl.constexpr,
                   D_LAT: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The stored bytes of a tile, unconverted: latent [N, D_LAT], rope [N, D_ROPE] (page dtype) and its scales
    (SCALE_TOKEN: [N]; SCALE_TILE: [N, D_LAT/TILE]; else zeros [N]). Masked rows are not read (0)."""
    k = tl.load(lat_rows[:, None] + d_lat[None, :], mask=tok_ok[:, None], other=0.0)
    k_pe = tl.load(rope_rows[:, None] + d_rope[None, :], mask=tok_ok[:, None], other=0.0)
    if SCALE_MODE == SCALE_TILE:
        NT: tl.constexpr = D_LAT // TILE
        sc = tl.load(sc_rows[:, None] + tl.arange(0, NT)[None, :], mask=tok_ok[:, None], other=0.0)
    elif SCALE_MODE == SCALE_TOKEN:
        sc = tl.load(sc_rows, mask=tok_ok, other=0.0)
    else:
        sc = tl.zeros([BLOCK_N], tl.float32)
    return k, k_pe, sc


@triton.jit
def _mla_decode_kernel(
    q_ptr, lat_ptr, rope_ptr, scale_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr, lat_desc, rope_desc,
    sm_scale_log2, S_Q, H, NUM_SPLITS,
    stride_qb, stride_qs, stride_qh,
    stride_lat_page, stride_lat_row, stride_rope_page, stride_rope_row, stride_sc_page, stride_sc_row,
    stride_bt,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, SCALE_MODE: tl.constexpr,
    TILE: tl.constexpr, SPLIT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_SPLIT_LOAD: tl.constexpr, FP8_BITCAST: tl.constexpr = False,
    F16_DOTS: tl.constexpr = False, PREFETCH: tl.constexpr = False, FP8_MMA: tl.constexpr = 0,
    PDL: tl.constexpr = False, TMA: tl.constexpr = False, PROBE: tl.constexpr = False, probe_ptr=None,
):
    """QK_SPLIT_LOAD: load the tile a second time, transposed, for the score dot (more L2 traffic, fewer
    registers when FP8 tiles are converted for two dots); otherwise one load feeds both dots.
    FP8_BITCAST: FP8 tiles become dot operands by integer ops, scales applied to scores and p (module doc);
    no effect on BF16 pages. fp8_ds_mla then runs batched per-128-tile dots (QK_SPLIT_LOAD is ignored).
    F16_DOTS (FP8 pages, 16-bit queries): converted tiles are fp16 dot operands (e4m3 ⊂ fp16: one packed
    conversion per two values), q rows pre-scaled by powers of two, p by 2^15·scale/(the tile's largest scale);
    QK_SPLIT_LOAD is ignored. PREFETCH (one-load path, not FP8_BITCAST): the next tile's bytes are loaded into
    registers one iteration ahead (loop-carried), hiding a load the pipeliner leaves synchronous.
    FP8_MMA (fp8_e4m3 pages; 0 off): the score dots take the e4m3 bytes as they are, with q rounded to e4m3 by a
    per-row scale (fp8 tensor-core dots, no conversion of K); the PV dot takes the bytes converted to fp16 with p
    as for F16_DOTS (1), or the bytes as they are with p·scale/(tile max)·2^8 rounded to e4m3 (2). QK_SPLIT_LOAD
    is ignored; fp8_ds_mla and bf16 pages run the usual kernel.
    TMA (bf16 / fp8_e4m3 pages, one-load path without PREFETCH, BLOCK_N dividing the page size): ``lat_desc`` /
    ``rope_desc`` are TMA descriptors over the pages as [pages·page_size, row width] rows with [BLOCK_N, D_LAT] /
    [BLOCK_N, D_ROPE] blocks (FP8_BITCAST with fewer than 64 rows: over the pages as int32 words, [BLOCK_N,
    D_LAT/4] / [BLOCK_N, D_ROPE/4], the words the bit trick converts). The split's full tiles below every row's
    causal limit are read through them (the pipeliner stages descriptor loads in shared memory; no masks), the
    rest with the masked pointer loads.
    PROBE (diagnostics, ``mla_decode.PROBE_BUFFER``): each program stores a timeline of int64 stamps at ``probe_ptr``
    + 16·(its linear id) (``timeline_stamp``: globaltimer ns and clock64 per slot; slot 7: its SM): 0 entry, 1 seq_len
    loaded, 2 the first chunk's page ids loaded, 3 the first tile's scores, 4 the TMA phase's loop done, 5 every tile
    done, 6 the outputs stored."""
    pid_m, pid_split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PROBE:
        stamps = probe_ptr + 16 * (pid_m + tl.num_programs(0) * (pid_split + NUM_SPLITS * b)).to(tl.int64)
        timeline_stamp(stamps, 0, pid_m)
    grid_dependency_sync(PDL)
    M = S_Q * H
    # query rows of this program: row = s·H + h over the S_Q speculative tokens and H heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    s_idx = rows // H
    h_idx = rows % H
    d_lat = tl.arange(0, D_LAT)
    d_rope = tl.arange(0, D_ROPE)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + s_idx * stride_qs + h_idx * stride_qh
    q_lat = tl.load(q_rows[:, None] + d_lat[None, :], mask=row_ok[:, None], other=0.0)        # [M, D_LAT]
    q_pe = tl.load(q_rows[:, None] + D_LAT + d_rope[None, :], mask=row_ok[:, None], other=0.0)  # [M, D_ROPE]
    dot_ty = q_ptr.dtype.element_ty
    if INTERPRET:  # the interpreter's bf16 dot is wrong: run the dots in fp32
        dot_ty = tl.float32
    # fp16 queries take fp16 images of the bytes (value·2^-8: no pre-scaling needed, and fp16 could not hold it);
    # fp16 with fp8_ds_mla keeps the conversion (p·tile scale in fp16 would lose small p to fp16 subnormals)
    TO_FP16: tl.constexpr = q_ptr.dtype.element_ty == tl.float16
    BITCAST: tl.constexpr = FP8_BITCAST and SCALE_MODE != SCALE_NONE and not (TO_FP16 and SCALE_MODE == SCALE_TILE)
    TILED: tl.constexpr = BITCAST and SCALE_MODE == SCALE_TILE  # tile scales: batched per-tile dots
    # 64-row blocks of fp8_e4m3 also take the batched dots: [NT, 64, 128] accumulators fit registers where a
    # [64, 512] wgmma accumulator spills (sm_90)
    BATCHED: tl.constexpr = TILED or (BITCAST and BLOCK_M >= 64 and D_LAT % TILE == 0)
    NT: tl.constexpr = D_LAT // TILE if BATCHED else 1
    MMA8: tl.constexpr = (FP8_MMA > 0 and not FP8_BITCAST
                          and (SCALE_MODE == SCALE_TOKEN or SCALE_MODE == SCALE_TENSOR))
    # fewer than 64 query rows: the transposed dots S^T = K·q^T and O^T += V^T·P^T put the tokens on the M side
    # (sm_90: an fp8 dot runs as wgmma only with M ≥ 64; Triton promotes an fp8 mma.sync to fp16 there)
    SWAP: tl.constexpr = MMA8 and BLOCK_M < 64
    Q_LO: tl.constexpr = MMA8 and FP8_MMA >= 3  # q's e4m3 residual as a second score dot (error 2^-4 -> ~2^-8)
    PV8: tl.constexpr = MMA8 and FP8_MMA % 2 == 0  # the PV dot in e4m3 too
    F16: tl.constexpr = (F16_DOTS and not FP8_BITCAST and SCALE_MODE != SCALE_NONE and not MMA8
                         and q_ptr.dtype.element_ty != tl.float32)
    # RAW: one load of the stored bytes feeds both dots, converted after the load (optionally prefetched)
    RAW: tl.constexpr = not BITCAST and (F16 or MMA8 or not QK_SPLIT_LOAD)
    f16_ty = tl.float32 if INTERPRET else tl.float16  # F16 dot operands (rounded to fp16 either way)
    f8_ty = tl.float32 if INTERPRET else tl.float8e4nv  # FP8_MMA dot operands (rounded to e4m3 either way)
    if BITCAST:  # dots return (true value)·2^-56 (fp16: 2^-8); `unscale` goes into the scores and the output
        if TO_FP16:
            pre = 1.0
            unscale = BITCAST_UNSCALE_FP16
        else:
            pre = BITCAST_PRE_BF16
            unscale = BITCAST_UNSCALE_BF16
        q_lat = (q_lat.to(tl.float32) * pre).to(dot_ty)
        if SCALE_MODE != SCALE_TILE:  # fp8_ds_mla's rope is bf16: its q stays as is
            q_pe = (q_pe.to(tl.float32) * pre).to(dot_ty)
    if F16:  # each row times 2^e, its largest |q| landing in [2^14, 2^15) (fp16 holds bf16's 8 bits exactly there)
        amax = tl.max(tl.abs(q_lat.to(tl.float32)), 1)
        if SCALE_MODE != SCALE_TILE:  # fp8_ds_mla's rope is bf16: its dot stays in q's dtype
            amax = tl.maximum(amax, tl.max(tl.abs(q_pe.to(tl.float32)), 1))
        ex = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)  # biased exponent
        q_up = ((268 - ex) << 23).to(tl.float32, bitcast=True)    # 2^(141 - ex)
        q_down = ((ex - 14) << 23).to(tl.float32, bitcast=True)   # 2^(ex - 141), normal for ex in [15, 254]
        q_lat = (q_lat.to(tl.float32) * q_up[:, None]).to(tl.float16).to(f16_ty)
        if SCALE_MODE != SCALE_TILE:
            q_pe = (q_pe.to(tl.float32) * q_up[:, None]).to(tl.float16).to(f16_ty)
        u_prev = sm_scale_log2 * 0.0 + 1.0  # fp32 scalar: the accumulator holds (true value) / u_prev
    elif MMA8:  # q ≈ (hi + lo/16)·q_sc per row, hi and lo e4m3, the row's largest |q| (latent and rope) at 448
        amax = tl.maximum(tl.max(tl.abs(q_lat.to(tl.float32)), 1), tl.max(tl.abs(q_pe.to(tl.float32)), 1))
        q_sc = tl.where(amax > 0.0, amax / 448.0, 1.0)  # [M] (rows of zeros: any scale)
        q_inv = reciprocal(q_sc)
        q_lat, q_lat_lo = _split_e4m3(q_lat.to(tl.float32) * q_inv[:, None], f8_ty, Q_LO, INTERPRET)
        q_pe, q_pe_lo = _split_e4m3(q_pe.to(tl.float32) * q_inv[:, None], f8_ty, Q_LO, INTERPRET)
        if SWAP:  # [D, M]: the B operands of S^T = K·q^T
            q_lat = tl.trans(q_lat)
            q_pe = tl.trans(q_pe)
            q_lat_lo = tl.trans(q_lat_lo)
            q_pe_lo = tl.trans(q_pe_lo)
        u_prev = sm_scale_log2 * 0.0 + 1.0
    else:
        q_lat = q_lat.to(dot_ty)
    if not (F16 or MMA8) or SCALE_MODE == SCALE_TILE:
        q_pe = q_pe.to(dot_ty)
    if BATCHED:  # [NT, M, TILE]: one batch entry per 128-column tile
        q_lat = tl.permute(tl.reshape(q_lat, (BLOCK_M, NT, TILE)), (1, 0, 2))

    seq_len = tl.load(seq_lens_ptr + b)
    if PROBE:
        timeline_stamp(stamps, 1, seq_len)
    limit = seq_len - S_Q + 1 + s_idx  # row s sees tokens < limit (causal among the S_Q new tokens)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_split * split_len
    end = tl.minimum(start + split_len, seq_len)

    if SCALE_MODE == SCALE_TENSOR:
        tensor_scale = tl.load(scale_ptr)
        qk_scale = tensor_scale * sm_scale_log2
    else:
        qk_scale = sm_scale_log2
    if BITCAST and not TILED:  # (TILED: unscale goes in with the tile scales)
        qk_scale = qk_scale * unscale
    if F16:
        qk_row = qk_scale * q_down  # [M]
    if MMA8:
        qk_row = qk_scale * q_sc  # [M]
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if BATCHED:
        acc = tl.zeros([NT, BLOCK_M, TILE], tl.float32)
    else:
        if SWAP:
            acc = tl.zeros([D_LAT, BLOCK_M], tl.float32)  # O^T
        else:
            acc = tl.zeros([BLOCK_M, D_LAT], tl.float32)
    PREFETCHED: tl.constexpr = PREFETCH and RAW
    if PREFETCHED:  # the first tile's bytes; each iteration then loads the next one before using these
        nx_ok, nx_lat, nx_rope, nx_sc = _tile_rows(start, end, bt_row, lat_ptr, rope_ptr, scale_ptr, stride_lat_page,
                                                   stride_lat_row, stride_rope_page, stride_rope_row,
                                                   stride_sc_page, stride_sc_row, PAGE_SIZE, BLOCK_N, True)
        k_nx, k_pe_nx, sc_nx = _load_tile_raw(nx_lat, nx_rope, nx_sc, nx_ok, d_lat, d_rope, SCALE_MODE, D_LAT, TILE,
                                              BLOCK_N)
    # WORDS: the bitcast path's one load of fp8_e4m3 words per tile (its 16-row blocks), which TMA can stage
    WORDS: tl.constexpr = BITCAST and not BATCHED and not QK_SPLIT_LOAD  # (fp8_ds_mla's bitcast is BATCHED)
    # one-load tiles of bf16 / fp8_e4m3 pages, each tile in one page (fp8_ds_mla: its 64-row blocks spill more)
    ONE_PAGE: tl.constexpr = (PAGE_SIZE % BLOCK_N == 0 and not PREFETCHED and SCALE_MODE != SCALE_TILE
                              and (RAW or WORDS and TMA))
    CHUNK_PAGES: tl.constexpr = 32  # block-table entries loaded per chunk of tiles
    CHUNK_TOKENS: tl.constexpr = CHUNK_PAGES * PAGE_SIZE
    DESC_ON: tl.constexpr = TMA and ONE_PAGE
    NPHASE: tl.constexpr = 2 if DESC_ON else 1
    if DESC_ON:  # tiles [start, full_end) are whole and visible to every query row (causal limit ≥ seq_len - S_Q + 1)
        full_end = start + tl.maximum(tl.minimum(end, seq_len - S_Q + 1) - start, 0) // BLOCK_N * BLOCK_N
    for phase in tl.static_range(NPHASE):
        if DESC_ON and phase == 0:  # (static: phase is a constexpr)
            lo = start
            hi = full_end
        elif DESC_ON:
            lo = full_end
            hi = end
        else:
            lo = start
            hi = end
        # one page per tile: the chunk's page ids are loaded before its tile loop, so no load feeds the tiles'
        # addresses inside the loop and the pipeliner can issue the tile loads num_stages - 1 iterations ahead
        # (with a block-table load in the loop it issues each tile's load one iteration ahead, into one buffer)
        if ONE_PAGE:
            c_first = lo // CHUNK_TOKENS
            # an empty phase runs no chunk (its page-id load took 1.6 µs at the end of the programs whose split ends
            # inside a chunk: H200 timelines, docs/mla.md "Where the fixed cost of a short decode goes")
            c_last = tl.where(hi > lo, tl.cdiv(hi, CHUNK_TOKENS), c_first)
        else:
            c_first = 0
            c_last = 1
        for c in range(c_first, c_last):
            if ONE_PAGE:
                c_lo = tl.maximum(lo, c * CHUNK_TOKENS)
                c_hi = tl.minimum(hi, c * CHUNK_TOKENS + CHUNK_TOKENS)
                chunk_idx = c * CHUNK_PAGES + tl.arange(0, CHUNK_PAGES)
                chunk_pages = tl.load(bt_row + chunk_idx, mask=chunk_idx * PAGE_SIZE < hi, other=0)
                if PROBE and phase == 0:
                    timeline_stamp(stamps, 2, tl.sum(chunk_pages), c == c_first)
            else:
                c_lo = lo
                c_hi = hi
            for n0 in range(c_lo, c_hi, BLOCK_N):
                toks = n0 + tl.arange(0, BLOCK_N)
                # masked loads never touch slots past seq_len (they may hold anything, NaN included)
                if ONE_PAGE:  # the chunk's entry for this tile (a sum over one nonzero term)
                    page = tl.sum(tl.where(tl.arange(0, CHUNK_PAGES) == n0 // PAGE_SIZE - c * CHUNK_PAGES,
                                           chunk_pages, 0))
                else:
                    page = 0
                if PREFETCHED:
                    tok_ok = toks < end
                    k_raw, k_pe_raw, sc_raw = k_nx, k_pe_nx, sc_nx
                    nx_ok, nx_lat, nx_rope, nx_sc = _tile_rows(n0 + BLOCK_N, end, bt_row, lat_ptr, rope_ptr, scale_ptr,
                                                               stride_lat_page, stride_lat_row, stride_rope_page,
                                                               stride_rope_row, stride_sc_page, stride_sc_row,
                                                               PAGE_SIZE, BLOCK_N, True)
                    k_nx, k_pe_nx, sc_nx = _load_tile_raw(nx_lat, nx_rope, nx_sc, nx_ok, d_lat, d_rope, SCALE_MODE,
                                                          D_LAT, TILE, BLOCK_N)
                else:
                    tok_ok, lat_rows, rope_rows, sc_rows = _tile_rows(n0, end, bt_row, lat_ptr, rope_ptr, scale_ptr,
                                                                      stride_lat_page, stride_lat_row, stride_rope_page,
                                                                      stride_rope_row, stride_sc_page, stride_sc_row,
                                                                      PAGE_SIZE, BLOCK_N, False, page, ONE_PAGE)
                    if DESC_ON and phase == 0:  # two TMA block loads at row page·PAGE_SIZE + slot (no masks)
                        row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
                        k_raw = lat_desc.load([row0, 0])
                        # (WORDS: the descriptors count int32 words of the e4m3 bytes: the rope starts at D_LAT / 4)
                        k_pe_raw = rope_desc.load([row0, D_LAT // 4 if WORDS else D_LAT])
                        if SCALE_MODE == SCALE_TOKEN:
                            sc_raw = tl.load(sc_rows)
                        else:
                            sc_raw = tl.zeros([BLOCK_N], tl.float32)
                    elif RAW:
                        k_raw, k_pe_raw, sc_raw = _load_tile_raw(lat_rows, rope_rows, sc_rows, tok_ok, d_lat, d_rope,
                                                                 SCALE_MODE, D_LAT, TILE, BLOCK_N)
                if RAW and F16:  # fp16 operands; c_t = the tile's largest scale (1 without per-token / per-tile scales)
                    if SCALE_MODE == SCALE_TILE:
                        c_t = tl.max(tl.max(sc_raw, 1), 0)
                        rel = sc_raw / c_t  # powers of two ≤ 1: exact (masked rows 0)
                        k = tl.reshape(tl.reshape(k_raw.to(f16_ty), (BLOCK_N, D_LAT // TILE, TILE))
                                       * rel.to(f16_ty)[:, :, None], (BLOCK_N, D_LAT))
                        s = tl.dot(q_lat, tl.trans(k), input_precision=DOT_PRECISION) * (qk_row * c_t)[:, None]
                        s_pe = tl.dot(q_pe, tl.trans(k_pe_raw.to(dot_ty)), input_precision=DOT_PRECISION)
                        s = s + s_pe * qk_scale
                    else:
                        k = k_raw.to(f16_ty)
                        s = tl.dot(q_lat, tl.trans(k), input_precision=DOT_PRECISION)
                        s = tl.dot(q_pe, tl.trans(k_pe_raw.to(f16_ty)), s, input_precision=DOT_PRECISION)
                        if SCALE_MODE == SCALE_TOKEN:
                            c_t = tl.max(sc_raw, 0)
                            s = s * qk_row[:, None] * sc_raw[None, :]
                        else:
                            s = s * qk_row[:, None]
                elif RAW and MMA8:  # e4m3 score dots on the stored bytes; per-row q scale and per-token scale on s
                    k8 = k_raw.to(f8_ty)
                    k8_pe = k_pe_raw.to(f8_ty)
                    if SWAP:  # S^T [N, M], transposed back for the softmax (a [N, M] fp32 relayout, small)
                        s = tl.dot(k8_pe, q_pe, tl.dot(k8, q_lat, input_precision=DOT_PRECISION),
                                   input_precision=DOT_PRECISION)
                        if Q_LO:
                            s_lo = tl.dot(k8_pe, q_pe_lo, tl.dot(k8, q_lat_lo, input_precision=DOT_PRECISION),
                                          input_precision=DOT_PRECISION)
                            s = s + s_lo * Q_LO_UNSCALE
                        s = tl.trans(s)
                    else:
                        s = tl.dot(q_pe, tl.trans(k8_pe), tl.dot(q_lat, tl.trans(k8), input_precision=DOT_PRECISION),
                                   input_precision=DOT_PRECISION)
                        if Q_LO:
                            s_lo = tl.dot(q_pe_lo, tl.trans(k8_pe), tl.dot(q_lat_lo, tl.trans(k8),
                                                                           input_precision=DOT_PRECISION),
                                          input_precision=DOT_PRECISION)
                            s = s + s_lo * Q_LO_UNSCALE
                    if SCALE_MODE == SCALE_TOKEN:
                        c_t = tl.max(sc_raw, 0)
                        s = s * qk_row[:, None] * sc_raw[None, :]
                    else:
                        s = s * qk_row[:, None]
                    if PV8:
                        k = k_raw.to(f8_ty)
                    else:
                        k = k_raw.to(f16_ty)
                elif RAW:  # the conversion to q's dtype (fp8_ds_mla: tile scales multiplied in, in fp32)
                    k = k_raw
                    if SCALE_MODE == SCALE_TILE:
                        NT_S: tl.constexpr = D_LAT // TILE
                        k = tl.reshape(tl.reshape(k.to(tl.float32), (BLOCK_N, NT_S, TILE)) * sc_raw[:, :, None],
                                       (BLOCK_N, D_LAT))
                    k = k.to(dot_ty)
                    s = tl.dot(q_lat, tl.trans(k), input_precision=DOT_PRECISION)
                    s = tl.dot(q_pe, tl.trans(k_pe_raw.to(dot_ty)), s, input_precision=DOT_PRECISION)      # [M, N]
                elif BATCHED:
                    k = _load_latent_tile(lat_rows, sc_rows, tok_ok, d_lat, False, SCALE_MODE, D_LAT, TILE, BLOCK_N,
                                          dot_ty, True, TO_FP16)
                    k = tl.permute(tl.reshape(k.to(dot_ty), (BLOCK_N, NT, TILE)), (1, 0, 2))             # [NT, N, TILE]
                    s_t = tl.dot(q_lat, tl.permute(k, (0, 2, 1)), input_precision=DOT_PRECISION)         # [NT, M, N]
                    if TILED:
                        k_pe = tl.load(rope_rows[:, None] + d_rope[None, :], mask=tok_ok[:, None], other=0.0)
                        tile_sc = tl.load(sc_rows[None, :] + tl.arange(0, NT)[:, None], mask=tok_ok[None, :],
                                          other=0.0)                                                    # [NT, N]
                        s = tl.sum(s_t * (tile_sc * unscale)[:, None, :], 0)
                    else:
                        k_pe = _load_e4m3_16(rope_rows, tok_ok, D_ROPE, BLOCK_N, TO_FP16, dot_ty == tl.float32)
                        s = tl.sum(s_t, 0)
                    s = tl.dot(q_pe, tl.trans(k_pe.to(dot_ty)), s, input_precision=DOT_PRECISION)      # [M, N]
                elif QK_SPLIT_LOAD:
                    k_t = _load_latent_tile(lat_rows, sc_rows, tok_ok, d_lat, True, SCALE_MODE, D_LAT, TILE, BLOCK_N,
                                            dot_ty, BITCAST, TO_FP16)
                    if BITCAST:
                        k_pe_t = tl.trans(_load_e4m3_16(rope_rows, tok_ok, D_ROPE, BLOCK_N, TO_FP16,
                                                        dot_ty == tl.float32))
                    else:
                        k_pe_t = tl.load(rope_rows[None, :] + d_rope[:, None], mask=tok_ok[None, :], other=0.0)
                    s = tl.dot(q_lat, k_t.to(dot_ty), input_precision=DOT_PRECISION)
                    s = tl.dot(q_pe, k_pe_t.to(dot_ty), s, input_precision=DOT_PRECISION)              # [M, N]
                    k = _load_latent_tile(lat_rows, sc_rows, tok_ok, d_lat, False, SCALE_MODE, D_LAT, TILE, BLOCK_N,
                                          dot_ty, BITCAST, TO_FP16)
                elif DESC_ON and phase == 0:  # BITCAST, the words staged by TMA
                    k = _e4m3_words_16(k_raw, D_LAT, BLOCK_N, TO_FP16, dot_ty == tl.float32)
                    k_pe = _e4m3_words_16(k_pe_raw, D_ROPE, BLOCK_N, TO_FP16, dot_ty == tl.float32)
                    s = tl.dot(q_lat, tl.trans(k.to(dot_ty)), input_precision=DOT_PRECISION)
                    s = tl.dot(q_pe, tl.trans(k_pe.to(dot_ty)), s, input_precision=DOT_PRECISION)      # [M, N]
                else:  # BITCAST, one load
                    k = _load_latent_tile(lat_rows, sc_rows, tok_ok, d_lat, False, SCALE_MODE, D_LAT, TILE, BLOCK_N,
                                          dot_ty, BITCAST, TO_FP16)
                    k_pe = _load_e4m3_16(rope_rows, tok_ok, D_ROPE, BLOCK_N, TO_FP16, dot_ty == tl.float32)
                    s = tl.dot(q_lat, tl.trans(k.to(dot_ty)), input_precision=DOT_PRECISION)
                    s = tl.dot(q_pe, tl.trans(k_pe.to(dot_ty)), s, input_precision=DOT_PRECISION)      # [M, N]
                if SCALE_MODE == SCALE_TOKEN and not (F16 or MMA8):
                    if RAW or (DESC_ON and phase == 0):
                        tok_sc = sc_raw
                    else:
                        tok_sc = tl.load(sc_rows, mask=tok_ok, other=0.0)
                    s = s * (tok_sc * qk_scale)[None, :]
                elif not (F16 or MMA8):
                    s = s * qk_scale
                if not (DESC_ON and phase == 0):
                    visible = tok_ok[None, :] & (toks[None, :] < limit[:, None])
                    s = tl.where(visible, s, float("-inf"))

                m_new = tl.maximum(m_i, tl.max(s, 1))
                if PROBE and phase == 0:
                    timeline_stamp(stamps, 3, tl.max(m_new, 0).to(tl.int32, bitcast=True), n0 == start)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
                alpha = tl.exp2(m_i - m_use)
                p = tl.exp2(s - m_use[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if F16 or MMA8:  # V = k·c_t·(scale/c_t): p·(scale/c_t)·TOP rounded to fp16 (≤ 2^15) or e4m3
                    # (PV8: ≤ 2^8), the accumulator in units of c_t / TOP
                    if PV8:
                        TOP: tl.constexpr = P8_TOP
                        UNTOP: tl.constexpr = P8_UNTOP
                        p_ty: tl.constexpr = tl.float8e4nv
                        pv_ty: tl.constexpr = f8_ty
                    else:
                        TOP: tl.constexpr = F16_TOP
                        UNTOP: tl.constexpr = F16_UNTOP
                        p_ty: tl.constexpr = tl.float16
                        pv_ty: tl.constexpr = f16_ty
                    if SCALE_MODE == SCALE_TENSOR:  # units 1/TOP throughout
                        p = p * TOP
                        rescale = alpha
                    else:
                        if SCALE_MODE == SCALE_TOKEN:
                            p = p * (sc_raw * (TOP / c_t))[None, :]
                        else:
                            p = p * TOP
                        u_t = c_t * UNTOP
                        rescale = alpha * (u_prev / u_t)
                        u_prev = u_t
                    if PV8:
                        p_op = _round_e4m3(p, f8_ty, INTERPRET)
                    else:
                        p_op = p.to(p_ty).to(pv_ty)
                    if SWAP:  # O^T [D_LAT, M] += V^T·P^T
                        acc = tl.dot(tl.trans(k), tl.trans(p_op), acc * rescale[None, :], input_precision=DOT_PRECISION)
                    else:
                        acc = tl.dot(p_op, k, acc * rescale[:, None], input_precision=DOT_PRECISION)
                elif BATCHED:  # p (·scale_t for each tile t), times 2^PRE
                    if SCALE_MODE == SCALE_TOKEN:
                        p = p * tok_sc[None, :]  # V = latent·scale: fold the scale into p
                    if TILED:
                        p_t = (p[None, :, :] * (tile_sc * pre)[:, None, :]).to(dot_ty)                 # [NT, M, N]
                    else:
                        p_t = tl.broadcast_to((p * pre).to(dot_ty)[None, :, :], (NT, BLOCK_M, BLOCK_N))
                    acc = tl.dot(p_t, k, acc * alpha[None, :, None], input_precision=DOT_PRECISION)
                else:
                    if SCALE_MODE == SCALE_TOKEN:
                        p = p * tok_sc[None, :]  # V = latent·scale: fold the scale into p
                    if BITCAST:
                        p = p * pre
                    acc = tl.dot(p.to(dot_ty), k.to(dot_ty), acc * alpha[:, None], input_precision=DOT_PRECISION)
                m_i = m_new
        if PROBE and phase == 0:
            timeline_stamp(stamps, 4, tl.sum(l_i, 0).to(tl.int32, bitcast=True))
    if PROBE:
        timeline_stamp(stamps, 5, tl.sum(l_i, 0).to(tl.int32, bitcast=True))

    if SWAP:
        acc = tl.trans(acc)
    if PV8 and SCALE_MODE == SCALE_TENSOR:
        acc = acc * P8_UNTOP
    elif (F16 or MMA8) and SCALE_MODE == SCALE_TENSOR:
        acc = acc * F16_UNTOP
    elif F16 or MMA8:
        acc = acc * u_prev

    if BATCHED:
        acc = tl.reshape(tl.permute(acc, (1, 0, 2)), (BLOCK_M, D_LAT)) * unscale
    elif BITCAST:
        acc = acc * unscale
    if SCALE_MODE == SCALE_TENSOR:
        acc = acc * tensor_scale
    empty = l_i == 0.0
    l_use = tl.where(empty, 1.0, l_i)
    o = acc / l_use[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_use))
    if SPLIT_OUT:  # partials: o [B, NUM_SPLITS, M, D_LAT] (fp32 by default), lse [B, NUM_SPLITS, M] fp32 (log2)
        base = (b * NUM_SPLITS + pid_split).to(tl.int64) * M
        tl.store(out_ptr + (base + rows)[:, None] * D_LAT + d_lat[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(lse_ptr + base + rows, lse2, mask=row_ok)
    else:  # final: out [B, S_Q, H, D_LAT] = [B, M, D_LAT], lse [B, M] (natural log)
        base = b.to(tl.int64) * M
        tl.store(out_ptr + (base + rows)[:, None] * D_LAT + d_lat[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(lse_ptr + base + rows, lse2 * LN2, mask=row_ok)
    if PROBE:
        done = tl.sum(lse2, 0).to(tl.int32, bitcast=True)
        timeline_stamp(stamps, 6, done)
        tl.store(stamps + 14, sm_id(done).to(tl.int64))


def _config_key(c) -> tuple:
    """(BLOCK_M, BLOCK_N, QK_SPLIT_LOAD, num_warps, num_stages, PREFETCH) of an autotune config."""
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["QK_SPLIT_LOAD"], c.num_warps, c.num_stages,
            c.kwargs.get("PREFETCH", False))


def config_keys(table) -> set:
    """A candidate table as _config_key tuples (5-tuples: PREFETCH off)."""
    return {t if len(t) == 6 else (*t, False) for t in table}


def _prune_decode_configs(configs, named_args, **kwargs):
    """Keep the head blocks that fit the query rows: 16 rows for ≤ 16 (S·H), 32–64 above, among DECODE_CONFIGS
    (default launches), BITCAST_CONFIGS (FP8_BITCAST launches) or F16_CONFIGS (F16_DOTS launches)."""
    rows = named_args["S_Q"] * named_args["H"]
    want = {16} if rows <= 16 else {16, 32} if rows <= 32 else {32, 64}

    def flag(name):
        return kwargs.get(name, named_args.get(name, False))

    if flag("FP8_BITCAST"):
        table = BITCAST_CONFIGS
    elif flag("FP8_MMA"):
        table = FP8_MMA_CONFIGS
    else:
        table = F16_CONFIGS if flag("F16_DOTS") else DECODE_CONFIGS
    if table is F16_CONFIGS and rows > 16:
        want = {16, 32}
    keys = config_keys(table)
    configs = [c for c in configs if _config_key(c) in keys]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] in want]
    return kept or configs


# GPU launches go through a small autotuner (the interpreter runs one fixed config). The candidates
# (BLOCK_M, BLOCK_N, QK_SPLIT_LOAD, warps, stages) were checked ahead of time for sm_90 (triton.compile +
# cuobjdump --dump-resource-usage): every KV format has spill-free candidates with 16 and 32 query rows
# (BF16 99–171 registers; FP8 128–254, the transposed QK load saving registers when an FP8 tile feeds two
# dots); 64-row blocks (wgmma) are spill-free for BF16 only — FP8 spills ~280 bytes there, left to the tuner.
DECODE_CONFIGS = (
    (16, 32, False, 8, 2), (16, 64, False, 8, 2), (16, 32, False, 8, 3), (16, 32, True, 8, 2), (16, 64, True, 8, 2),
    (16, 16, False, 4, 3),
    (32, 16, False, 8, 2), (32, 32, False, 8, 2), (32, 16, True, 8, 2), (32, 32, True, 8, 2),
    (64, 16, False, 8, 2), (64, 16, False, 8, 3),
)
# FP8_BITCAST launches tune among their own candidates: with the words' conversion software-pipelined
# (num_stages ≥ 2) the fp8_e4m3 32/64-row blocks spill 430–2700 bytes (sm_90, Triton 3.9) while the 16-row ones
# need 205–240 registers; unpipelined (num_stages 1) 16/32-row blocks need 105–170 registers (fp8_ds_mla
# 160–255), no spills, several programs per SM hiding the load latency. 64-row blocks run batched per-tile
# dots ([4, 64, 128] accumulators; a [64, 512] wgmma accumulator spilled ~450 bytes with fp8_e4m3): 220–255
# registers, no spills. (16, 64, 1 stage) spills 8 bytes with fp8_e4m3; every other candidate none.
# (16, 32, 4 warps): BLOCK_N ≥ 8·num_warps, so the score dot's tile operand is not replicated over warps
# (sm_90, Triton 3.6: 1441 instructions per tile, 180 per token vs 280 at 8 warps; 216 registers, 2 programs/SM).
BITCAST_CONFIGS = (
    (16, 32, False, 8, 2), (16, 64, False, 8, 2), (16, 32, True, 8, 2), (16, 32, False, 8, 1), (16, 64, False, 8, 1),
    (16, 32, False, 4, 2),
    (32, 32, False, 8, 1), (32, 64, False, 8, 1), (32, 32, True, 8, 1),
    (64, 16, False, 8, 2), (64, 16, False, 8, 1),
)
# F16_DOTS launches (FP8 pages, fp16 dot operands; docs/mla.md "fp16 dot operands"): one load feeding both dots,
# with and without the register prefetch; (BLOCK_M, BLOCK_N, QK_SPLIT_LOAD, warps, stages, PREFETCH). Static
# sm_90 profile (Triton 3.6, benchmarks/mla_decode_sass.py, fp8_e4m3 / fp8_ds_mla, 16 heads): with PREFETCH the
# loop-carried bytes are converted once, stored as fp16 and read by ldmatrix for both dots — m16n32w8
# 684 / 833 instructions per warp and tile (171 / 208 per token; the conversion path 1097 / 1067), 238-244
# registers, no spills; m16n16w4 178 / 201 per token, 2 programs per SM, 8 / 80 bytes of spills. Without it
# m16n32w8 847 / 982 (212 / 246 per token), no spills. 32- and 64-row blocks spill 600-1200 bytes except
# m32n32w8 without PREFETCH (fp8_e4m3): more than 16 query rows also try the 16-row blocks.
F16_CONFIGS = (
    (16, 32, False, 8, 2, False), (16, 64, False, 8, 2, False), (16, 16, False, 4, 2, False),
    (16, 32, False, 8, 2, True), (16, 16, False, 4, 2, True),
    (32, 32, False, 8, 2, False),
)
# FP8_MMA launches (fp8_e4m3 pages, e4m3 score dots; docs/mla.md "fp8 tensor-core dots"). Below 64 rows the
# transposed dots put BLOCK_N tokens on wgmma's M: 64 per warpgroup (4 warps) or 128 (8 warps). Static sm_90 profile
# (Triton 3.6, 16 heads): fp8mma_pv m16n128w8 240 registers, no spills, 99 warp-instructions per token (pv_q1: 210,
# 90); m16n64w4 255 registers with 180-1200 bytes of spills; PREFETCH spills 9-11 KB (not a candidate). 128 heads:
# m64n32w8 (q·K^T as is, wgmma e4m3 m64n16k32) 48-140 bytes of spills; m64n32w4 / m32n64w4 3-12 KB (not candidates).
# Session 11 (the block table read per chunk, so num_stages 3 keeps two tile buffers): m64n32w8s3 (660 bytes of
# spills against m64n64w8s2's 1264, 128 heads, token scales) was a candidate for one H200 run (3d692da) and the
# autotuner kept m64n64w8s2 at every 128-head shape of the bench (538.9 µs at batch 64 × 4k), so it is not one.
FP8_MMA_CONFIGS = (
    (16, 64, False, 4, 2, False), (16, 64, False, 4, 3, False), (16, 128, False, 8, 2, False),
    (64, 32, False, 8, 2, False), (64, 64, False, 8, 2, False),
)
_mla_decode_kernel_tuned = triton.autotune(
    [triton.Config({"BLOCK_M": k[0], "BLOCK_N": k[1], "QK_SPLIT_LOAD": k[2], "PREFETCH": k[5]}, num_warps=k[3],
                   num_stages=k[4])
     for k in sorted(config_keys(DECODE_CONFIGS) | config_keys(BITCAST_CONFIGS) | config_keys(F16_CONFIGS)
                     | config_keys(FP8_MMA_CONFIGS))],
    key=["D_LAT", "D_ROPE", "PAGE_SIZE", "SCALE_MODE", "S_Q", "H", "SPLIT_OUT", "FP8_BITCAST", "F16_DOTS", "FP8_MMA"],
    prune_configs_by={"early_config_prune": _prune_decode_configs},
)(_mla_decode_kernel)


@triton.jit
def _combine_lse_max(lse_part_ptr, part, rows, row_ok, M, NUM_SPLITS, SPLITS_P2: tl.constexpr):
    """The split merge's prologue: over the NUM_SPLITS partial lse (base-2) of the rows [R] of one request (from
    offset part), their max m (0 where every split is empty) and the denominator Σ_s 2^(lse_s - m). Returns
    (m [R], denom [R])."""
    splits = tl.arange(0, SPLITS_P2)
    lse = tl.load(lse_part_ptr + part + splits[:, None] * M + rows[None, :],
                  mask=(splits[:, None] < NUM_SPLITS) & row_ok[None, :], other=float("-inf"))  # [S, R]
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m_use[None, :]), 0)
    return m_use, denom


@triton.jit
def _combine_store(out_ptr, lse_ptr, acc, m_use, denom, base, rows, row_ok, cols, D_LAT: tl.constexpr, store_lse):
    """The split merge's epilogue: out[base + rows, cols] = acc / denom ([R, C]; 0 for rows with no token) and,
    where store_lse, lse[base + rows] = ln(2^m · denom) (-inf for rows with no token)."""
    empty = denom == 0.0
    d_use = tl.where(empty, 1.0, denom)
    out = acc / d_use[:, None]
    tl.store(out_ptr + (base + rows)[:, None] * D_LAT + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if store_lse:
        tl.store(lse_ptr + base + rows, tl.where(empty, float("-inf"), (m_use + tl.log2(d_use)) * LN2), mask=row_ok)


@triton.jit
def _mla_decode_combine_tiles_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, M, NUM_SPLITS,
                                     D_LAT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                                     SPLITS_P2: tl.constexpr, CHUNK_S: tl.constexpr, PDL: tl.constexpr = False):
    """The merge of _mla_decode_combine_kernel over a 3-D grid (row blocks, requests, column blocks), reading
    CHUNK_S splits per step ([CHUNK_S, BLOCK_R, BLOCK_D] loads): many small programs and few dependent steps, where
    the row-block kernel walks every split serially in a handful of programs (batch 1: 2 programs × 218 splits)."""
    grid_dependency_sync(PDL)
    pid_r, b, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    part = b.to(tl.int64) * NUM_SPLITS * M
    m_use, denom = _combine_lse_max(lse_part_ptr, part, rows, row_ok, M, NUM_SPLITS, SPLITS_P2)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s0 in range(0, NUM_SPLITS, CHUNK_S):
        sp = s0 + tl.arange(0, CHUNK_S)
        ok = (sp[:, None] < NUM_SPLITS) & row_ok[None, :]                                          # [C, R]
        idx = part + sp[:, None] * M + rows[None, :]
        w = tl.exp2(tl.load(lse_part_ptr + idx, mask=ok, other=float("-inf")) - m_use[None, :])
        o = tl.load(o_part_ptr + idx[:, :, None] * D_LAT + cols[None, None, :], mask=ok[:, :, None],
                    other=0.0).to(tl.float32)
        acc += tl.sum(w[:, :, None] * o, 0)
    _combine_store(out_ptr, lse_ptr, acc, m_use, denom, b.to(tl.int64) * M, rows, row_ok, cols, D_LAT, pid_d == 0)


@triton.jit
def _mla_decode_combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, M, NUM_SPLITS,
                               D_LAT: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS_P2: tl.constexpr,
                               PDL: tl.constexpr = False):
    """Merge the splits' (o, lse) of BLOCK_R query rows: out = Σ_s 2^(lse_s - lse)·o_s."""
    grid_dependency_sync(PDL)
    pid_r, b = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    part = b.to(tl.int64) * NUM_SPLITS * M
    m_use, denom = _combine_lse_max(lse_part_ptr, part, rows, row_ok, M, NUM_SPLITS, SPLITS_P2)
    d_lat = tl.arange(0, D_LAT)
    acc = tl.zeros([BLOCK_R, D_LAT], tl.float32)
    for s in range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_part_ptr + part + s * M + rows, mask=row_ok, other=float("-inf")) - m_use)
        o = tl.load(o_part_ptr + (part + s * M + rows)[:, None] * D_LAT + d_lat[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        acc += w[:, None] * o
    _combine_store(out_ptr, lse_ptr, acc, m_use, denom, b.to(tl.int64) * M, rows, row_ok, d_lat, D_LAT, True)
