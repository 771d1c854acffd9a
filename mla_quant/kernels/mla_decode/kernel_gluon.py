"""MLA decode over fp8_e4m3 (or fp8_ds_mla) pages for at most 16 query rows, written in Gluon (``fp8_dequant="gluon"``).

One program per (KV split, request); tiles of ``BLOCK_N`` = 64 tokens within one page, staged by TMA in a ring of
``STAGES`` shared-memory slots (latent as two [64, 256] boxes, rope [64, 64]; e4m3 bytes as stored). With ``WS``
(the launcher's default) a TMA warp (``_produce``) issues the copies and the attention warps (``_attend``, 4 by
default) release each slot through an ``empty`` mbarrier; without it the attention warps issue them themselves.
Every dot is an ``mma.sync`` m16n8k16 in fp16 with the 16 query rows as M, so no row is padded:

* scores S [16, 64] = q · Kᵀ: the warps split the tile's tokens (16 each). q lives in shared memory as fp16
  (each row pre-scaled by a power of two into [2^14, 2^15): bf16's 8 significant bits are exact in fp16 there),
  with ``Q_FRAG`` (the launcher's default) laid out so that each lane's A fragment is one 16-byte load already in
  ``mma.sync``'s register order (``q_fragment_layout``);
  Kᵀ is read from the e4m3 tile as the B operand (4 consecutive latent values per 32-bit register, ``k_width``
  4, both operands in that K order) and converted by ``cvt.rn.f16x2.e4m3x2`` (e4m3 ⊂ fp16: exact).
* the per-token scale is not multiplied into anything 16-bit. With s_t the scaled log2 score of token t and
  c_t its scale, the online softmax tracks the row maximum m of s_t + log2 c_t and feeds the PV dot
  p'_t = 2^(s_t + log2 c_t − m) ≤ 1 (fp16-safe whatever the scales), while the denominator sums the fp32
  p'_t / c_t = 2^(s_t − m): out = Σ p'_t v_t / Σ p'_t / c_t = Σ 2^(s_t) c_t v_t / Σ 2^(s_t), v_t the raw e4m3
  values. Numerator and denominator share the one rounded exponent s_t + log2 c_t, so they agree even where
  that sum rounds (|s_t| ~ 1e8 with scales 2^-40 … 2^20).
* O [16, 512] += P' · V: the warps split O's columns (128 each, four [16, 128] accumulators); P' goes through
  shared memory to every warp (with ``P_FRAG``, the launcher's default, a 2 KB buffer in the fragment order of
  ``q_fragment_layout``; else Gluon's layout conversion), V is read from the same e4m3 tile as the B operand, as
  32-bit words with the operand's columns permuted (``_v_operand``).
* ``SWAP_QK`` (off by default: measured slower) computes the scores transposed, S^T = K · qᵀ.
* fp8_ds_mla pages (``SCALE_TILE``: FlashMLA's rows of 512 e4m3, four fp32 scales c_0..c_3 — one per 128-value
  tile —, 64 bf16 rope): each 128-column score dot is scaled by its tile's token scale before they are summed, the
  rope dot runs in bf16 (q_pe as given: bf16 queries only), and the shift takes the token's largest tile scale
  C = max c_j: p'_t = 2^(s_t + log2 C_t − m), denominator p'/C; tile j's accumulator (exactly one of the four [16,
  128] accumulators) takes P'_j = p' · c_j / C ≤ 1. A tile below 2^-14 of its token's largest turns that factor
  into an fp16 subnormal (2^-24 and below: 0) — not seen in real latents (RMS-normalized), but ``"convert"`` has
  no such limit.

The denominator is kept per lane as a [16, 64] sum (no cross-warp reduction per tile) and reduced once at the
end. Tokens at or past the request's length may hold anything (NaN) in their page slots: their scores are
masked and, on the tile that holds them, their V rows zeroed. Output: as ``_mla_decode_kernel`` — the final
[B, M, D_LAT] and natural-log lse, or split partials (fp32 o, log2 lse) for ``combine_splits``.
The interpreter does not run Gluon: the GPU tests check it against the reference.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.runtime.jit import constexpr_function

# Gluon renamed builtins after Triton 3.6 (async_copy_global_to_shared -> async_load, thread_barrier -> barrier): the
# same builtins under either name
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# ... and shared_memory_descriptor._reinterpret -> reinterpret
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

LN2 = gl.constexpr(0.6931471805599453)
# k_width of every dot operand: 4 consecutive K values per thread (one 32-bit word of e4m3), both operands in that K
# order; words_layout and _v_operand build V's operand for exactly this value
KW = gl.constexpr(4)
PRODUCER_REGS = gl.constexpr(48)  # registers of the TMA warp (WS)
LOG2_FLOOR = gl.constexpr(2.0 ** -100)  # token scales below this enter the shift as 2^-100
SCALE_TOKEN = gl.constexpr(1)
SCALE_TENSOR = gl.constexpr(2)
SCALE_TILE = gl.constexpr(3)  # fp8_ds_mla: an fp32 scale per token and 128-value latent tile, bf16 rope


@gluon.jit
def _page_row(page, n0, PAGE_SIZE: gl.constexpr):
    """The row of token ``n0`` in the pages viewed as [pages·page_size, width], its page id being ``page``."""
    return page * PAGE_SIZE + n0 % PAGE_SIZE


@gluon.jit
def _token_scales(sc_ptr, bt_row, n0, toks, valid, stride_sc_page, stride_sc_row, PAGE_SIZE: gl.constexpr):
    """The per-token scales of the tile starting at token ``n0`` (1.0 where not ``valid``: past the split)."""
    page = gl.load(bt_row + n0 // PAGE_SIZE, mask=valid, other=0)
    return gl.load(sc_ptr + page.to(gl.int64) * stride_sc_page + (n0 % PAGE_SIZE + toks) * stride_sc_row,
                   mask=(toks < 0) | valid, other=1.0)


@constexpr_function
def tile_scales_layout(tokens) -> gl.DistributedLinearLayout:
    """Register layout of the tile scales [BLOCK_N, 4]: a token's four scales in one thread's registers (one 16-byte
    load), the tokens where ``tokens`` (the linear layout of the scores' token vector) puts them."""
    tokens = getattr(tokens, "value", tokens)
    return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2]] + [[b[0], 0] for b in tokens.reg_bases],
                                      lane_bases=[[b[0], 0] for b in tokens.lane_bases],
                                      warp_bases=[[b[0], 0] for b in tokens.warp_bases], block_bases=[],
                                      shape=[tokens.shape[0], 4])


