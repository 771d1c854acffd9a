"""Pure-torch reference for the fused MoE experts: a loop over experts on dequantized fp32 weights.

For every expert ``e`` and the assignments (t, j) routed to it (``topk_ids[t, j] == e``)::

    g = x[t] @ gate[e].T ;  u = x[t] @ up[e].T          # [n, I], fp32
    h = round_to_x_dtype(silu(g) * u)                   # the intermediate is held in the model dtype
    y = h @ down[e].T                                   # [n, H], fp32
    out[t] += topk_weights[t, j] * y

and ``out (+ shared_out)`` is rounded to ``x.dtype`` once. With ``kind="fp8_block"`` and ``act_quant``
(W8A8), ``x`` and ``h`` are first rounded to e4m3 per token in 1×``act_group`` groups exactly as
:func:`~mla_quant.kernels.fp8_quant.act_quant_fp8` does. Expert ids outside ``[0, E)`` are dropped.

Weights are dicts of stacked tensors keyed by the checkpoint suffixes of their format, with a leading
expert dimension: ``bf16``: ``weight [E, N, K]`` (any float dtype); ``fp8_block``: ``weight [E, N, K]``
e4m3 + ``weight_scale_inv [E, ⌈N/bn⌉, ⌈K/bk⌉]`` fp32; ``int4_group``: ``weight_packed [E, N, K/8]``
int32 + ``weight_scale [E, N, K/group]``. gate and up are ``[E, I, H]``, down is ``[E, H, I]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8_quant.reference import act_quant_fp8_reference, block_dequant_fp8_reference
from ..int4_quant.reference import int4_dequantize_reference

KINDS = ("bf16", "fp8_block", "int4_group")


def dequantize_expert(kind: str, weights: dict[str, torch.Tensor], e: int, group_size: int = 32,
                      block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Expert ``e`` of a stacked projection as a dense fp32 [N, K] matrix."""
    if kind == "bf16":
        return weights["weight"][e].float()
    if kind == "fp8_block":
        return block_dequant_fp8_reference(weights["weight"][e], weights["weight_scale_inv"][e], block, torch.float32)
    if kind == "int4_group":
        return int4_dequantize_reference(weights["weight_packed"][e], weights["weight_scale"][e], group_size,
                                         torch.float32)
    raise ValueError(f"kind: {kind!r} not in {KINDS}")


def _as_computed(a: torch.Tensor, act_quant: bool, act_group: int, ue8m0: bool) -> torch.Tensor:
    """The fp32 values the GEMM multiplies: ``a`` itself, or its per-token FP8 rounding (W8A8)."""
    if not act_quant:
        return a.float()
    q, s = act_quant_fp8_reference(a, act_group, ue8m0)
    return (q.float().unflatten(-1, (-1, act_group)) * s[..., None]).flatten(-2)


def fused_moe_reference(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate: dict[str, torch.Tensor],
    up: dict[str, torch.Tensor],
    down: dict[str, torch.Tensor],
    *,
    kind: str = "bf16",
    group_size: int = 32,
    block: tuple[int, int] = (128, 128),
    act_quant: bool = False,
    act_group: int = 128,
    ue8m0: bool = False,
    shared_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, H]; topk_weights: [T, k]; topk_ids: [T, k] -> [T, H] in x.dtype (written into ``out`` if given)."""
    w8a8 = kind == "fp8_block" and act_quant
    num_experts = next(iter(gate.values())).shape[0]
    xa = _as_computed(x, w8a8, act_group, ue8m0)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():  # the experts that receive tokens, in increasing order
        if not 0 <= e < num_experts:
            continue
        t_idx, j_idx = (topk_ids == e).nonzero(as_tuple=True)
        xe = xa[t_idx]
        g = xe @ dequantize_expert(kind, gate, e, group_size, block).T
        u = xe @ dequantize_expert(kind, up, e, group_size, block).T
        h = (F.silu(g) * u).to(x.dtype)
        y = _as_computed(h, w8a8, act_group, ue8m0) @ dequantize_expert(kind, down, e, group_size, block).T
        acc = acc.index_add(0, t_idx, y * topk_weights[t_idx, j_idx, None].float())
    if shared_out is not None:
        acc = acc + shared_out.float()
    result = acc.to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
