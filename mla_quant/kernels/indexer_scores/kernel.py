"""Triton kernel: lightning-indexer scores over paged keys with the weighted-ReLU head sum fused.

One program = one query token × BLOCK_N key positions: the [H, D] query (all indexer heads, one MMA with
M = heads) against BLOCK_N keys gathered through the block table, ReLU, the per-head weights summed in
registers, times the per-token key scale. Programs past the token's causal limit only write -inf. Consecutive
programs (axis 0 = token) read the same key block, so prefill tokens of one request share it through L2.
With ``HIST`` the program also adds its block's histogram of the scores' top radix digit (the top-k radix
select's first round, ``topk/kernel.py``) into the token's row of the zeroed top-k work buffer, so the select
needs neither that launch nor that pass over the scores.

``_indexer_topk_kernel`` (``indexer_topk``'s one-launch form, decode rows): the whole radix select after the
scores in the same programs, each keeping its block of scores in registers — round 0's histogram, a row barrier,
round 1's histogram, a second row barrier, the candidate compact, and the finish in the row's last program to
arrive (``topk/kernel.py``). The barriers need every program of the launch resident at once: the launcher uses a
cooperative launch (which fails loudly rather than hang when the grid does not fit) and the form only where the
grid is small (``COOP_MAX_PROGRAMS_PER_SM``).
"""
import triton
import triton.language as tl

from ..topk.kernel import SIGN, _descend, _order_key, arrive_and_finish, compact_tile, row_barrier


@triton.jit
def _block_scores(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, tok, start, H, stride_qt, stride_qh,
                  stride_wt, stride_bt, D: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SCALE: tl.constexpr,
                  DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores [BLOCK_N] fp32 of keys start .. start + BLOCK_N of token ``tok`` (-inf past its causal limit)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    # position, request, q and weights are loaded together, before the branch on the position: at one decode
    # token the program is a chain of dependent DRAM round trips (position/request -> page -> keys -> store)
    limit = tl.load(pos_ptr + tok).to(tl.int32) + 1          # keys 0 .. position are visible
    req = tl.load(req_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=offs_h[:, None] < H, other=0.0)
    w = tl.load(w_ptr + tok.to(tl.int64) * stride_wt + offs_h, mask=offs_h < H, other=0.0)
    if start < limit:
        visible = offs_n < limit
        page = tl.load(bt_ptr + req * stride_bt + offs_n // PAGE_SIZE, mask=visible, other=0).to(tl.int64)
        visible = visible & (page >= 0)
        row = page * PAGE_SIZE + offs_n % PAGE_SIZE
        k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=visible[:, None], other=0.0)
        if DOT == 0:    # both e4m3 or both bf16/fp16: tensor-core dot, fp32 accumulate
            logits = tl.dot(q, tl.trans(k))
        elif DOT == 1:  # e4m3 with bf16: e4m3 values are exact in bf16
            logits = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        else:           # fp32 (exact reference mode; the interpreter)
            logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)      # [BLOCK_N]
        if HAS_SCALE:
            score = score * tl.load(ks_ptr + row, mask=visible, other=0.0)
        score = tl.where(visible, score, float("-inf"))
    else:
        score = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    return offs_n, score


@triton.jit
def _digit_histogram(score, count, hist_ptr, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """Add the histogram of the scores' key bits [SHIFT, SHIFT + BITS) (where ``count``) into ``hist_ptr``."""
    digit = ((_order_key(score) ^ SIGN) >> SHIFT) & ((1 << BITS) - 1)
    acc = tl.histogram(digit, 1 << BITS, mask=count)
    bins = tl.arange(0, 1 << BITS)
    tl.atomic_add(hist_ptr + bins, acc, mask=acc > 0, sem="relaxed")


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr, hist_ptr,
                           H, max_ctx, stride_qt, stride_qh, stride_wt, stride_bt, stride_ot, stride_hist,
                           D: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SCALE: tl.constexpr,
                           DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           HIST: tl.constexpr, HIST_SHIFT: tl.constexpr, HIST_BITS: tl.constexpr):
    tok = tl.program_id(0)
    offs_n, score = _block_scores(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, tok,
                                  tl.program_id(1) * BLOCK_N, H, stride_qt, stride_qh, stride_wt, stride_bt,
                                  D, PAGE_SIZE, HAS_SCALE, DOT, BLOCK_H, BLOCK_N)
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + offs_n, score, mask=offs_n < max_ctx)
    if HIST:  # the top-k radix select's first round, fused: histogram of the keys' top HIST_BITS bits
        _digit_histogram(score, offs_n < max_ctx, hist_ptr + tok.to(tl.int64) * stride_hist, HIST_SHIFT, HIST_BITS)


@triton.jit
def _indexer_topk_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, work_ptr, out_ptr, cand_ptr,
                         H, max_ctx, k, stride_qt, stride_qh, stride_wt, stride_bt, stride_out,
                         D: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SCALE: tl.constexpr, DOT: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RADIX: tl.constexpr, NR: tl.constexpr,
                         WORK: tl.constexpr, WORK_P2: tl.constexpr, CAND_BLOCK: tl.constexpr):
    """Scores and their top-k in one (cooperative) launch, grid (T, cdiv(max_ctx, BLOCK_N)): see the module
    docstring. ``work_ptr``: int32 [T, WORK] zeros (left zero); ``out_ptr``: int32 [T, k] (k < max_ctx);
    ``cand_ptr``: int32 [T, 2, max_ctx] scratch."""
    tok = tl.program_id(0)
    offs_n, score = _block_scores(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, tok,
                                  tl.program_id(1) * BLOCK_N, H, stride_qt, stride_qh, stride_wt, stride_bt,
                                  D, PAGE_SIZE, HAS_SCALE, DOT, BLOCK_H, BLOCK_N)
    valid = offs_n < max_ctx
    work = work_ptr + tok.to(tl.int64) * WORK
    _digit_histogram(score, valid, work, 32 - RADIX, RADIX)                           # round 0
    row_barrier(work + (WORK - 6))
    prefix, _ = _descend(work, k, 1, RADIX, NR)
    key = _order_key(score)
    match = valid & ((((key ^ SIGN) >> (32 - RADIX)) & ((1 << RADIX) - 1)) == prefix)
    _digit_histogram(score, match, work + (1 << RADIX), 32 - 2 * RADIX, RADIX)        # round 1
    row_barrier(work + (WORK - 5))
    prefix, need = _descend(work, k, 2, RADIX, NR)
    out = out_ptr + tok.to(tl.int64) * stride_out
    cand_keys = cand_ptr + tok.to(tl.int64) * 2 * max_ctx
    compact_tile(key, offs_n, valid, prefix, k - need, work, out, cand_keys, max_ctx, 2 * RADIX, WORK)
    arrive_and_finish(work, out, cand_keys, max_ctx, k, need, 2, RADIX, WORK, WORK_P2, CAND_BLOCK)