@gluon.jit
def _tile_scales(sc_ptr, bt_row, n0, end, stride_sc_page, stride_sc_row, toks_l: gl.constexpr,
                 BLOCK_N: gl.constexpr, PAGE_SIZE: gl.constexpr):
    """fp8_ds_mla: the four latent tiles' scales of the tokens n0 … n0 + BLOCK_N - 1 as four [BLOCK_N] vectors in
    ``toks_l``, 0.0 at and past ``end`` (their page slots may hold anything, NaN included: a zero scale keeps them out
    of every product). One 16-byte load per token."""
    sc_l: gl.constexpr = tile_scales_layout(gl.to_linear_layout(toks_l, [BLOCK_N]))
    toks = gl.arange(0, BLOCK_N, gl.SliceLayout(1, sc_l))
    tile = gl.arange(0, 4, gl.SliceLayout(0, sc_l))
    valid = n0 + toks < end
    page = gl.load(bt_row + n0 // PAGE_SIZE, mask=n0 < end, other=0)
    # (a row's four scales are 16-byte aligned in FlashMLA's layout: 656-byte rows, the scales at byte 512)
    rows = sc_ptr + page.to(gl.int64) * stride_sc_page + gl.multiple_of((n0 % PAGE_SIZE + toks) * stride_sc_row, 4)
    c = gl.load(rows[:, None] + tile[None, :], mask=valid[:, None], other=0.0)   # [BLOCK_N, 4]
    even, odd = gl.split(gl.reshape(c, [BLOCK_N, 2, 2]))                        # tiles (0, 2), (1, 3)
    c0, c2 = gl.split(even)
    c1, c3 = gl.split(odd)
    return (gl.convert_layout(c0, toks_l), gl.convert_layout(c1, toks_l), gl.convert_layout(c2, toks_l),
            gl.convert_layout(c3, toks_l))


@gluon.jit
def _issue_tile(lat_desc, rope_desc, lat_a, lat_b, rope_s, ready, slot, row0, HALF: gl.constexpr,
                ROPE_COL: gl.constexpr):
    """The TMA copies of the tile at page row ``row0`` into ``slot`` (the rope at column ``ROPE_COL`` of its
    descriptor's rows); ``ready[slot]`` completes with its bytes."""
    bar = ready.index(slot)
    mbarrier.expect(bar, 2 * lat_desc.block_type.nbytes + rope_desc.block_type.nbytes)
    _tma_load(lat_desc, [row0, 0], bar, lat_a.index(slot))
    _tma_load(lat_desc, [row0, HALF], bar, lat_b.index(slot))
    _tma_load(rope_desc, [row0, ROPE_COL], bar, rope_s.index(slot))


@gluon.jit
def _fast_log2(x):
    """log2 by the SFU (``lg2.approx``, ~2^-22 relative): the token scales' shift, whose error cancels between the
    numerator's p' and the denominator's p'/c (gl.log2 is a ~20-instruction polynomial per value)."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _fast_rcp(x):
    """1 / x by the SFU (``rcp.approx``, ~1 ulp): the token scales' 1/c for the denominator (``1.0 / x`` is an
    IEEE division, a ~10-instruction sequence)."""
    return gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _as_words(buf):
    """An e4m3 (or bf16) tile [rows, width] in shared memory as int32 words [rows, width / 4] (or width / 2): the same
    bytes, the same swizzle."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=buf.type.layout.swizzle_byte_width,
                                                element_bitwidth=32, rank=2)
    WORDS: gl.constexpr = buf.shape[1] * buf.dtype.primitive_bitwidth // 32
    if _PUBLIC_REINTERPRET:
        words = buf.reinterpret(gl.int32, [buf.shape[0], WORDS], layout)
    else:
        words = buf._reinterpret(gl.int32, [buf.shape[0], WORDS], layout)
    return words


