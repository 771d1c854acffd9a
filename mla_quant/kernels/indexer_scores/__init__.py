"""``indexer_scores``: lightning-indexer logits over paged keys with the weighted-ReLU head sum fused.

Inputs (T query tokens, flattened over the requests of a step, H indexer heads of D dims):
``q [T, H, D]`` (e4m3, or bf16/fp16/fp32), ``weights [T, H]`` fp32 (all positive per-head factors folded in),
key pages ``k_cache [num_pages, page_size, D]`` with ``k_scale [num_pages, page_size]`` fp32 for e4m3 pages
(None for float pages), ``block_table`` int32 ``[B, max_pages]``, ``req_ids`` int32 ``[T]`` (each token's row in
the block table), ``positions`` ``[T]`` (each token's absolute position: it sees keys ``0 .. position``).
Output: fp32 ``[T, max_ctx]`` with -inf past each token's causal limit (``max_ctx`` defaults to the width of
the block table in tokens). Math: ``reference.py``.
"""
from __future__ import annotations

import torch

from .._backend import triton_interpreted, use_triton
from .._checks import check_same_device, check_tensor
from .._host import cdiv, next_power_of_2
from .._pdl import pdl_launch
from ..indexer_k_append import check_key_pages
from ..topk import RADIX_BITS, RADIX_MAX_ROWS, radix_topk_from, topk_indices
from ..topk.kernel import rounds, work_ints
from .reference import indexer_scores_reference

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
INT = (torch.int32, torch.int64)
# keys per program and warps (GPU). Up to DECODE_TOKENS query tokens (decode, where a program is a chain of
# dependent DRAM round trips) 64 keys over 2 warps: the DSA step (GLM 5.2, 64k, batch 1) 31.23 µs against 31.73
# with 128 keys over 4 warps at 8 heads, 40.72 vs 40.92 at 64 (H200 sweep, interleaved rounds, c5a7276; 256 keys
# 32.03 / 41.36). Prefill keeps 128 keys: consecutive tokens share each key block through L2.
DECODE_TOKENS = 4
DECODE_BLOCK_N, DECODE_WARPS = 64, 2
BLOCK_N = 128
WARPS = None    # None: 4 up to 4096 scores per tile (heads x keys), else 8

__all__ = ["indexer_scores", "indexer_topk", "indexer_scores_reference", "req_ids_from_cu_seqlens",
           "topk_work_buffer", "topk_work_ints"]


