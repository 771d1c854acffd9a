"""``MoE``: the DeepSeek-V3-style MoE block of Kimi K2.x and GLM 5.x.

``y = Σ_j w_j · Expert_{id_j}(x) + SharedExperts(x)`` with the ``noaux_tc`` :class:`Router` (``gate``), the
routed experts stacked in one weight format (:class:`StackedExperts`, ``experts``) and an :class:`MLP` of
width ``moe_intermediate_size × n_shared_experts`` (``shared_experts``). Module names follow the
checkpoints: ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.{gate,up,down}_proj.*``,
``mlp.shared_experts.{gate,up,down}_proj.*``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats import WeightFormat
from .experts import StackedExperts
from .mlp import MLP
from .router import Router, noaux_tc_route

__all__ = ["MoE", "Router", "StackedExperts", "noaux_tc_route"]


class MoE(nn.Module):
    """``x: [..., hidden] -> [..., hidden]`` (x.dtype). The routed sum is accumulated in fp32, the shared
    experts' output is added to it and the result is rounded once."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, n_routed_experts: int,
                 num_experts_per_tok: int, n_shared_experts: int = 1, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                 expert_fmt: WeightFormat | None = None, shared_fmt: WeightFormat | None = None,
                 router_dtype: torch.dtype = torch.float32, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.hidden_size = hidden_size
        self.gate = Router(hidden_size, n_routed_experts, num_experts_per_tok, n_group, topk_group,
                           routed_scaling_factor, norm_topk_prob, router_dtype=router_dtype, device=device)
        self.experts = StackedExperts(n_routed_experts, hidden_size, moe_intermediate_size, fmt=expert_fmt,
                                      dtype=dtype, device=device)
        self.shared_experts = (MLP(hidden_size, moe_intermediate_size * n_shared_experts, fmt=shared_fmt,
                                   dtype=dtype, device=device) if n_shared_experts > 0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: input has {x.shape[-1]} features, expected {self.hidden_size}")
        tokens = x.reshape(-1, self.hidden_size)
        topk_weights, topk_ids = self.gate(tokens)
        shared = self.shared_experts(tokens) if self.shared_experts is not None else None
        return self.experts(tokens, topk_weights, topk_ids, shared_out=shared).view(x.shape)
