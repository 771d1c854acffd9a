"""``topk_indices``: per-row top-k column indices with -1 for masked (-inf) entries. Semantics: ``reference.py``.

The GPU path is ``torch.topk(sorted=False)`` (PyTorch's radix select, multi-block for long rows) followed by
one ``where``: selection is a scan of the fp32 scores (T·N·4 bytes), and a fused Triton radix select was not
written for lack of evidence that it would be faster. ``benchmarks/bench_dsa.py`` reports the top-k share of
the decode step (``topk_us``), which is the number to watch before writing one.
"""
from __future__ import annotations

import torch

from .._checks import check_tensor
from .reference import topk_indices_reference

__all__ = ["topk_indices", "topk_indices_reference"]


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, N] float -> int32 [T, min(k, N)] (unordered; -1 where the score is -inf)."""
    check_tensor("scores", scores, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=2)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: {k!r} must be a positive int")
    if scores.shape[-1] == 0:
        raise ValueError("scores: needs at least one column")
    return topk_indices_reference(scores, k)
