"""Triton kernels: sparse absorbed-MLA attention over gathered top-k rows of paged latents, split over the
top-k list (flash-decoding), and the log-sum-exp combine of the splits.

One program = one query token × BLOCK_H heads × one contiguous chunk of its top-k list. Each step gathers
BLOCK_N cached rows (logical index -> page through the block table -> slot), dequantizes them in registers
(bf16 / e4m3 with a per-token or per-tensor scale / FlashMLA's 656-byte fp8_ds_mla row), and runs two MMAs
([heads, 576] × [576, BLOCK_N] for the logits, [heads, BLOCK_N] × [BLOCK_N, 512] for the output) with an online
softmax in base 2. Every head shares the gathered row (MQA), which is why the absorbed form is used for both
decode and prefill (FlashMLA does the same).
"""
import triton
import triton.language as tl

from .._triton_utils import grid_dependency_sync

LN2 = tl.constexpr(0.6931471805599453)  # globals read in @triton.jit code must be constexpr (Triton >= 3.2)

# KIND: 0 bf16 rows, 1 fp8_e4m3 per-token scale, 2 fp8_e4m3 per-tensor scale, 3 fp8_ds_mla (656-byte rows)


@triton.jit
def _sparse_mla_decode_kernel(qn_ptr, qp_ptr, kv_ptr, sc_ptr, rope_ptr, bt_ptr, sl_ptr, req_ptr, idx_ptr,
                              o_ptr, lse_ptr, H, K, chunk, sm_scale_log2, max_pages,
                              stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_bt, stride_idx_t,
                              stride_o_t, stride_o_h, stride_o_s, stride_l_t, stride_l_h,
                              row_stride, sc_row_stride, rope_row_stride,
                              DL: tl.constexpr, DR: tl.constexpr, PAGE_SIZE: tl.constexpr, KIND: tl.constexpr,
                              DOT_BF16: tl.constexpr, SINGLE: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    offs_l = tl.arange(0, DL)
    offs_r = tl.arange(0, DR)
    hmask = offs_h < H
    qn = tl.load(qn_ptr + tok * stride_qn_t + offs_h[:, None] * stride_qn_h + offs_l[None, :],
                 mask=hmask[:, None], other=0.0)
    qp = tl.load(qp_ptr + tok * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_r[None, :],
                 mask=hmask[:, None], other=0.0)
    if DOT_BF16:
        qn = qn.to(tl.bfloat16)
        qp = qp.to(tl.bfloat16)
    else:
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)
    req = tl.load(req_ptr + tok).to(tl.int64)
    seq_len = tl.load(sl_ptr + req)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, DL), tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, K)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + tok * stride_idx_t + offs_n, mask=offs_n < end, other=-1)
        # the page lookup is bounded by the block table's width, not by seq_len, so it does not wait for the
        # seq_len load (at batch 1 a program is a chain of dependent round trips: request -> page -> rows)
        in_table = (idx >= 0) & (idx < max_pages * PAGE_SIZE)
        page = tl.load(bt_ptr + req * stride_bt + idx // PAGE_SIZE, mask=in_table, other=-1).to(tl.int64)
        valid = in_table & (idx < seq_len) & (page >= 0)
        row = page * PAGE_SIZE + idx % PAGE_SIZE
        lat = tl.load(kv_ptr + row[:, None] * row_stride + offs_l[None, :], mask=valid[:, None], other=0.0)
        if KIND == 3:  # e4m3 latent × one fp32 scale per 128-wide tile; bf16 rope after the scales
            offs_t = tl.arange(0, DL // 128)
            tiles = tl.load(sc_ptr + row[:, None] * sc_row_stride + DL // 4 + offs_t[None, :],
                            mask=valid[:, None], other=0.0)                        # [BLOCK_N, DL / 128]
            lat = tl.reshape(tl.reshape(lat.to(tl.float32), (BLOCK_N, DL // 128, 128)) * tiles[:, :, None],
                             (BLOCK_N, DL))
            rope = tl.load(rope_ptr + row[:, None] * rope_row_stride + (DL + DL // 32) // 2 + offs_r[None, :],
                           mask=valid[:, None], other=0.0).to(tl.float32)
        else:
            rope = tl.load(kv_ptr + row[:, None] * row_stride + DL + offs_r[None, :], mask=valid[:, None],
                           other=0.0).to(tl.float32)
            lat = lat.to(tl.float32)
            if KIND == 1:
                s = tl.load(sc_ptr + row, mask=valid, other=0.0)
                lat = lat * s[:, None]
                rope = rope * s[:, None]
            if KIND == 2:
                tensor_scale = tl.load(sc_ptr)
                lat = lat * tensor_scale
                rope = rope * tensor_scale
        if DOT_BF16:
            lat = lat.to(tl.bfloat16)
            logits = tl.dot(qn, tl.trans(lat)) + tl.dot(qp, tl.trans(rope.to(tl.bfloat16)))
        else:
            logits = (tl.dot(qn, tl.trans(lat), input_precision="ieee")
                      + tl.dot(qp, tl.trans(rope), input_precision="ieee"))
        logits = tl.where(valid[None, :], logits * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(logits - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_BF16:
            pv = tl.dot(p.to(tl.bfloat16), lat)
        else:
            pv = tl.dot(p, lat, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))   # base-2 log-sum-exp
    o_dst = o_ptr + tok * stride_o_t + offs_h[:, None] * stride_o_h + split * stride_o_s + offs_l[None, :]
    tl.store(o_dst, out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    if SINGLE:
        tl.store(lse_ptr + tok * stride_l_t + offs_h * stride_l_h, lse2 * LN2, mask=hmask)
    else:
        tl.store(lse_ptr + tok * stride_l_t + offs_h * stride_l_h + split, lse2, mask=hmask)


@triton.jit
def _combine_splits_kernel(po_ptr, plse_ptr, o_ptr, lse_ptr, H, S,
                           stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h,
                           stride_o_t, stride_o_h, stride_l_t, stride_l_h,
                           BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """One program = one (token, head) × BLOCK_D latent columns. All S partial outputs are loaded as one
    [BLOCK_S, BLOCK_D] tile (no loop over splits: at batch 1 there are up to 64 splits, and a loop would
    chain one L2 round trip per split)."""
    grid_dependency_sync(PDL)
    tok = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < S
    lse_s = tl.load(plse_ptr + tok * stride_pl_t + h * stride_pl_h + offs_s, mask=smask, other=float("-inf"))
    part = tl.load(po_ptr + tok * stride_po_t + h * stride_po_h + offs_s[:, None] * stride_po_s + offs_d[None, :],
                   mask=smask[:, None], other=0.0).to(tl.float32)                   # [BLOCK_S, BLOCK_D]
    mx = tl.max(lse_s, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse_s - mx_safe)                                                    # 0 for empty splits
    total = tl.sum(w, axis=0)
    has = total > 0.0
    out = tl.sum(part * w[:, None], axis=0) / tl.where(has, total, 1.0)
    tl.store(o_ptr + tok * stride_o_t + h * stride_o_h + offs_d, out.to(o_ptr.dtype.element_ty))
    if tl.program_id(2) == 0:
        lse = tl.where(has, (mx + tl.log2(tl.where(has, total, 1.0))) * LN2, float("-inf"))
        tl.store(lse_ptr + tok * stride_l_t + h * stride_l_h, lse)
