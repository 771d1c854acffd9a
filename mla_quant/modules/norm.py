"""RMSNorm as DeepSeek / Kimi / GLM use it: computed in fp32, the weight applied in fp32, cast back once.

``y = (x·rsqrt(mean(x²) + eps) · w).to(x.dtype)`` — the DeepSeek-V3.2 reference order. Hugging Face casts
the normalised x to the input dtype *before* the weight multiply; in the fp32 reference mode the two are the
same bits, in bf16 ours rounds once instead of twice.
"""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x.dtype (all arithmetic in fp32)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    """``x: [..., dim] -> [..., dim]``; state_dict key ``weight`` (the checkpoints' ``*_layernorm.weight``)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: input has {x.shape[-1]} features, expected {self.dim}")
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
