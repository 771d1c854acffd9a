"""W4A16 for 1-128 tokens on ``mma.sync``, every operand fragment built in the registers of the thread that owns it.

y^T [rows, tokens] = W · x^T as m16n8k16 MMAs (bf16 or fp16, fp32 accumulation): the INT4 weight is the A operand
(16 rows per tile), the tokens the N side (one, two or four tiles of 8 per program, more tokens as chunks of 32
programs of their own; rows past M re-read valid ones and are not stored).
``tl.dot`` stages one operand through shared memory and re-packs the weight bytes with byte permutes (the swapped
kernel: ~54 SASS instructions per word and thread, 71 LDS / 32 STS per K block); here each thread loads exactly the
words and activations of its own fragment registers and issues the MMA as inline PTX: no shared memory at all. The
kernel works on 1-D tensors of one element per thread (``T = 32 · num_warps``: element i lives in thread i, lane
i % 32 of warp i // 32; Triton gives a 1-D tensor of as many elements as threads one element per thread), so an
elementwise inline-asm op runs once in every lane, as a warp-wide ``mma.sync`` must.

Which K a register holds is ours to choose: a dot product does not care about the order of K, as long as A and B
agree. Lane (r, c) = (lane // 4, lane % 4) holds, per block of 128 K and per 16-row tile, words 4c .. 4c + 3 of
rows r and r + 8 (one 128-bit load each; 32 K of one row: one quantization group at group 32) and the 32 matching
activations of token r (four 128-bit loads). For each word:

* the pair register ``P_j`` = ``(w >> 4j) & 0x000F000F | 0x43004300`` holds nibbles j and j + 4 in its two bf16
  lanes as 128 + n (one LOP3, exact); ``sub.bf16x2`` of 136 makes the codes n - 8, exactly, and ``mul.bf16x2`` by
  the lane's group scale gives the weight rounded once to bf16 — the value ``int4_dequantize`` stores and the
  reference multiplies (fp16: 0x6400 | n = 1024 + n, minus 1032). So the scales must have x's dtype;
* the B register ``Q_j`` holds the activations of the same two elements (8w + j, 8w + j + 4), made from the loaded
  pairs (8w + j, 8w + j + 1) and (8w + j + 4, 8w + j + 5) by one PRMT;
* two MMAs, pairs (0, 1) then (2, 3), add the word's 8 weights times their activations to the accumulator.

As the weights are scaled before the MMAs, the four lanes of a quad may hold different groups, and one accumulator
sums the whole K range. Per word and thread: 3 shifts, 4 LOP3, 4 HSUB2, 4 HMUL2 and 2 HMMA per token tile (~22 SASS
instructions with the loads and addresses, sm_90; the one-token plane GEMV takes 34, the swapped kernel 54).

The accumulator fragment gives lane (r, c) the outputs (row r, token 2c), (r, 2c + 1), (r + 8, 2c), (r + 8, 2c + 1)
of each tile. Split-K as everywhere: ``_gemm_utils.store_split_k`` on the accumulators joined into one tensor
(partials in a workspace, the last program of a tile sums them in split order — deterministic — and resets its
counter). BK and the grid size (~4 or ~8 programs per SM) follow the token count (``frag_tile``).

Under ``TRITON_INTERPRET`` the fragments are fp32 values and :func:`_mma_emulated` computes what the warp's MMA
computes from them (the same lanes, the same K pairing), so the CPU tests check the indexing; the GPU tests check
the bit tricks and the PTX. docs/moe.md "W4A16 at 2-16 tokens: MMA fragments in registers".
"""
import triton
import triton.language as tl

from .._gemm_utils import _load_in_place, four_words, ld4, store_split_k
from .._host import cdiv
from .kernel import planes1_split

# split-K of the fragment kernel: the one-launch GEMV's rule (double while every split keeps a K block and the grid
# stays within ~PER_SM programs per SM)
frag_split = planes1_split

