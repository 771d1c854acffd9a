"""Pure-torch reference of MLA prefill in the naive (expanded K/V) form for a ragged batch: plain multi-head
attention per sequence, fp32, written for clarity.

Each sequence b has ``n_q = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` query tokens and ``n_kv`` key/value tokens
(``cu_seqlens_kv``); the queries are the *last* n_q tokens of the sequence (chunked prefill over a cached
prefix of n_kv - n_q tokens), so with ``causal`` query i sees keys ``j ≤ n_kv - n_q + i``.
"""
from __future__ import annotations

import torch


def mla_prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_kv: torch.Tensor, max_seqlen_q: int | None, softmax_scale: float,
                          causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, d_qk], k [T_kv, H, d_qk], v [T_kv, H, d_v] -> (out [T, H, d_v] in q.dtype, lse fp32 [T, H])."""
    t, heads, _ = q.shape
    out = torch.zeros(t, heads, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((t, heads), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
    for b in range(len(cq) - 1):
        qb, kb, vb = q[cq[b]:cq[b + 1]].float(), k[ck[b]:ck[b + 1]].float(), v[ck[b]:ck[b + 1]].float()
        n_q, n_kv = qb.shape[0], kb.shape[0]
        scores = torch.einsum("ihd,jhd->hij", qb, kb) * softmax_scale  # [H, n_q, n_kv]
        if causal:
            visible = torch.arange(n_kv, device=q.device)[None, :] <= (n_kv - n_q + torch.arange(n_q, device=q.device))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        lse[cq[b]:cq[b + 1]] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        out[cq[b]:cq[b + 1]] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), vb)
    return out.to(q.dtype), lse
