"""Optional preallocated outputs of the attention ops (``out=`` arguments): checked, or allocated."""
from __future__ import annotations

import torch

from ._checks import check_tensor


def output_buffer(name: str, t: torch.Tensor | None, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``t`` after checking it is a contiguous ``dtype`` tensor of ``shape`` on ``device``; a new empty one if None."""
    if t is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    check_tensor(name, t, dtype=dtype, contiguous=True)
    if tuple(t.shape) != tuple(shape) or t.device != device:
        raise ValueError(f"{name}: expected shape {tuple(shape)} on {device}, got {tuple(t.shape)} on {t.device}")
    return t
