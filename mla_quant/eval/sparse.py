"""Helpers for measuring DSA models (GLM 5.2) and long contexts: the dense reference of a sparse model, how
far two top-k selections agree, and a plain forward whose attention fits memory at long context.

* :func:`dense_attention` — while open, every ``DSAttention`` of the model attends to every visible token
  (its ``index_topk`` lifted above any context): the dense reference that DSA approximates.
* :func:`selection_overlap` — the fraction of one selection's keys that the other selects too (per query,
  as sets; -1 entries unused).
* :func:`chunked_prefill` — while open, the plain forward's attention (``mla_prefill``, whose pure-torch
  reference holds fp32 [H, T, T] scores per sequence: 34 GB at T = 32k and 8 heads) runs over chunks of
  queries, each with the keys it can see: the same rows, bounded memory.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

SELECTION = r"model\.layers\.(\d+)\.self_attn\.indexer"   # the full layers' indexers (their output: top-k)
PREFILL_CHUNK_BYTES = 1 << 30


def _dsa_layers(model: nn.Module) -> list[nn.Module]:
    from ..modules.dsa import DSAttention

    return [m for m in model.modules() if isinstance(m, DSAttention)]


def is_dsa(model: nn.Module) -> bool:
    """Whether the model has DSA layers (a lightning indexer selects the attended tokens)."""
    return bool(_dsa_layers(model))


@contextmanager
def dense_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Every DSA layer of ``model`` attends densely while open (``index_topk`` set above any context, so the
    layer takes its dense path); restored on exit."""
    layers = _dsa_layers(model)
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no DSA layer")
    before = [a.index_topk for a in layers]
    try:
        for a in layers:
            a.index_topk = 1 << 62
        yield model
    finally:
        for a, k in zip(layers, before):
            a.index_topk = k


@torch.no_grad()
def selection_overlap(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over queries of |ref ∩ other| / |other|: int [..., K] key positions (-1 unused) of two top-k
    selections of the same queries (order within a row does not matter)."""
    if ref.shape[:-1] != other.shape[:-1]:
        raise ValueError(f"other: shape {tuple(other.shape)} does not match ref {tuple(ref.shape)} "
                         "(but for the last dimension)")
    a = ref.long().sort(-1).values.contiguous()
    b = other.long().contiguous()
    pos = torch.searchsorted(a, b).clamp_max(a.shape[-1] - 1)
    used = b >= 0
    hit = (a.gather(-1, pos) == b) & used
    return float(hit.sum(-1).double().div(used.sum(-1).clamp_min(1)).mean())


@contextmanager
def chunked_prefill(max_bytes: int = PREFILL_CHUNK_BYTES) -> Iterator[None]:
    """While open, ``MLAttention``'s prefill attention runs over chunks of queries, each with the keys it sees
    (the rows are those of the unchunked call; its fp32 scores stay under ``max_bytes`` per chunk)."""
    from ..modules import attention

    original = attention.mla_prefill

    def chunked(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, softmax_scale, causal=True, **kwargs):
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
        longest = max(b - a for a, b in zip(ck, ck[1:]))
        rows = max(1, max_bytes // (4 * q.shape[1] * max(1, longest)))
        if (max_seqlen_q is not None and max_seqlen_q <= rows) or kwargs.get("out") is not None \
                or kwargs.get("lse") is not None:
            return original(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, softmax_scale, causal=causal, **kwargs)
        outs, lses = [], []
        for b in range(len(cq) - 1):
            n_q, n_kv = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            for s in range(0, n_q, rows):
                e = min(n_q, s + rows)
                seen = n_kv - n_q + e if causal else n_kv          # keys visible to the chunk's last query
                cu_q = torch.tensor([0, e - s], dtype=torch.int32, device=q.device)
                cu_k = torch.tensor([0, seen], dtype=torch.int32, device=q.device)
                o, lse = original(q[cq[b] + s:cq[b] + e], k[ck[b]:ck[b] + seen], v[ck[b]:ck[b] + seen], cu_q, cu_k,
                                  e - s, softmax_scale, causal=causal, **kwargs)
                outs.append(o)
                lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    attention.mla_prefill = chunked
    try:
        yield
    finally:
        attention.mla_prefill = original


__all__ = ["SELECTION", "is_dsa", "dense_attention", "selection_overlap", "chunked_prefill"]