# The launch per token count, (16-row tiles per warp, BK, warps, programs per SM), a fixed rule rather than an
# autotuner: the kernel takes ~8-17 µs, so eager timings measure the host's launches, and the autotuner once kept a
# tile 18 % slower than the best (16 tokens at 7168 x 2048). Session 15's probe on the H200 (kept counters, CUDA
# graphs, 2048 x 7168 / 4096 x 7168 / 7168 x 2048, results/sweep_w4a16_frag_h200.json): at 1-4 tokens BK 256 with ~8
# programs per SM was the best of 4 tiles or within 0.4 %; at 5-8 tokens BK 128 with ~4 within 2 %; at 9-16 tokens BK
# 128 with ~4 within 1 % (BK 256 was 8 % slower at 4096 x 7168 and ~8 programs per SM 15-35 % slower). Two tiles per
# warp, eight warps or a loop that issues every load of a BK 256 / 512 iteration first were no faster (sessions 14-15)
# 17-128 tokens (session 41): the same tile per chunk of up to FRAG_CHUNK_TOKENS tokens
FRAG_TILE_BY_TOKENS = ((4, (1, 256, 4, 8)), (8, (1, 128, 4, 4)), (128, (1, 128, 4, 4)))
# A program's token columns: at most this many (4 token tiles of 8: 16 activation words per lane and 128 K, 16
# accumulators; 92 registers at sm_90); more tokens run as several chunks, each its own program over the same rows
# (consecutive programs, so the later chunks read the weights from L2). Two chunks took 1.6-1.9x one chunk's time on
# an H100 (session 41): at 32 tokens the kernel is bound by its instructions, so "auto" stops there
FRAG_CHUNK_TOKENS = 32
FRAG_INTERPRETER_TILE = (1, 128, 2, 4)  # small, and two warps: the CPU tests cover the warp index too
# The weights' words and scales without L1 lines (each is read once), as the one-token GEMVs load theirs since session
# 33 (gemv.STREAM_WEIGHTS: 4-7 % there); a sweep setting, off: H200, sweep_w4a16_frag (session 34, kept counters,
# 2-16 tokens), streamed / plain time 1.002-1.022 at 4096 x 7168, 0.986-0.999 at 2048 x 7168, 0.976-0.995 at
# 7168 x 2048.
STREAM_WEIGHTS = False


def frag_tile(m: int) -> tuple[int, int, int, int]:
    """(row tiles per warp, BK, warps, programs per SM) of the GPU launch for ``m`` tokens (1..128)."""
    return next(tile for most, tile in FRAG_TILE_BY_TOKENS if m <= most)


def frag_chunks(m: int) -> tuple[int, int]:
    """(chunks, NT): ``m`` tokens as chunks of at most FRAG_CHUNK_TOKENS, each 8 · NT token columns wide; NT a power
    of two (the epilogue joins the accumulators pairwise: ``_stacked``)."""
    chunks = cdiv(m, FRAG_CHUNK_TOKENS)
    return chunks, triton.next_power_of_2(cdiv(cdiv(m, chunks), 8))


