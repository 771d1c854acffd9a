"""``MLP``: the SwiGLU feed-forward of the dense layers and of the shared experts.

``y = down_proj(silu(gate_proj(x)) * up_proj(x))`` with three :class:`QuantLinear` projections named as
in the checkpoints (``mlp.{gate,up,down}_proj``, ``mlp.shared_experts.{gate,up,down}_proj``), so each
projection's format (BF16, FP8Block, Int4Group) is set by ``fmt`` or later by a plan.

At one token (bf16 / fp16, on the Triton backend, rows of at least ``w4a16_gemm.HALF2_MIN_ROW_WORDS`` words):

- ``Int4Group`` gate and up: one launch of ``w4a16_swiglu_gemv`` sums both projections and writes h = silu(gate) · up
  (rounded once), and the down projection takes h (``GATE_UP_IN_ONE_LAUNCH``; neither layer's ``forward`` runs, so
  the path is skipped while a forward hook is registered on either);
- else, with an ``Int4Group`` down projection: h is made and put in pair order by one launch
  (``swiglu_pair_order``) and the down projection's half2 GEMV reads those pairs (a :class:`QuantLinear` called on
  :class:`PairedActivations`), instead of two eager elementwise launches (``SWIGLU_PAIRS``).

docs/moe.md "The down projection on pairs made by the SwiGLU" and "The gate and up GEMVs in one launch".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Int4Group, WeightFormat
from ..kernels._backend import use_triton
from ..kernels.w4a16_gemm import HALF2_MIN_ROW_WORDS, swiglu_pair_order, w4a16_swiglu_gemv
from .linear import PairedActivations, QuantLinear

# one token, Int4Group gate and up: both GEMVs and the SwiGLU in one launch (w4a16_swiglu_gemv)
GATE_UP_IN_ONE_LAUNCH = True
# one token, gate or up in another format, an Int4Group down projection: h in pair order from swiglu_pair_order
SWIGLU_PAIRS = True


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
        if self._takes_fused_gate_up(x):
            return self.down_proj(self._fused_gate_up(x)).view(x.shape)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self._takes_pairs(x):
            pairs, scales = swiglu_pair_order(gate.reshape(1, -1), up.reshape(1, -1))
            return self.down_proj(PairedActivations(pairs, scales)).view(x.shape)
        return self.down_proj(F.silu(gate) * up)

    def _one_token_half2(self, x: torch.Tensor, proj: QuantLinear) -> bool:
        """One bf16 / fp16 token for an Int4Group ``proj`` of this dtype whose rows the half2 GEMV takes."""
        return (x.numel() == self.hidden_size and x.dtype in (torch.bfloat16, torch.float16)
                and isinstance(proj.fmt, Int4Group) and proj.dtype == x.dtype
                and proj.in_features // 8 >= HALF2_MIN_ROW_WORDS and use_triton(x))

    def _takes_pairs(self, x: torch.Tensor) -> bool:
        return SWIGLU_PAIRS and self._one_token_half2(x, self.down_proj)

    def _takes_fused_gate_up(self, x: torch.Tensor) -> bool:
        gate, up = self.gate_proj, self.up_proj
        return (GATE_UP_IN_ONE_LAUNCH and self._one_token_half2(x, gate) and self._one_token_half2(x, up)
                and gate.fmt.group_size == up.fmt.group_size and gate.bias is None and up.bias is None
                and gate.weight_scale.dtype == up.weight_scale.dtype and not (_hooked(gate) or _hooked(up)))

    def _fused_gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """h [1, I] = silu(gate_proj(x)) · up_proj(x) by ``w4a16_swiglu_gemv`` (both weights read before the PDL wait
        once both layers have settled, as ``QuantLinear`` does)."""
        gate, up = self.gate_proj, self.up_proj
        settled = [gate.weights_settled(), up.weights_settled()]  # both record this call
        return w4a16_swiglu_gemv(x.reshape(1, -1), gate.weight_packed, gate.weight_scale, up.weight_packed,
                                 up.weight_scale, gate.fmt.group_size, prefetch_weights=all(settled))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"


def _hooked(module: nn.Module) -> bool:
    """Whether a forward hook would see ``module``'s call (the fused gate-up launch calls neither layer)."""
    return bool(module._forward_hooks or module._forward_pre_hooks or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)