@gluon.jit
def _zero_rows(buf, n_ok, BLOCK_N: gl.constexpr, WIDTH: gl.constexpr, NW: gl.constexpr):
    """Rows >= n_ok of an e4m3 tile [BLOCK_N, WIDTH] in shared memory set to +0 (as 32-bit words)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])
    words = _as_words(buf)
    w = words.load(blk)
    r = gl.arange(0, BLOCK_N, gl.SliceLayout(1, blk))
    words.store(gl.where((r < n_ok)[:, None], w, 0))


# e4m3 x 4 words of 4 consecutive tokens (same 4 latent columns) -> per column, the 4 tokens as two f16x2 registers:
# output j holds column j of the words ($8..$11 = tokens 0..3; PRMT pairs byte j of two tokens, cvt widens a pair)
_V_ASM = gl.constexpr("""{
.reg .b32 p01, p23, q01, q23;
.reg .b16 l0, h0, l1, h1, l2, h2, l3, h3;
prmt.b32 p01, $8, $9, 0x5140;
prmt.b32 p23, $8, $9, 0x7362;
prmt.b32 q01, $10, $11, 0x5140;
prmt.b32 q23, $10, $11, 0x7362;
mov.b32 {l0, h0}, p01;
mov.b32 {l1, h1}, q01;
mov.b32 {l2, h2}, p23;
mov.b32 {l3, h3}, q23;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
cvt.rn.f16x2.e4m3x2 $4, l2;
cvt.rn.f16x2.e4m3x2 $5, l3;
cvt.rn.f16x2.e4m3x2 $6, h2;
cvt.rn.f16x2.e4m3x2 $7, h3;
}""")


@constexpr_function
def q_fragment_layout(width: int) -> gl.SharedLinearLayout:
    """Shared layout of an A operand [16, width] fp16 (q; P' with ``P_FRAG``) in which each lane's fragments are
    contiguous in the order ``mma.sync`` takes its four registers. With ``k_width`` 4, lane (g, t) of a 32-column
    block holds rows g and g + 8 at columns 4t … 4t + 3 and 16 + 4t … 16 + 4t + 3; one m16n8k16 takes the pairs 4t,
    4t + 1 of both 16-column halves (row g | row g + 8 | row g, +16 | row g + 8, +16), the next one the pairs 4t + 2,
    4t + 3. So the offset bits walk col+1, row+8, col+16 (one fragment: 16 bytes, one LDS.128), then the lane
    (col+4, col+8, row+1, +2, +4: a warp's fragments are 512 contiguous bytes, no bank conflict), then col+2 (the
    second fragment), then the 32-column blocks."""
    width = getattr(width, "value", width)
    blocks = [[0, 1 << i] for i in range(5, width.bit_length() - 1)]
    return gl.SharedLinearLayout(offset_bases=[[0, 1], [8, 0], [0, 16], [0, 4], [0, 8], [1, 0], [2, 0], [4, 0], [0, 2]]
                                 + blocks)


@constexpr_function
def words_layout(num_warps: int, block_n: int) -> gl.DistributedLinearLayout:
    """Register layout of the V words [block_n tokens, 8·num_warps word columns] that ``_v_operand`` reads: registers
    walk tokens 1, 2 (the operand's ``k_width`` 4 group), 16, 32, ...; lanes tokens 4, 8 and word columns 1, 2, 4;
    warps word columns 8, 16, ... — the lanes and warps of the PV dot's B operand."""
    while hasattr(num_warps, "value") or hasattr(block_n, "value"):  # (constexprs inside a kernel)
        num_warps, block_n = getattr(num_warps, "value", num_warps), getattr(block_n, "value", block_n)
    regs = [[1, 0], [2, 0]] + [[t, 0] for t in (16, 32, 64, 128) if t < block_n]
    warps = [[0, 8 << i] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]],
                                      warp_bases=warps, block_bases=[], shape=[block_n, 8 * num_warps])


