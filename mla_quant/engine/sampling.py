"""Next-token sampling: greedy, temperature and top-p (nucleus), seeded per request and output index.

Each sampled token draws from its own generator, seeded by ``(seed, index of the token in the output)``:
a request's tokens are the same whatever it is batched with, and a preempted request that is recomputed
draws the same numbers again. Sampling runs in fp32 on the host (the rows are small); greedy rows take the
argmax on the device.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import SamplingParams

_SEED_MASK = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15   # odd 64-bit constant: distinct seeds spread far apart


def token_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed for output token ``index`` of a request seeded ``seed`` (deterministic)."""
    return ((int(seed) & _SEED_MASK) * _GOLDEN + int(index)) & _SEED_MASK


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise.

    probs: [V] fp32, summing to 1 -> [V]. Ties at the boundary are broken by token id (stable sort)."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    mass_before = sorted_p.cumsum(0) - sorted_p          # mass of the strictly more likely tokens
    keep_sorted = mass_before < top_p                    # always keeps the most likely token
    keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
    out = probs * keep
    return out / out.sum()


def sample_one(logits: torch.Tensor, params: SamplingParams, index: int) -> int:
    """One token from logits [V] (any float dtype, any device)."""
    if params.greedy:
        return int(torch.argmax(logits.float()))
    probs = torch.softmax(logits.detach().float().cpu() / params.temperature, dim=-1)
    probs = top_p_filter(probs, params.top_p)
    gen = torch.Generator().manual_seed(token_seed(params.seed, index))
    return int(torch.multinomial(probs, 1, generator=gen))


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]) -> list[int]:
    """Tokens for a batch: logits [B, V], one ``SamplingParams`` and one output index per row -> B ids."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(indices):
        raise ValueError(f"logits: {tuple(logits.shape)} for {len(params)} params and {len(indices)} indices")
    greedy = [i for i, p in enumerate(params) if p.greedy]
    out = [0] * len(params)
    if greedy:
        rows = torch.argmax(logits[greedy].float(), dim=-1).tolist()   # one transfer for all greedy rows
        for i, t in zip(greedy, rows):
            out[i] = int(t)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = sample_one(logits[i], p, indices[i])
    return out


__all__ = ["sample", "sample_one", "top_p_filter", "token_seed"]
