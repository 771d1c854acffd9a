"""``MLP``: the SwiGLU feed-forward of the dense layers and of the shared experts.

``y = down_proj(silu(gate_proj(x)) * up_proj(x))`` with three :class:`QuantLinear` projections named as
in the checkpoints (``mlp.{gate,up,down}_proj``, ``mlp.shared_experts.{gate,up,down}_proj``), so each
projection's format (BF16, FP8Block, Int4Group) is set by ``fmt`` or later by a plan.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import WeightFormat
from .linear import QuantLinear


class MLP(nn.Module):
    """SwiGLU MLP. ``x: [..., hidden] -> [..., hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, fmt: WeightFormat | None = None,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = QuantLinear(hidden_size, intermediate_size, fmt=fmt, dtype=dtype, device=device)
        self.up_proj = QuantLinear(hidden_size, intermediate_size, fmt=fmt, dtype=dtype, device=device)
        self.down_proj = QuantLinear(intermediate_size, hidden_size, fmt=fmt, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
