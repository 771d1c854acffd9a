"""Triton kernel: lightning-indexer scores over paged keys with the weighted-ReLU head sum fused.

One program = one query token × BLOCK_N key positions: the [H, D] query (all indexer heads, one MMA with
M = heads) against BLOCK_N keys gathered through the block table, ReLU, the per-head weights summed in
registers, times the per-token key scale. Programs past the token's causal limit only write -inf. Consecutive
programs (axis 0 = token) read the same key block, so prefill tokens of one request share it through L2.
With ``HIST`` the program also adds its block's histogram of the scores' top radix digit (the top-k radix
select's first round, ``topk/kernel.py``) into the token's row of the zeroed top-k work buffer, so the select
needs neither that launch nor that pass over the scores.
"""
import triton
import triton.language as tl

from .._triton_utils import grid_dependency_sync
from ..topk.kernel import SIGN, _order_key


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, bt_ptr, req_ptr, pos_ptr, out_ptr, hist_ptr,
                           H, max_ctx, stride_qt, stride_qh, stride_wt, stride_bt, stride_ot, stride_hist,
                           D: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SCALE: tl.constexpr,
                           DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                           HIST: tl.constexpr, HIST_SHIFT: tl.constexpr, HIST_BITS: tl.constexpr,
                           PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    tok = tl.program_id(0)
    start = tl.program_id(1) * BLOCK_N
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
    out = out_ptr + tok.to(tl.int64) * stride_ot + offs_n
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
    tl.store(out, score, mask=offs_n < max_ctx)
    if HIST:  # the top-k radix select's first round, fused: histogram of the keys' top HIST_BITS bits
        u = _order_key(score) ^ SIGN
        digit = (u >> HIST_SHIFT) & ((1 << HIST_BITS) - 1)
        acc = tl.histogram(digit, 1 << HIST_BITS, mask=offs_n < max_ctx)
        bins = tl.arange(0, 1 << HIST_BITS)
        tl.atomic_add(hist_ptr + tok.to(tl.int64) * stride_hist + bins, acc, mask=acc > 0, sem="relaxed")
