"""``MLP``: the SwiGLU feed-forward of the dense layers and of the shared experts.

``y = down_proj(silu(gate_proj(x)) * up_proj(x))`` with three :class:`QuantLinear` projections named as
in the checkpoints (``mlp.{gate,up,down}_proj``, ``mlp.shared_experts.{gate,up,down}_proj``), so each
projection's format (BF16, FP8Block, Int4Group) is set by ``fmt`` or later by a plan.

One token with an ``Int4Group`` down projection (bf16 / fp16, on the Triton backend, rows of at least
``w4a16_gemm.HALF2_MIN_ROW_WORDS`` words): h = silu(gate) · up is made and put in pair order by one launch
(``swiglu_pair_order``; h rounded once, where eager rounds after the SiLU and after the product) and the down
projection's half2 GEMV reads those pairs (a :class:`QuantLinear` called on :class:`PairedActivations`), instead of two eager elementwise launches and
a GEMV that makes the pairs itself. docs/moe.md "The down projection on pairs made by the SwiGLU".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Int4Group, WeightFormat
from ..kernels._backend import use_triton
from ..kernels.w4a16_gemm import HALF2_MIN_ROW_WORDS, swiglu_pair_order
from .linear import PairedActivations, QuantLinear

SWIGLU_PAIRS = True  # one token: h in pair order from swiglu_pair_order for an Int4Group down projection


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
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self._takes_pairs(x):
            pairs, scales = swiglu_pair_order(gate.reshape(1, -1), up.reshape(1, -1))
            return self.down_proj(PairedActivations(pairs, scales)).view(x.shape)
        return self.down_proj(F.silu(gate) * up)

    def _takes_pairs(self, x: torch.Tensor) -> bool:
        down = self.down_proj
        return (SWIGLU_PAIRS and x.numel() == self.hidden_size and isinstance(down.fmt, Int4Group)
                and down.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16)
                and down.in_features // 8 >= HALF2_MIN_ROW_WORDS and use_triton(x))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
