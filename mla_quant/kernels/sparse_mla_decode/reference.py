"""Pure-torch reference for sparse MLA attention in the absorbed (MQA) form over gathered top-k tokens.

For query token ``t`` (request ``r = req_ids[t]``) and head ``h``, over the selected positions
``S_t = {indices[t, j] : 0 ≤ indices[t, j] < seq_lens[r]}`` (``-1`` marks an unused slot):

    logit[h, s] = softmax_scale · (q_nope[t, h] · c(s) + q_pe[t, h] · k_pe(s))        s ∈ S_t
    out[t, h]   = Σ_s softmax(logit[h])_s · c(s)          (the latent output; the caller up-projects it)
    lse[t, h]   = log Σ_s exp(logit[h, s])                (natural log; -inf and out = 0 when S_t is empty)

``c(s) ; k_pe(s)`` is the cached row of token ``s`` of request ``r`` — the RMS-normalised latent and its
post-RoPE key — read through the block table and dequantized from its KV kind (``kv_layout``).
"""
from __future__ import annotations

import torch

from ..kv_layout import dequantize_kv_rows


def gather_kv_rows(kv_data: torch.Tensor, kv_scales: torch.Tensor | None, kind: str, d_latent: int, d_rope: int,
                   block_table: torch.Tensor, req_ids: torch.Tensor, indices: torch.Tensor,
                   seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized rows fp32 [T, K, d_latent + d_rope] at logical ``indices [T, K]`` and their validity [T, K]."""
    page_size = kv_data.shape[1]
    idx = indices.long()
    req = req_ids.long()[:, None]
    valid = (idx >= 0) & (idx < seq_lens.long()[req])
    safe = torch.where(valid, idx, 0)
    pages = block_table.long()[req, (safe // page_size).clamp_max(block_table.shape[1] - 1)]
    valid = valid & (pages >= 0)
    slots = torch.where(valid, pages * page_size + safe % page_size, 0)
    rows = kv_data.reshape(-1, kv_data.shape[-1])[slots]
    scales = None
    if kv_scales is not None:
        scales = kv_scales.reshape(-1) if kv_scales.numel() == 1 else kv_scales.reshape(-1)[slots]
    kv = dequantize_kv_rows(rows, scales, kind, d_latent, d_rope)
    return torch.where(valid[..., None], kv, 0.0), valid


def sparse_mla_decode_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_data: torch.Tensor,
                                kv_scales: torch.Tensor | None, kind: str, block_table: torch.Tensor,
                                seq_lens: torch.Tensor, req_ids: torch.Tensor, indices: torch.Tensor,
                                softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope [T, H, Dl], q_pe [T, H, Dr] -> (out [T, H, Dl] in q_nope's dtype, lse [T, H] fp32)."""
    d_latent, d_rope = q_nope.shape[-1], q_pe.shape[-1]
    kv, valid = gather_kv_rows(kv_data, kv_scales, kind, d_latent, d_rope, block_table, req_ids, indices,
                               seq_lens)
    latent = kv[..., :d_latent]                                                       # [T, K, Dl]
    logits = (torch.einsum("thc,tkc->thk", q_nope.float(), latent)
              + torch.einsum("thr,tkr->thk", q_pe.float(), kv[..., d_latent:])) * softmax_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)                                             # [T, H]
    probs = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("thk,tkc->thc", probs, latent)
    return out.to(q_nope.dtype), lse