def req_ids_from_cu_seqlens(cu_seqlens_q: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int32 [T]: the request (block-table row) of each flattened token, from ``cu_seqlens_q [B + 1]``
    (no host sync)."""
    tokens = torch.arange(num_tokens, device=cu_seqlens_q.device, dtype=cu_seqlens_q.dtype)
    return (torch.searchsorted(cu_seqlens_q[1:].contiguous(), tokens, right=True)).to(torch.int32)


def _check_inputs(q, weights, k_cache, k_scale, block_table, req_ids, positions, max_ctx, validate) -> int:
    check_tensor("q", q, dtype=(FP8, *FLOATS), ndim=3)
    check_tensor("weights", weights, dtype=torch.float32, ndim=2)
    check_key_pages(k_cache, k_scale)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("req_ids", req_ids, dtype=INT, ndim=1)
    check_tensor("positions", positions, dtype=INT, ndim=1)
    check_same_device(q=q, weights=weights, k_cache=k_cache, block_table=block_table, req_ids=req_ids,
                      positions=positions)
    t, h, d = q.shape
    if d != k_cache.shape[-1]:
        raise ValueError(f"q: head dim {d} != key dim {k_cache.shape[-1]}")
    if tuple(weights.shape) != (t, h):
        raise ValueError(f"weights: shape {tuple(weights.shape)}, expected {(t, h)}")
    for name, x in (("req_ids", req_ids), ("positions", positions)):
        if x.shape[0] != t:
            raise ValueError(f"{name}: {x.shape[0]} entries for {t} tokens")
    if d & (d - 1) or d < 16:
        raise ValueError(f"q: head dim {d} must be a power of two ≥ 16")
    page_size = k_cache.shape[1]
    n = block_table.shape[1] * page_size if max_ctx is None else int(max_ctx)
    if n < 1:
        raise ValueError(f"max_ctx: {n} must be positive")
    if (validate or not q.is_cuda) and t:  # value checks: free on the CPU, one sync on the GPU
        if int(req_ids.min()) < 0 or int(req_ids.max()) >= block_table.shape[0]:
            raise IndexError(f"req_ids: values must lie in [0, {block_table.shape[0]})")
        top = int(positions.max())
        if int(positions.min()) < 0 or top >= min(n, block_table.shape[1] * page_size):
            raise IndexError(f"positions: {top} past max_ctx {n} or the block table "
                             f"({block_table.shape[1]} pages of {page_size})")
        need = (torch.arange(block_table.shape[1], device=q.device)[None, :]
                <= (positions.long() // page_size)[:, None])
        pages = block_table.long()[req_ids.long()]
        bad = need & ((pages < 0) | (pages >= k_cache.shape[0]))
        if bad.any():
            tok, col = bad.nonzero()[0].tolist()
            raise IndexError(f"block_table: token {tok} needs page column {col}, which holds "
                             f"{int(pages[tok, col])} (not in [0, {k_cache.shape[0]}))")
    return n


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                   block_table: torch.Tensor, req_ids: torch.Tensor, positions: torch.Tensor,
                   max_ctx: int | None = None, validate: bool = False) -> torch.Tensor:
    """Scores fp32 [T, max_ctx]; see the module docstring. ``validate`` checks request ids, positions and
    the pages they reach on CUDA too (one device sync; always done for CPU tensors)."""
    n = _check_inputs(q, weights, k_cache, k_scale, block_table, req_ids, positions, max_ctx, validate)
    if not use_triton(q, k_cache):
        return indexer_scores_reference(q, weights, k_cache, k_scale, block_table, req_ids, positions, n)
    return _launch(q, weights, k_cache, k_scale, block_table, req_ids, positions, n)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 block_table: torch.Tensor, req_ids: torch.Tensor, positions: torch.Tensor, topk: int,
                 max_ctx: int | None = None, validate: bool = False, fused: bool = True,
                 work: torch.Tensor | None = None) -> torch.Tensor:
    """``topk_indices(indexer_scores(...), topk)``: int32 [T, min(topk, max_ctx)] logical key positions (-1
    unused, unordered). ``fused`` (Triton backend, rows the radix select serves under ``topk_indices``'s
    "auto", ``max_ctx > topk``): the scores kernel also counts the radix select's first digit, so the select
    runs one histogram launch and one pass over the scores fewer (decode at small batch). ``work`` (optional,
    fused path): a kept int32 buffer of zeros, at least [T, ``topk_work_ints()``] (``topk_work_buffer``), whose
    first T rows the select uses and leaves zero again — no memset launch per call; a call that raised midway
    may leave it dirty (make a new one then). Without it each fused call zeroes a new one."""
    n = _check_inputs(q, weights, k_cache, k_scale, block_table, req_ids, positions, max_ctx, validate)
    t = q.shape[0]
    if not (fused and use_triton(q, k_cache) and 0 < t <= RADIX_MAX_ROWS and n > topk):
        return topk_indices(indexer_scores(q, weights, k_cache, k_scale, block_table, req_ids, positions, n),
                            topk)
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk: {topk!r} must be a positive int")
    if work is None:
        work = torch.zeros(t, topk_work_ints(), dtype=torch.int32, device=q.device)
    else:
        check_tensor("work", work, dtype=torch.int32, ndim=2, contiguous=True)
        check_same_device(q=q, work=work)
        if work.shape[0] < t or work.shape[1] != topk_work_ints():
            raise ValueError(f"work: shape {tuple(work.shape)}, expected at least ({t}, {topk_work_ints()})")
        work = work[:t]
    shift, bits = rounds(RADIX_BITS)[0]
    scores = _launch(q, weights, k_cache, k_scale, block_table, req_ids, positions, n, work, shift, bits)
    return radix_topk_from(scores, topk, work, rounds_done=1)


def topk_work_ints() -> int:
    """int32 per row of ``indexer_topk``'s work buffer (the radix select's histograms and counters)."""
    return work_ints(RADIX_BITS)


def topk_work_buffer(device: torch.device | str, rows: int = RADIX_MAX_ROWS) -> torch.Tensor:
    """A zeroed work buffer for ``indexer_topk(..., work=)`` serving up to ``rows`` query tokens per call."""
    return torch.zeros(rows, topk_work_ints(), dtype=torch.int32, device=device)


def _launch(q, weights, k_cache, k_scale, block_table, req_ids, positions, n, hist=None, hist_shift=0,
            hist_bits=1) -> torch.Tensor:
    """The Triton kernel; ``hist`` (int32 [T, ≥ 2^hist_bits], zeroed): add each token's histogram of the
    scores' key bits [hist_shift, hist_shift + hist_bits) (``topk.kernel``'s order-preserving keys)."""
    from .kernel import _indexer_scores_kernel

    t, h, d = q.shape
    out = torch.empty((t, n), dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    weights = weights.contiguous()
    interpreted = triton_interpreted()
    if interpreted or torch.float32 in (q.dtype, k_cache.dtype):
        dot = 2
    elif q.dtype == k_cache.dtype:
        dot = 0
    else:
        dot = 1 if {q.dtype, k_cache.dtype} <= {FP8, torch.bfloat16} else 2
    block_h = max(16, next_power_of_2(h))
    block_n, warps = (DECODE_BLOCK_N, DECODE_WARPS) if t <= DECODE_TOKENS else (BLOCK_N, WARPS)
    block_n = 64 if interpreted else block_n
    grid = (t, cdiv(n, block_n))
    _indexer_scores_kernel[grid](
        q, weights, k_cache, k_scale if k_scale is not None else weights, block_table, req_ids, positions, out,
        hist if hist is not None else out, h, n, q.stride(0), q.stride(1), weights.stride(0),
        block_table.stride(0), out.stride(0), hist.stride(0) if hist is not None else 0,
        D=d, PAGE_SIZE=k_cache.shape[1], HAS_SCALE=k_scale is not None, DOT=dot,
        BLOCK_H=block_h, BLOCK_N=block_n, HIST=hist is not None, HIST_SHIFT=hist_shift, HIST_BITS=hist_bits,
        num_warps=warps or (4 if block_h * block_n <= 4096 else 8), **pdl_launch(q.device, "indexer_scores"))
    return out
