"""Pure-torch reference for the lightning indexer's scores over paged keys (fp32, written for clarity).

For query token ``t`` (request ``req_ids[t]``, absolute position ``positions[t]``) and key position ``s``:

    score[t, s] = k_scale(s) · Σ_h weights[t, h] · ReLU(q[t, h] · k(s))      for s ≤ positions[t]
    score[t, s] = -inf                                                       for s > positions[t]

``k(s)`` is the key of token ``s`` of that request, read through the block table
(``page = block_table[req, s // page_size]``, slot ``page · page_size + s % page_size``); ``k_scale(s)`` is its
per-token fp32 scale for e4m3 pages and 1 for float pages. ``weights`` carries every positive per-(t, h) factor
(``weights_proj(x) · H^-0.5 · D^-0.5``, times q's FP8 scale when q is e4m3): positive factors commute with
ReLU, so they are applied after it, as in DeepSeek's ``fp8_index``.
"""
from __future__ import annotations

import torch


def indexer_scores_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                             k_scale: torch.Tensor | None, block_table: torch.Tensor, req_ids: torch.Tensor,
                             positions: torch.Tensor, max_ctx: int | None = None) -> torch.Tensor:
    """q [T, H, D] (e4m3 or float), weights [T, H] fp32, k_cache [P, page_size, D], k_scale [P, page_size]
    or None, block_table int32 [B, max_pages], req_ids int32 [T], positions int [T] -> fp32 [T, max_ctx]."""
    t, _, d = q.shape
    page_size = k_cache.shape[1]
    n = block_table.shape[1] * page_size if max_ctx is None else max_ctx
    s = torch.arange(n, device=q.device)
    valid = s[None, :] <= positions.long()[:, None]                                  # [T, N]
    page_col = (s // page_size).clamp_max(block_table.shape[1] - 1)
    pages = block_table.long()[req_ids.long()][:, page_col]                          # [T, N]
    rows = torch.where(valid, pages * page_size + s % page_size, 0)
    keys = k_cache.reshape(-1, d)[rows].float()                                      # [T, N, D]
    logits = torch.relu(torch.einsum("thd,tnd->thn", q.float(), keys))               # [T, H, N]
    score = torch.einsum("th,thn->tn", weights.float(), logits)
    if k_scale is not None:
        score = score * k_scale.reshape(-1)[rows]
    return torch.where(valid, score, torch.full_like(score, float("-inf")))
