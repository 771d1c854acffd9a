"""BF16 MLA decode for at most 16 query rows, with whole tiles read by TMA in column chunks (the launcher's BF16 TMA path).

One program per (KV split, request) holds the request's query rows (S·H ≤ 16) and walks its split in tiles of
BLOCK_N tokens, each read as ``D_LAT / CW`` latent chunks of CW columns plus the rope part (TMA descriptors over
the pages as rows; a tile lies in one page). Why chunks: ``kernel.py`` runs the score dot ``q·Kᵀ`` over the 576
columns as one ``mma.sync`` chain (36 dependent m16n8k16 steps per warp and tile on sm_90), and its programs
advanced ~2.1 µs per 64-token tile whatever the bytes cost (H200: the same per-tile time with half of them from
the L2, ``benchmarks/probe_mla_fixed.py`` part ``groups``). Here each chunk's score dot is its own chain (9 steps;
the rope's 4) and the chains are summed, and the PV dot keeps one accumulator per chunk: the same arithmetic,
associated differently (fp32 sums of the chunks' partial dot products).

The split's tiles below every row's causal limit (``seq_len - S_Q + 1``) run unmasked through TMA; the tail tiles
(a partial last page, the causal rows of several query tokens) are read by masked pointer loads, unpipelined (rows
past ``seq_len`` may hold anything, NaN included: they are never read), and their scores masked. Outputs as ``kernel._mla_decode_kernel``: partials (fp32 o, log2 lse) per split, or
the final o and natural-log lse with one split.
"""
import triton
import triton.language as tl

from .._triton_utils import grid_dependency_sync

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _scores(q0, q1, q2, q3, q_pe, k0, k1, k2, k3, k_pe, scale, INTERPRET: tl.constexpr):
    """scale·q·Kᵀ [M, N] as five independent dot chains (four latent chunks and the rope), summed in fp32. Each
    chain is scaled before the sum: Triton folds ``dot(a, b) + c`` into one dot accumulating onto c, which would
    make the chains one again (sm_90 SASS: two chains of 18 steps with plain sums). INTERPRET: the dots in fp32
    (the interpreter's bf16 dot is wrong, DESIGN.md)."""
    if INTERPRET:
        q0, q1, q2, q3, q_pe = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32), q_pe.to(
            tl.float32)
        k0, k1, k2, k3, k_pe = k0.to(tl.float32), k1.to(tl.float32), k2.to(tl.float32), k3.to(tl.float32), k_pe.to(
            tl.float32)
    s0 = tl.dot(q0, tl.trans(k0)) * scale
    s1 = tl.dot(q1, tl.trans(k1)) * scale
    s2 = tl.dot(q2, tl.trans(k2)) * scale
    s3 = tl.dot(q3, tl.trans(k3)) * scale
    s4 = tl.dot(q_pe, tl.trans(k_pe)) * scale
    return ((s0 + s1) + (s2 + s3)) + s4