@gluon.jit
def _v_operand(lat, chunk: gl.constexpr, w_l: gl.constexpr, b_l: gl.constexpr, NW: gl.constexpr):
    """The PV dot's B operand [BLOCK_N tokens, CV = 32·NW columns] in fp16 from CV latent columns of an e4m3 tile
    [BLOCK_N, 256] in shared memory, with the columns permuted: operand column n = 8·NW·j + 8·w + r (n8 tile j of
    warp w, lane row r) holds latent column CV·chunk + 32·w + 4·r + j (the output is stored back through the
    inverse). Each lane reads whole 32-bit words (4 columns of one token) for 4 consecutive tokens — the ``k_width``
    4 group of the B operand — and picks byte j of each: no byte-wise shared loads, no transposition in shared
    memory."""
    BLOCK_N: gl.constexpr = lat.shape[0]
    WC: gl.constexpr = 8 * NW  # word columns per chunk
    words = _as_words(lat)
    w = words.slice(chunk * WC, WC, dim=1).load(w_l)  # [BLOCK_N, WC] words
    f0, f1, f2, f3 = gl.inline_asm_elementwise(_V_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w],
                                               dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                               is_pure=True, pack=4)
    v = gl.join(gl.join(f0, f1), gl.join(f2, f3))                 # [t, b, x, y]: latent column 4b + x + 2y
    v = gl.reshape(v, [BLOCK_N, NW, 8, 2, 2])                     # b = 8·w + r
    v = gl.permute(v, [0, 4, 3, 1, 2])                            # [t, y, x, w, r]
    v = gl.reshape(v, [BLOCK_N, 4 * WC])                          # n = 16·NW·y + 8·NW·x + 8·w + r
    # same lanes and warps as the operand layout: only the order of each thread's registers differs
    return gl.convert_layout(v, b_l)


@gluon.jit
def _k_operand(lat, chunk: gl.constexpr, CH: gl.constexpr, b_l: gl.constexpr):
    """The score dot's B operand Kᵀ [CH, BLOCK_N] in fp16: columns CH·chunk … of an e4m3 tile (latent or rope) in
    shared memory (cvt e4m3 -> f16: exact)."""
    return lat.slice(chunk * CH, CH, dim=1).permute((1, 0)).load(b_l).to(gl.float16)


@gluon.jit
def _natural_columns(acc, NW: gl.constexpr, layout: gl.constexpr):
    """An output accumulator [16, CV] with ``_v_operand``'s column order (column n = 8·NW·j + 8·w + r holds latent
    column 32·w + 4·r + j) in latent order, in ``layout``."""
    BM: gl.constexpr = acc.shape[0]
    CV: gl.constexpr = acc.shape[1]
    o = gl.reshape(acc, [BM, 4, NW, 8])     # [row, j, w, r]
    o = gl.permute(o, [0, 2, 3, 1])         # [row, w, r, j]
    return gl.convert_layout(gl.reshape(o, [BM, CV]), layout)


