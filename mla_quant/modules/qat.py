"""Quantization-aware training of routed experts for INT4 serving (the way Moonshot trained Kimi K2).

In QAT mode the experts hold trainable master weights (in the model dtype) and every forward uses their
INT4 fake-quantization ``fq(w) = clamp(round(w / s), -8, 7) · s`` — the exact grid of
:class:`~mla_quant.formats.Int4Group` (compressed-tensors symmetric, ``s = absmax(group) / 7.5`` rounded to
the scale dtype, or scales *frozen* at their checkpoint values). The backward pass is the straight-through
estimator: ``d fq(w) / d w = 1``. Export quantizes the masters with the same functions, so the INT4 model
computes exactly what the fake-quant forward computed.

    qat.enable_qat_(model)             # every StackedExperts -> trainable masters + fake INT4
    ... fine-tune ...
    qat.export_qat_(model)             # back to real Int4Group tensors (compressed-tensors layout)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Int4Group
from ..kernels.int4_quant.reference import int4_codes, int4_group_scales, int4_pack_reference


@dataclass(frozen=True)
class QATConfig:
    """``fmt``: the INT4 format served after export. ``frozen_scales``: keep the group scales the experts had
    when QAT was enabled (from an INT4 checkpoint this reproduces it exactly before any update) instead of
    recomputing ``absmax / 7.5`` from the masters at every step."""

    fmt: Int4Group = field(default_factory=Int4Group)
    frozen_scales: bool = False


def int4_scales(w: torch.Tensor, fmt: Int4Group) -> torch.Tensor:
    """Symmetric group scales of w [..., N, K] -> [..., N, K / group] in the format's scale dtype."""
    flat = w.detach().reshape(-1, w.shape[-1])
    return int4_group_scales(flat, fmt.group_size, fmt.torch_scale_dtype).reshape(*w.shape[:-1], -1)


def _fake_quant_values(w: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    flat = w.detach().reshape(-1, w.shape[-1])
    s = scale.reshape(flat.shape[0], -1)
    q = int4_codes(flat, s, group_size).float()
    return (q * s.float().repeat_interleave(group_size, dim=1)).reshape(w.shape).to(w.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, scale, group_size):
        return _fake_quant_values(w, scale, group_size)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None  # straight-through estimator


def fake_quant_int4(w: torch.Tensor, fmt: Int4Group | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """INT4 fake-quantization of w [..., N, K] with a straight-through gradient (same dtype and shape).
    ``scale`` [..., N, K / group]: fixed scales; None computes them from w (absmax / 7.5)."""
    fmt = fmt or Int4Group()
    fmt.check_shape(w.shape[-2], w.shape[-1])
    if scale is None:
        scale = int4_scales(w, fmt)
    return _FakeQuantSTE.apply(w, scale, fmt.group_size)


def export_int4(w: torch.Tensor, fmt: Int4Group, scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The Int4Group tensors (without ``weight_shape``) of w [..., N, K]: the grid :func:`fake_quant_int4` uses."""
    w = w.detach()
    if scale is None:
        scale = int4_scales(w, fmt)
    flat = w.reshape(-1, w.shape[-1])
    s = scale.reshape(flat.shape[0], -1)
    packed = int4_pack_reference(int4_codes(flat, s, fmt.group_size))
    return {"weight_packed": packed.reshape(*w.shape[:-1], -1), "weight_scale": scale.to(fmt.torch_scale_dtype)}


def qat_experts_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    masters: dict[str, torch.Tensor],
    scales: dict[str, torch.Tensor] | None,
    fmt: Int4Group,
    shared_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable routed experts on fake-quantized masters (only the experts that receive tokens).

    x: [T, H]; masters: {"gate_proj": [E, I, H], "up_proj": [E, I, H], "down_proj": [E, H, I]};
    scales: the same keys with frozen [E, N, K / group] scales, or None. Same math (and order of
    accumulation) as :func:`~mla_quant.kernels.fused_moe.fused_moe_reference`.
    """
    num_experts = masters["gate_proj"].shape[0]
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if not 0 <= e < num_experts:
            continue
        t_idx, j_idx = (topk_ids == e).nonzero(as_tuple=True)
        w = {p: fake_quant_int4(m[e], fmt, None if scales is None else scales[p][e]).float()
             for p, m in masters.items()}
        xe = x[t_idx].float()
        h = (F.silu(xe @ w["gate_proj"].T) * (xe @ w["up_proj"].T)).to(x.dtype)
        y = h.float() @ w["down_proj"].T
        acc = acc.index_add(0, t_idx, y * topk_weights[t_idx, j_idx, None].float())
    if shared_out is not None:
        acc = acc + shared_out.float()
    return acc.to(x.dtype)


def _experts_modules(module: nn.Module):
    return [m for m in module.modules() if hasattr(m, "enable_qat_") and hasattr(m, "export_qat_")]


def enable_qat_(module: nn.Module, config: QATConfig | None = None) -> nn.Module:
    """Switch every stacked-experts module inside ``module`` to QAT mode. Returns ``module``."""
    for m in _experts_modules(module):
        m.enable_qat_(config or QATConfig())
    return module


def export_qat_(module: nn.Module) -> nn.Module:
    """Replace the QAT masters of every stacked-experts module by real INT4 tensors. Returns ``module``."""
    for m in _experts_modules(module):
        if m.qat is not None:
            m.export_qat_()
    return module
