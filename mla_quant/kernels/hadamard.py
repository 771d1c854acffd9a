"""Fast Walsh–Hadamard transform in torch (the rotation DeepSeek applies to indexer q and k before FP8).

``hadamard_transform(x, scale)`` = ``scale · x @ H_n`` with ``H_n`` the Sylvester Hadamard matrix
(``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``), the same ordering as Dao's
``fast_hadamard_transform``. With ``scale = n^-0.5`` it is orthonormal and symmetric, so
``H(q) · H(k) = q · k``: the rotation only spreads outliers over all dimensions so that one FP8 scale per
vector fits them better. log2(n) butterfly passes, computed in fp32.
"""
from __future__ import annotations

import torch


def hadamard_transform(x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """x: [..., n] (n a power of two) -> fp32 [..., n] = scale · x @ H_n (scale defaults to n^-0.5)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    n = x.shape[-1] if x.dim() else 0
    if n < 1 or n & (n - 1):
        raise ValueError(f"x: last dimension {n} must be a positive power of two")
    lead = x.shape[:-1]
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        # pairs (i, i + h) inside blocks of 2h: (a, b) -> (a + b, a - b)
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(*lead, n)
    return y * (n ** -0.5 if scale is None else scale)
