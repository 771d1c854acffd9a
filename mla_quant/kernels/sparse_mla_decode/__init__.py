"""``sparse_mla_decode``: absorbed-form MLA attention over each query's top-k cached tokens (DSA).

Inputs (T query tokens flattened over the requests of a step — decode, or prefill chunks):
``q_nope [T, H, Dl]`` (the absorbed query, ``q_nope · W_uk``) and ``q_pe [T, H, Dr]`` (post-RoPE), both
bf16/fp16/fp32; one layer's MLA pages ``kv_data [num_pages, page_size, W]`` in a ``kv_layout`` kind with
``kv_scales`` (``fp8_e4m3``: ``[num_pages, page_size]`` per token or ``[1]`` per tensor; else None);
``block_table`` int32 ``[B, max_pages]``, ``seq_lens`` int32 ``[B]``, ``req_ids`` int32 ``[T]``; ``indices``
int32 ``[T, K]`` — **logical** token positions of the request (as the top-k op returns them), ``-1`` unused,
translated through the block table inside the kernel (FlashMLA wants physical slots instead).
Output ``(out [T, H, Dl]`` in q_nope's dtype, ``lse [T, H]`` fp32 natural log). Math: ``reference.py``.

The work of one token is split over its top-k list when the grid would otherwise be too small to fill the
GPU (decode at small batch); splits are merged by their log-sum-exp.
"""
from __future__ import annotations

import torch

from .._backend import triton_interpreted, use_triton
from .._checks import check_same_device, check_tensor
from .._gemm_utils import num_sms
from .._host import cdiv, next_power_of_2
from .._pdl import pdl_launch
from ..kv_layout import check_kv_pages
from .reference import gather_kv_rows, sparse_mla_decode_reference

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MAX_SPLITS = 256  # the combine kernel holds every split's partial of a column block at once
# warps per attention program and fp32 partials per merge program (its column block: this / the splits, ≤ 512)
# on the GPU. DSA step at 64k, batch 1 (H200 sweep, interleaved rounds, c5a7276): 4 warps and 4096 partials
# 31.44 µs against 31.73 for 8 warps and 8192 at 8 heads, 39.40 vs 40.92 at 64 heads.
KERNEL_WARPS = 4
COMBINE_PARTIALS = 4096
# the splits' partial outputs (lse stays fp32); bf16 halves the bytes written and merged for one more rounding
# (mla_decode.PARTIAL_DTYPE: the same trade); a sweep setting
PARTIAL_DTYPE = torch.float32

__all__ = ["sparse_mla_decode", "sparse_mla_decode_reference", "gather_kv_rows", "check_kv_pages"]