@triton.jit
def _update(s, visible, m_i, l_i, acc0, acc1, acc2, acc3, k0, k1, k2, k3, MASKED: tl.constexpr,
            INTERPRET: tl.constexpr):
    """The online softmax and PV step of one tile: scores ``s`` [M, N] (log2 domain), ``visible`` [M, N] when
    MASKED."""
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(k0.dtype)
    if INTERPRET:
        p, k0, k1, k2, k3 = p.to(tl.float32), k0.to(tl.float32), k1.to(tl.float32), k2.to(tl.float32), k3.to(tl.float32)
    acc0 = tl.dot(p, k0, acc0 * alpha[:, None])
    acc1 = tl.dot(p, k1, acc1 * alpha[:, None])
    acc2 = tl.dot(p, k2, acc2 * alpha[:, None])
    acc3 = tl.dot(p, k3, acc3 * alpha[:, None])
    return m_new, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _mla_decode_chunked_kernel(
    q_ptr, kv_ptr, bt_ptr, seq_lens_ptr, out_ptr, lse_ptr, lat_desc, rope_desc,
    sm_scale_log2, S_Q, H, NUM_SPLITS, stride_qb, stride_qs, stride_qh, stride_page, stride_row, stride_bt,
    D_LAT: tl.constexpr, D_ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT_OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """``kv_ptr``: the bf16 pages [pages, PAGE_SIZE, row width] (strides ``stride_page``, ``stride_row``; the tail
    tiles' pointer loads); ``lat_desc``: TMA descriptor over them as [pages·page_size, row width] rows with
    [BLOCK_N, D_LAT/4] blocks; ``rope_desc``: the same rows with [BLOCK_N, D_ROPE] blocks. Grid (NUM_SPLITS, batch)."""
    BLOCK_M: tl.constexpr = 16
    CW: tl.constexpr = D_LAT // 4
    CHUNK_PAGES: tl.constexpr = 32  # block-table entries loaded before each run of tiles (kernel.py: pipelining)
    CHUNK_TOKENS: tl.constexpr = CHUNK_PAGES * PAGE_SIZE
    grid_dependency_sync(PDL)
    pid_split, b = tl.program_id(0), tl.program_id(1)
    M = S_Q * H
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    s_idx = rows // H
    h_idx = rows % H
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + s_idx * stride_qs + h_idx * stride_qh
    cols = tl.arange(0, CW)
    rope_cols = tl.arange(0, D_ROPE)
    q0 = tl.load(q_rows[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
    q1 = tl.load(q_rows[:, None] + CW + cols[None, :], mask=row_ok[:, None], other=0.0)
    q2 = tl.load(q_rows[:, None] + 2 * CW + cols[None, :], mask=row_ok[:, None], other=0.0)
    q3 = tl.load(q_rows[:, None] + 3 * CW + cols[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows[:, None] + D_LAT + rope_cols[None, :], mask=row_ok[:, None], other=0.0)

    seq_len = tl.load(seq_lens_ptr + b)
    limit = seq_len - S_Q + 1 + s_idx  # row s sees tokens < limit (causal among the S_Q new tokens)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_split * split_len
    end = tl.minimum(start + split_len, seq_len)
    # tiles [start, full_end) are whole and visible to every row
    full_end = start + tl.maximum(tl.minimum(end, seq_len - S_Q + 1) - start, 0) // BLOCK_N * BLOCK_N
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, CW], tl.float32)
    acc1 = tl.zeros([BLOCK_M, CW], tl.float32)
    acc2 = tl.zeros([BLOCK_M, CW], tl.float32)
    acc3 = tl.zeros([BLOCK_M, CW], tl.float32)
    # whole visible tiles by TMA, the page ids of a chunk of them loaded before its pipelined tile loop
    c_first = start // CHUNK_TOKENS
    c_last = tl.where(full_end > start, tl.cdiv(full_end, CHUNK_TOKENS), c_first)
    for c in range(c_first, c_last):
        c_lo = tl.maximum(start, c * CHUNK_TOKENS)
        c_hi = tl.minimum(full_end, c * CHUNK_TOKENS + CHUNK_TOKENS)
        chunk_idx = c * CHUNK_PAGES + tl.arange(0, CHUNK_PAGES)
        chunk_pages = tl.load(bt_row + chunk_idx, mask=chunk_idx * PAGE_SIZE < full_end, other=0)
        for n0 in range(c_lo, c_hi, BLOCK_N):
            page = tl.sum(tl.where(tl.arange(0, CHUNK_PAGES) == n0 // PAGE_SIZE - c * CHUNK_PAGES, chunk_pages, 0))
            row0 = page * PAGE_SIZE + n0 % PAGE_SIZE
            k0 = lat_desc.load([row0, 0])
            k1 = lat_desc.load([row0, CW])
            k2 = lat_desc.load([row0, 2 * CW])
            k3 = lat_desc.load([row0, 3 * CW])
            k_pe = rope_desc.load([row0, D_LAT])
            s = _scores(q0, q1, q2, q3, q_pe, k0, k1, k2, k3, k_pe, sm_scale_log2, INTERPRET)
            m_i, l_i, acc0, acc1, acc2, acc3 = _update(s, s, m_i, l_i, acc0, acc1, acc2, acc3, k0, k1, k2, k3, False,
                                                       INTERPRET)
    # the tail: masked pointer loads, one tile at a time (its few tiles need no pipeline buffers)
    for n0 in tl.range(full_end, end, BLOCK_N, num_stages=1):
        toks = n0 + tl.arange(0, BLOCK_N)
        tok_ok = toks < end
        page = tl.load(bt_row + toks // PAGE_SIZE, mask=tok_ok, other=0).to(tl.int64)
        tok_rows = kv_ptr + page * stride_page + (toks % PAGE_SIZE) * stride_row
        k0 = tl.load(tok_rows[:, None] + cols[None, :], mask=tok_ok[:, None], other=0.0)
        k1 = tl.load(tok_rows[:, None] + CW + cols[None, :], mask=tok_ok[:, None], other=0.0)
        k2 = tl.load(tok_rows[:, None] + 2 * CW + cols[None, :], mask=tok_ok[:, None], other=0.0)
        k3 = tl.load(tok_rows[:, None] + 3 * CW + cols[None, :], mask=tok_ok[:, None], other=0.0)
        k_pe = tl.load(tok_rows[:, None] + D_LAT + rope_cols[None, :], mask=tok_ok[:, None], other=0.0)
        s = _scores(q0, q1, q2, q3, q_pe, k0, k1, k2, k3, k_pe, sm_scale_log2, INTERPRET)
        visible = tok_ok[None, :] & (toks[None, :] < limit[:, None])
        m_i, l_i, acc0, acc1, acc2, acc3 = _update(s, visible, m_i, l_i, acc0, acc1, acc2, acc3, k0, k1, k2, k3,
                                                   True, INTERPRET)

    empty = l_i == 0.0
    l_use = tl.where(empty, 1.0, l_i)
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(l_use))
    if SPLIT_OUT:  # partials: o [B, NUM_SPLITS, M, D_LAT] (fp32 by default), lse [B, NUM_SPLITS, M] fp32 (log2)
        base = (b * NUM_SPLITS + pid_split).to(tl.int64) * M
        lse_out = lse2
    else:  # final: out [B, S_Q, H, D_LAT] = [B, M, D_LAT], lse [B, M] (natural log)
        base = b.to(tl.int64) * M
        lse_out = lse2 * LN2
    o_rows = out_ptr + (base + rows)[:, None] * D_LAT + cols[None, :]
    o_ty = out_ptr.dtype.element_ty
    tl.store(o_rows, (acc0 / l_use[:, None]).to(o_ty), mask=row_ok[:, None])
    tl.store(o_rows + CW, (acc1 / l_use[:, None]).to(o_ty), mask=row_ok[:, None])
    tl.store(o_rows + 2 * CW, (acc2 / l_use[:, None]).to(o_ty), mask=row_ok[:, None])
    tl.store(o_rows + 3 * CW, (acc3 / l_use[:, None]).to(o_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + base + rows, lse_out, mask=row_ok)
