"""``Router``: DeepSeek-V3 ``noaux_tc`` top-k routing (Kimi K2.x, GLM 5.x, DeepSeek V3/V3.2).

Math (docs/moe.md, reference/model_specs.md §7), per token, in fp32:

1. ``s = sigmoid(x @ W.T)``: one score per expert.
2. ``c = s + e_score_correction_bias``: the bias (aux-loss-free load balancing) only *selects*.
3. With ``n_group > 1``: the experts form ``n_group`` groups of E / n_group; a group's score is the sum
   of its two largest ``c``; the ``topk_group`` best groups are kept, the other experts get ``c = -inf``.
4. ``ids = topk(c, k)``; ``w = s[ids]`` (the *unbiased* scores); with ``norm_topk_prob``
   ``w /= sum(w) + 1e-20``; ``w *= routed_scaling_factor``.

Ties: the experts (and groups) are chosen by ``torch.topk``, exactly as Hugging Face's
``DeepseekV3TopkRouter`` and DeepSeek's reference do, so the same device picks the same experts as they do.
``torch.topk`` does not promise which of equal values it returns (CPU and CUDA differ), so when the k-th
and (k+1)-th best scores are equal either expert may be chosen; the chosen set is always a valid top-k and
the weights always belong to the chosen ids. The order of the k ids of a token is unspecified.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def noaux_tc_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] (router outputs before the sigmoid); bias: [E].
    Returns (topk_weights fp32 [T, k], topk_ids int64 [T, k])."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    if n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(tokens, experts), float("-inf"))
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


class Router(nn.Module):
    """The MoE gate (checkpoint names ``mlp.gate.weight`` [E, hidden], ``mlp.gate.e_score_correction_bias`` [E]).

    ``x: [..., hidden] -> (topk_weights fp32 [N, k], topk_ids int64 [N, k])`` with N = x.numel() / hidden.
    The logits are computed in fp32 from the stored weight (``router_dtype``, fp32 by default as in
    Hugging Face; GLM 5.2's ``moe_router_dtype: float32``); the correction bias is always fp32.
    """

    def __init__(self, hidden_size: int, n_routed_experts: int, num_experts_per_tok: int, n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0, norm_topk_prob: bool = True,
                 router_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        if n_group < 1 or n_routed_experts % n_group:
            raise ValueError(f"n_group: {n_group} must divide n_routed_experts {n_routed_experts}")
        if n_group > 1 and n_routed_experts // n_group < 2:
            raise ValueError(f"n_group: {n_group} groups of {n_routed_experts // n_group} expert(s); the group "
                             "score sums the top 2 of each group, so groups need at least 2 experts")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group: {topk_group} must lie in [1, n_group={n_group}]")
        if not 1 <= num_experts_per_tok <= n_routed_experts // n_group * topk_group:
            raise ValueError(f"num_experts_per_tok: {num_experts_per_tok} must lie in [1, experts in the kept "
                             f"groups = {n_routed_experts // n_group * topk_group}]")
        self.hidden_size, self.n_routed_experts, self.top_k = hidden_size, n_routed_experts, num_experts_per_tok
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = float(routed_scaling_factor), norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n_routed_experts, hidden_size, dtype=router_dtype, device=device))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(n_routed_experts, dtype=torch.float32, device=device))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> fp32 [N, E] (before the sigmoid)."""
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"Router: input has {x.shape[-1]} features, expected {self.hidden_size}")
        return F.linear(x.reshape(-1, self.hidden_size).float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return noaux_tc_route(self.logits(x), self.e_score_correction_bias, self.top_k, self.n_group,
                              self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, n_routed_experts={self.n_routed_experts}, top_k={self.top_k}, "
                f"n_group={self.n_group}, topk_group={self.topk_group}, "
                f"routed_scaling_factor={self.routed_scaling_factor}, norm_topk_prob={self.norm_topk_prob}")