def _check_inputs(q_nope, q_pe, kv_data, kv_scales, kind, block_table, seq_lens, req_ids, indices,
                  validate: bool) -> None:
    check_tensor("q_nope", q_nope, dtype=FLOATS, ndim=3)
    check_tensor("q_pe", q_pe, dtype=FLOATS, ndim=3)
    t, h, d_latent = q_nope.shape
    d_rope = q_pe.shape[-1]
    if tuple(q_pe.shape[:2]) != (t, h):
        raise ValueError(f"q_pe: shape {tuple(q_pe.shape)} does not match q_nope {tuple(q_nope.shape)}")
    for name, d in (("q_nope", d_latent), ("q_pe", d_rope)):
        if d & (d - 1) or d < 16:
            raise ValueError(f"{name}: last dimension {d} must be a power of two ≥ 16")
    check_kv_pages(kv_data, kv_scales, kind, d_latent, d_rope)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    check_tensor("req_ids", req_ids, dtype=(torch.int32, torch.int64), ndim=1)
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    check_same_device(q_nope=q_nope, q_pe=q_pe, kv_data=kv_data, block_table=block_table, seq_lens=seq_lens,
                      req_ids=req_ids, indices=indices)
    if seq_lens.shape[0] != block_table.shape[0]:
        raise ValueError(f"seq_lens: {seq_lens.shape[0]} entries for {block_table.shape[0]} block-table rows")
    if req_ids.shape[0] != t or indices.shape[0] != t:
        raise ValueError(f"req_ids / indices: {req_ids.shape[0]} / {indices.shape[0]} rows for {t} tokens")
    if indices.shape[1] < 1:
        raise ValueError("indices: needs at least one column")
    if (validate or not q_nope.is_cuda) and t:  # value checks: free on the CPU, one sync on the GPU
        if int(req_ids.min()) < 0 or int(req_ids.max()) >= block_table.shape[0]:
            raise IndexError(f"req_ids: values must lie in [0, {block_table.shape[0]})")
        page_size = kv_data.shape[1]
        if int(seq_lens.max()) > block_table.shape[1] * page_size:
            raise IndexError(f"seq_lens: {int(seq_lens.max())} tokens past the block table's "
                             f"{block_table.shape[1]} pages of {page_size}")
        idx = indices.long()
        live = (idx >= 0) & (idx < seq_lens.long()[req_ids.long()][:, None])
        pages = block_table.long()[req_ids.long()[:, None], torch.where(live, idx, 0) // page_size]
        bad = live & ((pages < 0) | (pages >= kv_data.shape[0]))
        if bad.any():
            tok, j = bad.nonzero()[0].tolist()
            raise IndexError(f"block_table: token {tok}'s index {int(idx[tok, j])} maps to page "
                             f"{int(pages[tok, j])}, not in [0, {kv_data.shape[0]})")


def _num_splits(t: int, head_blocks: int, k: int, block_n: int, device: torch.device) -> int:
    """Enough splits of the top-k list for about two waves of programs (each split ≥ one block of rows)."""
    want = cdiv(2 * num_sms(device), max(t * head_blocks, 1))
    return max(1, min(want, cdiv(k, block_n)))


def _min_rows(head_blocks: int) -> int:
    """The fewest top-k rows per split: 16 when one head block covers the heads, else 32. A program is a few
    dependent DRAM round trips at batch 1, so more splits help until their fp32 partials (heads × splits × 2 KB,
    written and merged) cost more (H200, 64k, 2048 rows, run of 7e866b0: 8 heads 128 splits of 16 rows 11.1 µs,
    64 of 32 12.9, 32 19.5; 64 heads 128 splits 33.3 µs, 64 20.7, 32 27.8)."""
    return 16 if head_blocks == 1 else 32


def sparse_mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_data: torch.Tensor,
                      kv_scales: torch.Tensor | None, kind: str, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, req_ids: torch.Tensor, indices: torch.Tensor,
                      softmax_scale: float, num_splits: int | None = None,
                      validate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse absorbed MLA; see the module docstring. ``num_splits`` overrides the split heuristic;
    ``validate`` checks request ids, lengths and the pages the indices reach on CUDA too (one device sync;
    always done for CPU tensors)."""
    _check_inputs(q_nope, q_pe, kv_data, kv_scales, kind, block_table, seq_lens, req_ids, indices, validate)
    if not use_triton(q_nope, kv_data):
        return sparse_mla_decode_reference(q_nope, q_pe, kv_data, kv_scales, kind, block_table, seq_lens,
                                           req_ids, indices, softmax_scale)
    from .kernel import _combine_splits_kernel, _sparse_mla_decode_kernel

    t, h, d_latent = q_nope.shape
    d_rope = q_pe.shape[-1]
    k = indices.shape[1]
    out = torch.empty((t, h, d_latent), dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q_nope.device)
    if t == 0:
        return out, lse
    interpreted = triton_interpreted()
    dot_bf16 = q_nope.dtype != torch.float32 and not interpreted
    block_h = 16 if h <= 16 else 32
    head_blocks = cdiv(h, block_h)
    splits = min(num_splits or _num_splits(t, head_blocks, k, _min_rows(head_blocks), q_nope.device), MAX_SPLITS)
    block_n = 16 if interpreted or cdiv(k, splits) < 32 else 32   # rows per step
    chunk = cdiv(cdiv(k, splits), block_n) * block_n
    splits = cdiv(k, chunk)
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    indices = indices.contiguous()

    width = kv_data.shape[-1]
    kv, scales, rope, code = kv_data, kv_data, kv_data, 0
    if kind == "fp8_e4m3":
        scales, code = kv_scales, (2 if kv_scales.numel() == 1 else 1)
    elif kind == "fp8_ds_mla":  # three typed views of the same 656-byte rows
        kv = kv_data.view(torch.float8_e4m3fn)
        scales, rope, code = kv_data.view(torch.float32), kv_data.view(torch.bfloat16), 3
    sc_row = width // 4 if code == 3 else 0
    rope_row = width // 2 if code == 3 else 0

    if splits == 1:
        o_buf, l_buf, o_split_stride = out, lse, 0
    else:
        o_buf = torch.empty((t, h, splits, d_latent), dtype=PARTIAL_DTYPE, device=q_nope.device)
        l_buf = torch.empty((t, h, splits), dtype=torch.float32, device=q_nope.device)
        o_split_stride = o_buf.stride(2)
    grid = (t, head_blocks, splits)
    _sparse_mla_decode_kernel[grid](
        q_nope, q_pe, kv, scales, rope, block_table, seq_lens, req_ids, indices, o_buf, l_buf,
        h, k, chunk, softmax_scale * 1.4426950408889634, block_table.shape[1],
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), block_table.stride(0),
        indices.stride(0), o_buf.stride(0), o_buf.stride(1), o_split_stride, l_buf.stride(0), l_buf.stride(1),
        width, sc_row, rope_row,
        DL=d_latent, DR=d_rope, PAGE_SIZE=kv_data.shape[1], KIND=code, DOT_BF16=dot_bf16,
        SINGLE=splits == 1, BLOCK_H=block_h, BLOCK_N=block_n, num_warps=4 if interpreted else KERNEL_WARPS,
        **pdl_launch(q_nope.device, "sparse_mla_decode" if head_blocks == 1 else "sparse_mla_decode_wide"))
    if splits > 1:
        block_s = next_power_of_2(splits)
        block_d = min(d_latent, max(16, COMBINE_PARTIALS // block_s))
        _combine_splits_kernel[(t, h, d_latent // block_d)](
            o_buf, l_buf, out, lse, h, splits, o_buf.stride(0), o_buf.stride(1), o_buf.stride(2),
            l_buf.stride(0), l_buf.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4,
            **pdl_launch(q_nope.device, "sparse_mla_decode_merge"))
    return out, lse
