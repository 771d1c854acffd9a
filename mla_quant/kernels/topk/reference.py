"""Pure-torch reference for the indexer's top-k selection.

``topk_indices(scores [T, N], k)`` -> int32 ``[T, min(k, N)]``: for each row the column indices of its
``min(k, N)`` largest scores, in no particular order, where entries scoring ``-inf`` (masked: past the causal
limit, or unused) come out as ``-1``. A row with fewer than ``k`` finite entries therefore holds all of them
plus ``-1`` padding. Ties at the k-th value are broken arbitrarily: compare selections as sets.
"""
from __future__ import annotations

import torch


def topk_indices_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    kk = min(k, scores.shape[-1])
    values, idx = torch.topk(scores.float(), kk, dim=-1, sorted=False)
    return torch.where(values == float("-inf"), -1, idx).to(torch.int32)