@triton.jit
def _pairs(words, scale2, j: tl.constexpr, DT: tl.constexpr):
    """Nibbles j and j + 4 of every word as one 16-bit pair (low lane: nibble j) of weights (n - 8) · s, rounded once
    to DT as ``int4_dequantize`` stores them: LOP3 to 128 + n (bf16; fp16: 1024 + n), an exact subtraction, one
    multiply by ``scale2`` (the scale in both lanes)."""
    src = words >> (4 * j) if j > 0 else words
    if DT == tl.bfloat16:
        asm: tl.constexpr = ("{\n\t.reg .b32 t, b;\n\tlop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA;\n\t"
                             "mov.b32 b, 0x43084308;\n\tsub.rn.bf16x2 t, t, b;\n\tmul.rn.bf16x2 $0, t, $2;\n\t}")
    else:
        asm: tl.constexpr = ("{\n\t.reg .b32 t, b;\n\tlop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA;\n\t"
                             "mov.b32 b, 0x64086408;\n\tsub.rn.f16x2 t, t, b;\n\tmul.rn.f16x2 $0, t, $2;\n\t}")
    return tl.inline_asm_elementwise(asm, "=r,r,r", [src, scale2], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _act_pair(lo, hi, HIGH: tl.constexpr):
    """Activations j and j + 4 of a word as one 16-bit pair, from the 32-bit words holding (j, j + 1) and
    (j + 4, j + 5): their low (``HIGH`` false) or high halves."""
    sel: tl.constexpr = 0x7632 if HIGH else 0x5410
    return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, DT: tl.constexpr):
    """One warp-wide m16n8k16 MMA (row.col, fp32 accumulation) on this thread's fragment registers."""
    ty: tl.constexpr = "bf16" if DT == tl.bfloat16 else "f16"
    return tl.inline_asm_elementwise(
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, "
        "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _mma_emulated(top, bot, b, acc, W: tl.constexpr):
    """What one m16n8k16 MMA of each warp computes, for fp32 fragments of one value per lane: ``top`` / ``bot`` the
    four A values of rows r / r + 8 (logical K 2c, 2c + 1, 2c + 8, 2c + 9), ``b`` the four B values of token r at
    those K; ``acc`` (d0, d1, d2, d3): rows r, r, r + 8, r + 8 and tokens 2c, 2c + 1, 2c, 2c + 1 (the interpreter)."""
    d_top = tl.zeros((W, 8, 8), dtype=tl.float32)   # [warp, row r, token n]: the sum over the quad's lanes c'
    d_bot = tl.zeros((W, 8, 8), dtype=tl.float32)
    for j in tl.static_range(4):
        bj = tl.reshape(b[j], (W, 8, 4))[:, None, :, :]
        d_top += tl.sum(tl.reshape(top[j], (W, 8, 4))[:, :, None, :] * bj, axis=3)
        d_bot += tl.sum(tl.reshape(bot[j], (W, 8, 4))[:, :, None, :] * bj, axis=3)
    n = tl.arange(0, 8)[None, :]
    c2 = 2 * tl.arange(0, 4)[:, None]                # lane c takes tokens 2c and 2c + 1
    even = (n == c2).to(tl.float32)[None, None, :, :]
    odd = (n == c2 + 1).to(tl.float32)[None, None, :, :]
    t0, b0 = d_top[:, :, None, :], d_bot[:, :, None, :]
    return (acc[0] + tl.reshape(tl.sum(t0 * even, axis=3), (W * 32,)),
            acc[1] + tl.reshape(tl.sum(t0 * odd, axis=3), (W * 32,)),
            acc[2] + tl.reshape(tl.sum(b0 * even, axis=3), (W * 32,)),
            acc[3] + tl.reshape(tl.sum(b0 * odd, axis=3), (W * 32,)))


@triton.jit
def _word_step(w_top, w_bot, s_top, s_bot, xw, acc, DT: tl.constexpr, W: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += this word's 8 weights of rows r and r + 8 times its activations (two MMAs). ``w_top`` / ``w_bot`` int32
    words, ``s_top`` / ``s_bot`` their scales (GPU: the DT pair (s, s) as int32; interpreter: fp32), ``xw`` the
    activation pairs Q_0..Q_3 (GPU) or the word's 8 activations in fp32 (interpreter)."""
    if INTERPRET:  # the weights rounded to DT as on the GPU, then the emulated MMA
        top = ()
        bot = ()
        for j in tl.static_range(8):
            top = top + (((((w_top >> (4 * j)) & 0xF) - 8).to(tl.float32) * s_top).to(DT).to(tl.float32),)
            bot = bot + (((((w_bot >> (4 * j)) & 0xF) - 8).to(tl.float32) * s_bot).to(DT).to(tl.float32),)
        acc = _mma_emulated((top[0], top[4], top[1], top[5]), (bot[0], bot[4], bot[1], bot[5]),
                            (xw[0], xw[4], xw[1], xw[5]), acc, W)
        return _mma_emulated((top[2], top[6], top[3], top[7]), (bot[2], bot[6], bot[3], bot[7]),
                             (xw[2], xw[6], xw[3], xw[7]), acc, W)
    d0, d1, d2, d3 = _mma(_pairs(w_top, s_top, 0, DT), _pairs(w_bot, s_bot, 0, DT), _pairs(w_top, s_top, 1, DT),
                          _pairs(w_bot, s_bot, 1, DT), xw[0], xw[1], acc[0], acc[1], acc[2], acc[3], DT)
    return _mma(_pairs(w_top, s_top, 2, DT), _pairs(w_bot, s_bot, 2, DT), _pairs(w_top, s_top, 3, DT),
                _pairs(w_bot, s_bot, 3, DT), xw[2], xw[3], d0, d1, d2, d3, DT)


@triton.jit
def _x_words(ptrs, X_VEC: tl.constexpr, INTERPRET: tl.constexpr):
    """The raw loads of a word's 8 activations of each lane's token (``ptrs`` at element 8w; addresses always valid):
    four int32 words (GPU: one 128-bit load with ``X_VEC``, else four 32-bit loads) or 8 values (interpreter)."""
    if INTERPRET:
        vals = ()
        for j in tl.static_range(8):
            vals = vals + (tl.load(ptrs + j).to(tl.float32),)
        return vals
    if X_VEC:
        return ld4(ptrs)
    x32 = ptrs.to(tl.pointer_type(tl.int32), bitcast=True)
    return tl.load(x32), tl.load(x32 + 1), tl.load(x32 + 2), tl.load(x32 + 3)


@triton.jit
def _x_pairs(v, ok, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """A word's activations as the MMA's B registers Q_0..Q_3 (4 PRMT; zeros where not ``ok``), or under the
    interpreter its 8 values (zeros where not ``ok``)."""
    if INTERPRET:
        vals = ()
        for j in tl.static_range(8):
            vals = vals + (tl.where(ok, v[j], 0.0),)
        return vals
    v0, v1, v2, v3 = v[0], v[1], v[2], v[3]
    if not EVEN_K:
        v0, v1, v2, v3 = tl.where(ok, v0, 0), tl.where(ok, v1, 0), tl.where(ok, v2, 0), tl.where(ok, v3, 0)
    return _act_pair(v0, v2, False), _act_pair(v0, v2, True), _act_pair(v1, v3, False), _act_pair(v1, v3, True)


@triton.jit
def _scale_pair(s, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """A lane's loaded scale: fp32 under the interpreter, else the DT pair (s, s) as int32."""
    if INTERPRET:
        return s.to(tl.float32)
    bits = s.to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits | (bits << 16)


@triton.jit
def _group_scale(ptrs, INTERPRET: tl.constexpr, STREAM: tl.constexpr):
    """One group scale per lane, in its own dtype; STREAM: loaded without an L1 line (read once)."""
    if STREAM and not INTERPRET:
        return _load_in_place(ptrs, None, True, INTERPRET, True).to(ptrs.dtype.element_ty)
    return tl.load(ptrs)


@triton.jit
def _frag_loads(x_rows, w_rows, s_rows, it, K, GROUP: tl.constexpr, NT: tl.constexpr, TILES: tl.constexpr,
                BK: tl.constexpr, X_VEC: tl.constexpr, INTERPRET: tl.constexpr, W: tl.constexpr,
                STREAM: tl.constexpr = False):
    """Every load of K iteration ``it`` (BK / 128 blocks), raw: per block (activation words per token tile n and
    word q at 4 n + q; per row tile t (top words, bottom words, top scale, bottom scale)). Addresses past K are
    clamped to the last 32 K (always valid; masked in ``_frag_math``). STREAM: the weights' words and scales
    without L1 lines (each is read once; the activation rows keep L1)."""
    c = tl.arange(0, 32 * W) % 4
    loads = ()
    for blk in tl.static_range(BK // 128):
        kc = tl.minimum(it * BK + 128 * blk + 32 * c, K - 32)        # this lane's first K in the block, clamped
        xw = ()
        for n in tl.static_range(NT):
            for q in tl.static_range(4):
                xw = xw + (_x_words(x_rows[n] + kc + 8 * q, X_VEC, INTERPRET),)
        ws = ()
        for t in tl.static_range(TILES):
            ws = ws + ((four_words(w_rows[2 * t] + kc // 8, INTERPRET, STREAM),
                        four_words(w_rows[2 * t + 1] + kc // 8, INTERPRET, STREAM),
                        _group_scale(s_rows[2 * t] + kc // GROUP, INTERPRET, STREAM),
                        _group_scale(s_rows[2 * t + 1] + kc // GROUP, INTERPRET, STREAM)),)
        loads = loads + ((xw, ws),)
    return loads


@triton.jit
def _frag_math(loads, it, K, accs, NT: tl.constexpr, TILES: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
               INTERPRET: tl.constexpr, DT: tl.constexpr, W: tl.constexpr):
    """The MMAs of K iteration ``it`` on its ``_frag_loads``; K past the end contributes zero."""
    c = tl.arange(0, 32 * W) % 4
    for blk in tl.static_range(BK // 128):
        ok = it * BK + 128 * blk + 32 * c < K                            # K is a multiple of 32
        xw, ws = loads[blk]
        xs = ()   # the 32 activations of token 8n + r as B registers, per token tile n and word q: xs[4 n + q]
        for i in tl.static_range(4 * NT):
            xs = xs + (_x_pairs(xw[i], ok, EVEN_K, INTERPRET),)
        new = ()
        for t in tl.static_range(TILES):
            w_top, w_bot, s_top, s_bot = ws[t]
            s_top = _scale_pair(tl.where(ok, s_top, 0.0), DT, INTERPRET)
            s_bot = _scale_pair(tl.where(ok, s_bot, 0.0), DT, INTERPRET)
            for n in tl.static_range(NT):
                acc = (accs[4 * (t * NT + n)], accs[4 * (t * NT + n) + 1], accs[4 * (t * NT + n) + 2],
                       accs[4 * (t * NT + n) + 3])
                for q in tl.static_range(4):
                    acc = _word_step(w_top[q], w_bot[q], s_top, s_bot, xs[4 * n + q], acc, DT, W, INTERPRET)
                new = new + acc
        accs = new
    return accs


@triton.jit
def frag_accumulate(x_rows, w_rows, s_rows, it_lo, it_hi, K, GROUP: tl.constexpr, NT: tl.constexpr,
                    TILES: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, X_VEC: tl.constexpr,
                    INTERPRET: tl.constexpr, DT: tl.constexpr, W: tl.constexpr, PREFETCH: tl.constexpr = False,
                    STREAM: tl.constexpr = False):
    """The K loop of a fragment GEMM over K blocks [it_lo, it_hi) of BK: for TILES 16-row tiles and NT token tiles,
    the 4 · TILES · NT accumulators (tile t, token tile n at 4 (t NT + n); module doc). ``x_rows[n]``: each lane's
    pointer to its token row of tile n (x's dtype DT); ``w_rows[2t]`` / ``w_rows[2t + 1]``: to the first int32 word of
    its rows r / r + 8 of tile t; ``s_rows`` likewise to their first group scale (DT). PREFETCH: the next
    iteration's loads are issued before this iteration's MMAs (a register double buffer). STREAM: the weights
    past L1 (``_frag_loads``)."""
    accs = ()
    for t in tl.static_range(4 * TILES * NT):
        accs = accs + (tl.zeros((32 * W,), dtype=tl.float32),)
    if PREFETCH:
        nxt = _frag_loads(x_rows, w_rows, s_rows, it_lo, K, GROUP, NT, TILES, BK, X_VEC, INTERPRET, W, STREAM)
        for it in range(it_lo, it_hi):
            cur = nxt
            nxt = _frag_loads(x_rows, w_rows, s_rows, it + 1, K, GROUP, NT, TILES, BK, X_VEC, INTERPRET, W, STREAM)
            accs = _frag_math(cur, it, K, accs, NT, TILES, BK, EVEN_K, INTERPRET, DT, W)
    else:
        for it in range(it_lo, it_hi):
            loads = _frag_loads(x_rows, w_rows, s_rows, it, K, GROUP, NT, TILES, BK, X_VEC, INTERPRET, W, STREAM)
            accs = _frag_math(loads, it, K, accs, NT, TILES, BK, EVEN_K, INTERPRET, DT, W)
    return accs


@triton.jit
def _w4a16_frag_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_ym, stride_part,
    GROUP: tl.constexpr, MT: tl.constexpr, NT: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, X_VEC: tl.constexpr, INTERPRET: tl.constexpr, W: tl.constexpr, STREAM: tl.constexpr = False,
    CHUNKS: tl.constexpr = 1,
):
    """y [M <= 8 NT CHUNKS, N] = x @ W^T. x [M, K] (row stride stride_xm), w int32 [N, K/8], s [N, K/GROUP] in x's
    dtype; a program takes BN = 16 · MT · W rows (each warp MT tiles of 16), a K range of whole BK blocks (split-K)
    and one chunk of 8 · NT tokens. The chunks of a row block are consecutive programs (grid axis 0: row block ·
    CHUNKS + chunk), so all but the first read its weights from L2. Per block of 128 K lane (r, c) holds words
    4c .. 4c + 3 of rows r and r + 8 (one 128-bit load each) and the matching 32 activations of token r; the weights
    are scaled before the MMAs, so one accumulator sums all K."""
    T: tl.constexpr = 32 * W
    DT: tl.constexpr = x_ptr.dtype.element_ty
    BN: tl.constexpr = 16 * MT * W
    tl.static_assert(BK % 128 == 0, "the fragment kernel takes K blocks of 128")
    pid = tl.program_id(0)           # row block · CHUNKS + token chunk: its split-K counter too
    pid_n = pid // CHUNKS
    tok0 = (pid % CHUNKS) * (8 * NT)
    pid_k = tl.program_id(1)
    lane = tl.arange(0, T) % 32
    r = lane // 4
    c = lane % 4
    row0 = pid_n * BN + (tl.arange(0, T) // 32) * (16 * MT) + r   # row r of the warp's first tile
    x_rows = ()   # token tok0 + 8n + r of each token tile n (rows past M re-read valid ones)
    for n in tl.static_range(NT):
        x_rows = x_rows + (x_ptr + ((tok0 + 8 * n + r) % M).to(tl.int64) * stride_xm,)
    k_iters = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_iters, SPLIT_K)
    it_lo = pid_k * per_split
    it_hi = tl.minimum(it_lo + per_split, k_iters)

    w_rows = ()
    s_rows = ()
    for t in tl.static_range(MT):
        for half in tl.static_range(2):   # rows r and r + 8 of tile t (rows past N re-read valid ones)
            row = ((row0 + 16 * t + 8 * half) % N).to(tl.int64)
            w_rows = w_rows + (w_ptr + row * (K // 8),)
            s_rows = s_rows + (s_ptr + row * (K // GROUP),)
    accs = frag_accumulate(x_rows, w_rows, s_rows, it_lo, it_hi, K, GROUP, NT, MT, BK, EVEN_K, X_VEC, INTERPRET, DT,
                           W, False, STREAM)

    # lane (r, c) of tiles (t, n) holds rows (r, r, r + 8, r + 8) x tokens 8n + (2c, 2c + 1, 2c, 2c + 1)
    offs = ()     # into the workspace [SPLIT_K, M, N]
    y_offs = ()
    masks = ()
    for t in tl.static_range(MT):
        for n in tl.static_range(NT):
            for q in tl.static_range(4):
                row = row0 + 16 * t + 8 * (q // 2)
                tok = (tok0 + 8 * n + 2 * c + q % 2).to(tl.int64)
                offs = offs + (tok * N + row,)
                y_offs = y_offs + (tok * stride_ym + row,)
                masks = masks + ((tok < M) & (row < N),)
    COUNT: tl.constexpr = 4 * MT * NT   # the shared split-K store on one [T, 2, 2, ...] tensor: each thread keeps its
    store_split_k(_stacked(accs, COUNT), y_ptr + _stacked(y_offs, COUNT), _stacked(masks, COUNT),  # own elements
                  part_ptr + _stacked(offs, COUNT), stride_part, pid_k, count_ptr + pid, SPLIT_K)


@triton.jit
def _stacked(vals, COUNT: tl.constexpr):
    """The COUNT (a power of two) same-shaped tensors of ``vals`` as one tensor, joined pairwise (``tl.join`` adds a
    minor dimension of 2 that stays in the thread: no data moves). Sharing ``store_split_k`` this way also took the
    kernel from 80 to 54 registers at one token tile (sm_90), so twice the programs fit on an SM."""
    out = vals
    for level in tl.static_range(COUNT.bit_length() - 1):
        pairs = ()
        for i in tl.static_range(COUNT >> (level + 1)):
            pairs = pairs + (tl.join(out[2 * i], out[2 * i + 1]),)
        out = pairs
    return out[0]


def frag_plan(n: int, k: int, m: int, sms: int, interpreted: bool = False) -> tuple[int, tuple[int, int, int, int]]:
    """(split, tile) of the launch for ``m`` tokens: the tile of :func:`frag_tile` (or the interpreter's) and its
    split-K, with the programs per SM shared among the token chunks (:func:`frag_chunks`)."""
    mt, bk, w, per_sm = FRAG_INTERPRETER_TILE if interpreted else frag_tile(m)
    chunks = frag_chunks(m)[0]
    return frag_split(n, k, 16 * mt * w, bk, sms, max(1, per_sm // chunks)), (mt, bk, w, per_sm)
