"""Pure-torch reference of absorbed MLA decode over paged latents: gather each request's rows through its
block table, dequantize them with ``kv_layout.dequantize_kv_rows``, attend in fp32. Written for clarity.

Shapes: ``B`` requests, ``S`` query tokens per request (1 for plain decode, more for speculative decode),
``H`` heads, ``D = d_latent + d_rope`` (576 for Kimi / GLM), a page holds ``page_size`` rows.
"""
from __future__ import annotations

import torch

from ..kv_layout import dequantize_kv_rows


def gather_kv_rows(kv_data: torch.Tensor, kv_scales: torch.Tensor | None, block_table: torch.Tensor, b: int,
                   n: int, kind: str, d_latent: int, d_rope: int) -> torch.Tensor:
    """The first ``n`` rows of request ``b``, dequantized: fp32 [n, d_latent + d_rope]."""
    page_size = kv_data.shape[1]
    tok = torch.arange(n, device=kv_data.device)
    pages = block_table[b, tok // page_size].long()
    slots = tok % page_size
    rows = kv_data[pages, slots]
    scales = kv_scales
    if kv_scales is not None and kv_scales.numel() > 1:
        scales = kv_scales[pages, slots]
    return dequantize_kv_rows(rows, scales, kind, d_latent, d_rope)


def mla_decode_reference(q: torch.Tensor, kv_data: torch.Tensor, kv_scales: torch.Tensor | None,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, softmax_scale: float, kind: str,
                         d_latent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA attention of ``q`` over each request's cached latents.

    q            [B, S, H, D]  (q_abs ; q_pe): the absorbed no-rope query and the post-RoPE rope query
    kv_data      [num_pages, page_size, width] in the layout of ``kind`` (kv_layout.py)
    kv_scales    fp32 [num_pages, page_size] (fp8_e4m3 per token), [1] (per tensor) or None
    block_table  int32 [B, max_pages], seq_lens int32 [B] (tokens cached, the S new ones included)
    Query ``j`` of request ``b`` sees positions ``< seq_lens[b] - S + j + 1`` (causal among the S tokens).
    Returns ``out`` [B, S, H, d_latent] in q.dtype (the latent-space output, before W_UV) and ``lse``
    fp32 [B, S, H] (natural log-sum-exp of the scaled scores).
    """
    bsz, s_q, heads, d = q.shape
    d_rope = d - d_latent
    out = torch.zeros(bsz, s_q, heads, d_latent, dtype=torch.float32, device=q.device)
    lse = torch.full((bsz, s_q, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        kv = gather_kv_rows(kv_data, kv_scales, block_table, b, n, kind, d_latent, d_rope)  # [n, D]
        scores = torch.einsum("shd,nd->shn", q[b].float(), kv) * softmax_scale           # [S, H, n]
        visible = torch.arange(n, device=q.device)[None, :] < (n - s_q + 1 + torch.arange(s_q, device=q.device))[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.einsum("shn,nc->shc", torch.softmax(scores, dim=-1), kv[:, :d_latent])
    return out.to(q.dtype), lse