@gluon.jit
def _produce(lat_desc, rope_desc, lat_a, lat_b, rope_s, ready, empty, bt_row, start, n_tiles,
             PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr,
             ROPE_COL: gl.constexpr):
    """The TMA warp (``WS``): tile i into slot i % STAGES once the consumers released the slot's previous tile;
    the block-table entry of the next tile is read while this one's copy is issued."""
    page = gl.load(bt_row + start // PAGE_SIZE, mask=n_tiles > 0, other=0)
    for i in range(n_tiles):
        n0 = start + i * BLOCK_N
        page_next = gl.load(bt_row + (n0 + BLOCK_N) // PAGE_SIZE, mask=i + 1 < n_tiles, other=0)
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        _issue_tile(lat_desc, rope_desc, lat_a, lat_b, rope_s, ready, slot, _page_row(page, n0, PAGE_SIZE), HALF,
                    ROPE_COL)
        page = page_next


@gluon.jit
def _attend(q_ptr, lat_desc, rope_desc, sc_ptr, bt_row, out_ptr, lse_ptr, q_smem, qpe_smem, p_smem, lat_a, lat_b,
            rope_s, ready, empty, sm_scale_log2, S_Q, H, NUM_SPLITS, b, pid_split, seq_len, start, end, n_tiles,
            stride_qb, stride_qs, stride_qh, stride_sc_page, stride_sc_row,
            D_LAT: gl.constexpr, D_ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, SCALE_MODE: gl.constexpr,
            SPLIT_OUT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            WS: gl.constexpr, SWAP_QK: gl.constexpr, P_FRAG: gl.constexpr, ROPE_COL: gl.constexpr):
    """The attention of one (split, request) over its tiles (all the kernel's warps, or the default partition with
    ``WS``: then the TMA warp issues the copies and each tile's slot is released through ``empty``)."""
    BM: gl.constexpr = 16
    HALF: gl.constexpr = D_LAT // 2
    NW: gl.constexpr = gl.num_warps()
    CH: gl.constexpr = 128  # latent columns per score dot
    CV: gl.constexpr = 32 * NW  # latent columns per output accumulator (4 n8 tiles per warp)
    NCV: gl.constexpr = D_LAT // CV  # 4 accumulators with 4 warps, 2 with 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    w_l: gl.constexpr = words_layout(NW, BLOCK_N)
    # SWAP_QK: the score dot transposed, tokens on M (16 per warp), heads on N
    TW: gl.constexpr = BLOCK_N // 16 if NW > BLOCK_N // 16 else NW
    mma_t: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[TW, NW // TW], instr_shape=[16, 8])
    ta_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_t, k_width=KW)
    # SCALE_TILE (fp8_ds_mla): the rope dot in bf16 (q_pe as given, the bf16 rope keys as stored)
    a2_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b2_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    if SCALE_MODE == SCALE_TILE:
        gl.static_assert(D_LAT == 4 * CH and NCV == 4 and not SWAP_QK,
                         "fp8_ds_mla: 4 latent tiles of 128, one per output accumulator (4 warps), scores not swapped")
    tb_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_t, k_width=KW)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, NW], [1, 0])  # q rows
    M = S_Q * H

    # ---- q: [16, D_LAT + D_ROPE] -> fp16 rows scaled by 2^(141 - e), e = the biased exponent of the row's max|q|
    rq = gl.arange(0, BM, gl.SliceLayout(1, ld_l))
    rq_ok = rq < M
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + (rq // H) * stride_qs + (rq % H) * stride_qh
    cl = gl.arange(0, D_LAT, gl.SliceLayout(0, ld_l))
    cr = gl.arange(0, D_ROPE, gl.SliceLayout(0, ld_l))
    q_lat = gl.load(q_rows[:, None] + cl[None, :], mask=rq_ok[:, None], other=0.0).to(gl.float32)
    q_pe = gl.load(q_rows[:, None] + D_LAT + cr[None, :], mask=rq_ok[:, None], other=0.0).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(q_lat), 1), gl.max(gl.abs(q_pe), 1))
    ex = gl.minimum(gl.maximum((amax.to(gl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)
    q_up = ((268 - ex) << 23).to(gl.float32, bitcast=True)     # 2^(141 - ex)
    q_down = ((ex - 14) << 23).to(gl.float32, bitcast=True)    # 2^(ex - 141)
    q_smem.store((q_lat * q_up[:, None]).to(gl.float16))
    if SCALE_MODE == SCALE_TILE:
        qpe_smem.store(q_pe.to(gl.bfloat16))  # (bf16 queries: exact)
    else:
        qpe_smem.store((q_pe * q_up[:, None]).to(gl.float16))
    _cta_barrier()

    rows = gl.arange(0, BM, rows_l)
    limit = seq_len - S_Q + 1 + rows // H  # row r (speculative token r // H) sees tokens < limit_r
    qk_row = gl.convert_layout(q_down, rows_l) * sm_scale_log2
    if SCALE_MODE == SCALE_TENSOR:
        tensor_scale = gl.load(sc_ptr)
        qk_row = qk_row * tensor_scale
    toks = gl.arange(0, BLOCK_N, cols_l)
    if not WS:
        for i in gl.static_range(STAGES - 1):  # prologue: tiles 0 .. STAGES-2
            if i < n_tiles:
                n0 = start + i * BLOCK_N
                page = gl.load(bt_row + n0 // PAGE_SIZE)
                _issue_tile(lat_desc, rope_desc, lat_a, lat_b, rope_s, ready, i, _page_row(page, n0, PAGE_SIZE), HALF,
                            ROPE_COL)
    if SCALE_MODE == SCALE_TOKEN:  # tile i's token scales are loaded during tile i - 1
        c_next = _token_scales(sc_ptr, bt_row, start, toks, n_tiles > 0, stride_sc_page, stride_sc_row, PAGE_SIZE)
    if SCALE_MODE == SCALE_TILE:  # likewise the tile scales
        t0n, t1n, t2n, t3n = _tile_scales(sc_ptr, bt_row, start, end, stride_sc_page, stride_sc_row, cols_l, BLOCK_N,
                                          PAGE_SIZE)

    m_i = gl.full([BM], float("-inf"), gl.float32, rows_l)
    l2 = gl.zeros([BM, BLOCK_N], gl.float32, mma)
    acc0 = gl.zeros([BM, CV], gl.float32, mma)
    acc1 = gl.zeros([BM, CV], gl.float32, mma)
    acc2 = gl.zeros([BM, CV], gl.float32, mma)  # (unused with 8 warps)
    acc3 = gl.zeros([BM, CV], gl.float32, mma)
    for i in range(n_tiles):
        if not WS:
            # every warp is done with tile i-1, whose slot the next copy refills
            _cta_barrier()
            j = i + STAGES - 1
            if j < n_tiles:
                nj = start + j * BLOCK_N
                pj = gl.load(bt_row + nj // PAGE_SIZE)
                _issue_tile(lat_desc, rope_desc, lat_a, lat_b, rope_s, ready, j % STAGES, _page_row(pj, nj, PAGE_SIZE),
                            HALF, ROPE_COL)
        n0 = start + i * BLOCK_N
        tok = n0 + toks
        if SCALE_MODE == SCALE_TOKEN:
            c_t = c_next
            c_next = _token_scales(sc_ptr, bt_row, n0 + BLOCK_N, toks, i + 1 < n_tiles, stride_sc_page,
                                   stride_sc_row, PAGE_SIZE)
        if SCALE_MODE == SCALE_TILE:
            t0, t1, t2, t3 = t0n, t1n, t2n, t3n
            t0n, t1n, t2n, t3n = _tile_scales(sc_ptr, bt_row, n0 + BLOCK_N, end, stride_sc_page, stride_sc_row,
                                              cols_l, BLOCK_N, PAGE_SIZE)
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        la = lat_a.index(slot)
        lb = lat_b.index(slot)
        if n0 + BLOCK_N > seq_len:  # slots past the request's length may hold anything (NaN): zero those rows
            _zero_rows(la, seq_len - n0, BLOCK_N, HALF, NW)
            _zero_rows(lb, seq_len - n0, BLOCK_N, HALF, NW)
            _zero_rows(rope_s.index(slot), seq_len - n0, BLOCK_N, D_ROPE, NW)
            fence_async_shared()  # these generic writes before the TMA's next writes to the slot
            _cta_barrier()

        # scores over the latent (4 chunks of 128) and the rope
        if SWAP_QK:  # S^T = K·q^T: the tokens on M, q^T the B operand (4 consecutive columns per LDS.64, in place)
            st = gl.zeros([BLOCK_N, BM], gl.float32, mma_t)
            for c in gl.static_range(HALF // CH):
                ka = la.slice(c * CH, CH, dim=1).load(ta_l).to(gl.float16)
                st = mma_v2(ka, q_smem.slice(c * CH, CH, dim=1).permute((1, 0)).load(tb_l), st)
            for c in gl.static_range(HALF // CH):
                ka = lb.slice(c * CH, CH, dim=1).load(ta_l).to(gl.float16)
                st = mma_v2(ka, q_smem.slice(HALF + c * CH, CH, dim=1).permute((1, 0)).load(tb_l), st)
            ka = rope_s.index(slot).load(ta_l).to(gl.float16)
            st = mma_v2(ka, qpe_smem.permute((1, 0)).load(tb_l), st)
            s = gl.convert_layout(gl.permute(st, (1, 0)), mma)
        elif SCALE_MODE == SCALE_TILE:  # each latent tile's dot times its per-token scale; the rope in bf16
            z = gl.zeros([BM, BLOCK_N], gl.float32, mma)
            s = mma_v2(q_smem.slice(0, CH, dim=1).load(a_l), _k_operand(la, 0, CH, b_l), z) * t0[None, :]
            s += mma_v2(q_smem.slice(CH, CH, dim=1).load(a_l), _k_operand(la, 1, CH, b_l), z) * t1[None, :]
            s += mma_v2(q_smem.slice(HALF, CH, dim=1).load(a_l), _k_operand(lb, 0, CH, b_l), z) * t2[None, :]
            s += mma_v2(q_smem.slice(HALF + CH, CH, dim=1).load(a_l), _k_operand(lb, 1, CH, b_l), z) * t3[None, :]
            s_rope = mma_v2(qpe_smem.load(a2_l), rope_s.index(slot).permute((1, 0)).load(b2_l), z)
        else:
            s = gl.zeros([BM, BLOCK_N], gl.float32, mma)
            for c in gl.static_range(HALF // CH):
                s = mma_v2(q_smem.slice(c * CH, CH, dim=1).load(a_l), _k_operand(la, c, CH, b_l), s)
            for c in gl.static_range(HALF // CH):
                s = mma_v2(q_smem.slice(HALF + c * CH, CH, dim=1).load(a_l), _k_operand(lb, c, CH, b_l), s)
            s = mma_v2(qpe_smem.load(a_l), _k_operand(rope_s.index(slot), 0, D_ROPE, b_l), s)

        s = s * qk_row[:, None]
        if SCALE_MODE == SCALE_TILE:
            s += s_rope * sm_scale_log2
        if SCALE_MODE == SCALE_TOKEN:
            c_use = gl.maximum(c_t, LOG2_FLOOR)  # (scale 0: an all-zero row, any weight)
            sv = s * c_t[None, :] + _fast_log2(c_use)[None, :]
        elif SCALE_MODE == SCALE_TILE:  # the shift by the token's largest tile scale C; tile c's P' takes c_c / C
            c_use = gl.maximum(gl.maximum(gl.maximum(t0, t1), gl.maximum(t2, t3)), LOG2_FLOOR)
            sv = s + _fast_log2(c_use)[None, :]
        else:
            sv = s
        ok = (tok[None, :] < end) & (tok[None, :] < limit[:, None])
        sv = gl.where(ok, sv, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sv, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sv - m_use[:, None])
        if SCALE_MODE == SCALE_TOKEN or SCALE_MODE == SCALE_TILE:
            # p'/c: the same rounded exponent as the numerator's p' (2^(s - m) from s alone drifts from it by
            # the rounding of s + log2 c once |s| ~ 1e8); one multiply instead of an exp2
            c_rcp = _fast_rcp(c_use)
            l2 = l2 * alpha[:, None] + gl.where(ok, p * c_rcp[None, :], 0.0)
        else:
            l2 = l2 * alpha[:, None] + p
        m_i = m_new
        # the PV dots' A operands: one P' per output accumulator (the same P' for all four unless SCALE_TILE)
        if SCALE_MODE == SCALE_TILE:
            # tile c's V values carry the token's scale c_c: its accumulator takes P'_c = p' · c_c / C <= p' <= 1
            p0 = (p * (t0 * c_rcp)[None, :]).to(gl.float16)
            p1 = (p * (t1 * c_rcp)[None, :]).to(gl.float16)
            p2 = (p * (t2 * c_rcp)[None, :]).to(gl.float16)
            p3 = (p * (t3 * c_rcp)[None, :]).to(gl.float16)
            if P_FRAG:  # the four P' through one fragment-ordered buffer [16, 4·BLOCK_N], one barrier
                p_smem.slice(0, BLOCK_N, dim=1).store(p0)
                p_smem.slice(BLOCK_N, BLOCK_N, dim=1).store(p1)
                p_smem.slice(2 * BLOCK_N, BLOCK_N, dim=1).store(p2)
                p_smem.slice(3 * BLOCK_N, BLOCK_N, dim=1).store(p3)
                _cta_barrier()
                p0 = p_smem.slice(0, BLOCK_N, dim=1).load(a_l)
                p1 = p_smem.slice(BLOCK_N, BLOCK_N, dim=1).load(a_l)
                p2 = p_smem.slice(2 * BLOCK_N, BLOCK_N, dim=1).load(a_l)
                p3 = p_smem.slice(3 * BLOCK_N, BLOCK_N, dim=1).load(a_l)
            else:
                p0 = gl.convert_layout(p0, a_l)
                p1 = gl.convert_layout(p1, a_l)
                p2 = gl.convert_layout(p2, a_l)
                p3 = gl.convert_layout(p3, a_l)
        else:
            if P_FRAG:  # P' through a fragment-ordered buffer: each A fragment one LDS.128 in mma.sync's register order
                p_smem.store(p.to(gl.float16))
                _cta_barrier()
                p0 = p_smem.load(a_l)
            else:
                p0 = gl.convert_layout(p.to(gl.float16), a_l)
            p1 = p0
            p2 = p0
            p3 = p0
        if NCV == 4:
            acc0 = mma_v2(p0, _v_operand(la, 0, w_l, b_l, NW), acc0 * alpha[:, None])
            acc1 = mma_v2(p1, _v_operand(la, 1, w_l, b_l, NW), acc1 * alpha[:, None])
            acc2 = mma_v2(p2, _v_operand(lb, 0, w_l, b_l, NW), acc2 * alpha[:, None])
            acc3 = mma_v2(p3, _v_operand(lb, 1, w_l, b_l, NW), acc3 * alpha[:, None])
        else:
            acc0 = mma_v2(p0, _v_operand(la, 0, w_l, b_l, NW), acc0 * alpha[:, None])
            acc1 = mma_v2(p0, _v_operand(lb, 0, w_l, b_l, NW), acc1 * alpha[:, None])
        if WS:  # every warp of the partition has read the slot: the TMA warp may refill it
            _cta_barrier()
            mbarrier.arrive(empty.index(slot), count=1)

    l_i = gl.sum(l2, 1)
    no_keys = l_i == 0.0  # (rows that saw no token: an empty split)
    l_use = gl.where(no_keys, 1.0, l_i)
    lse2 = gl.where(no_keys, float("-inf"), m_i + gl.log2(l_use))
    inv = 1.0 / l_use
    if SCALE_MODE == SCALE_TENSOR:
        inv = inv * tensor_scale
    row_ok = rows < M
    if SPLIT_OUT:  # partials: o [B, NUM_SPLITS, M, D_LAT] fp32, lse [B, NUM_SPLITS, M] (log2)
        base = (b * NUM_SPLITS + pid_split).to(gl.int64) * M
        lse_out = lse2
    else:  # final: out [B, M, D_LAT], lse [B, M] (natural log)
        base = b.to(gl.int64) * M
        lse_out = lse2 * LN2
    # O leaves in latent order through shared memory (_natural_columns): each warp stores whole rows, 16 bytes per
    # lane (the mma layout's scattered 4-byte stores used 4 of each 32-byte sector)
    st_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
    r_st = gl.arange(0, BM, gl.SliceLayout(1, st_l))
    c_st = gl.arange(0, CV, gl.SliceLayout(0, st_l))
    o_rows = out_ptr + (base + r_st)[:, None] * D_LAT + c_st[None, :]
    st_ok = (r_st < M)[:, None]
    ty = out_ptr.dtype.element_ty
    gl.store(o_rows, _natural_columns(acc0 * inv[:, None], NW, st_l).to(ty), mask=st_ok)
    gl.store(o_rows + CV, _natural_columns(acc1 * inv[:, None], NW, st_l).to(ty), mask=st_ok)
    if NCV == 4:
        gl.store(o_rows + 2 * CV, _natural_columns(acc2 * inv[:, None], NW, st_l).to(ty), mask=st_ok)
        gl.store(o_rows + 3 * CV, _natural_columns(acc3 * inv[:, None], NW, st_l).to(ty), mask=st_ok)
    gl.store(lse_ptr + base + rows, lse_out, mask=row_ok)


@gluon.jit
def _mla_decode_fp8_gluon_kernel(
    q_ptr, lat_desc, rope_desc, sc_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    sm_scale_log2, S_Q, H, NUM_SPLITS,
    stride_qb, stride_qs, stride_qh, stride_sc_page, stride_sc_row, stride_bt,
    D_LAT: gl.constexpr, D_ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr, SCALE_MODE: gl.constexpr,
    SPLIT_OUT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    WS: gl.constexpr, SWAP_QK: gl.constexpr, Q_FRAG: gl.constexpr, P_FRAG: gl.constexpr, ROPE_COL: gl.constexpr,
):
    BM: gl.constexpr = 16
    HALF: gl.constexpr = D_LAT // 2
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    pid_split = gl.program_id(0)
    b = gl.program_id(1)
    # this split's tokens [start, end), whole tiles of BLOCK_N within a page
    seq_len = gl.load(seq_lens_ptr + b)
    split_len = gl.cdiv(gl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_split * split_len
    end = gl.minimum(start + split_len, seq_len)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt

    if Q_FRAG and not SWAP_QK:  # (the transposed score dot reads q through a permuted view: the row layout)
        q_smem = gl.allocate_shared_memory(gl.float16, [BM, D_LAT], q_fragment_layout(D_LAT))
    else:
        q_smem = gl.allocate_shared_memory(gl.float16, [BM, D_LAT], q_sl)
    if SCALE_MODE == SCALE_TILE:  # q_pe in bf16 for the bf16 rope dot (k_width 2: the row layout)
        qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, D_ROPE], q_sl)
    elif Q_FRAG and not SWAP_QK:
        qpe_smem = gl.allocate_shared_memory(gl.float16, [BM, D_ROPE], q_fragment_layout(D_ROPE))
    else:
        qpe_smem = gl.allocate_shared_memory(gl.float16, [BM, D_ROPE], q_sl)
    if P_FRAG and SCALE_MODE == SCALE_TILE:  # one P' per latent tile
        p_smem = gl.allocate_shared_memory(gl.float16, [BM, 4 * BLOCK_N], q_fragment_layout(4 * BLOCK_N))
    elif P_FRAG:  # the PV dot's A operand, staged per tile in the fragment order (unused otherwise)
        p_smem = gl.allocate_shared_memory(gl.float16, [BM, BLOCK_N], q_fragment_layout(BLOCK_N))
    else:
        p_smem = qpe_smem
    lat_a = gl.allocate_shared_memory(lat_desc.dtype, [STAGES, BLOCK_N, HALF], lat_desc.layout)
    lat_b = gl.allocate_shared_memory(lat_desc.dtype, [STAGES, BLOCK_N, HALF], lat_desc.layout)
    rope_s = gl.allocate_shared_memory(rope_desc.dtype, [STAGES, BLOCK_N, D_ROPE], rope_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if WS:
        gl.warp_specialize([
            (_attend, (q_ptr, lat_desc, rope_desc, sc_ptr, bt_row, out_ptr, lse_ptr, q_smem, qpe_smem, p_smem, lat_a,
                       lat_b, rope_s, ready, empty, sm_scale_log2, S_Q, H, NUM_SPLITS, b, pid_split, seq_len, start,
                       end, n_tiles, stride_qb, stride_qs, stride_qh, stride_sc_page, stride_sc_row,
                       D_LAT, D_ROPE, PAGE_SIZE, SCALE_MODE, SPLIT_OUT, BLOCK_N, STAGES, WS, SWAP_QK, P_FRAG,
                       ROPE_COL)),
            (_produce, (lat_desc, rope_desc, lat_a, lat_b, rope_s, ready, empty, bt_row, start, n_tiles,
                        PAGE_SIZE, BLOCK_N, STAGES, HALF, ROPE_COL)),
        ], [1], [PRODUCER_REGS])
    else:
        _attend(q_ptr, lat_desc, rope_desc, sc_ptr, bt_row, out_ptr, lse_ptr, q_smem, qpe_smem, p_smem, lat_a, lat_b,
                rope_s, ready, empty, sm_scale_log2, S_Q, H, NUM_SPLITS, b, pid_split, seq_len, start, end,
                n_tiles, stride_qb, stride_qs, stride_qh, stride_sc_page, stride_sc_row,
                D_LAT, D_ROPE, PAGE_SIZE, SCALE_MODE, SPLIT_OUT, BLOCK_N, STAGES, WS, SWAP_QK, P_FRAG, ROPE_COL)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
