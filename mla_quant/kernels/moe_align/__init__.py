"""``moe_align``: sort token→expert assignments by expert and pad each expert to ``block_m`` rows.

The layout (``sorted_ids``, ``expert_ids``, ``num_padded``) is specified in ``reference.py`` and in
docs/moe.md. Small batches (all assignments in one program) run one Triton kernel; larger ones run
:func:`moe_align_torch`, a few device-side torch ops. Neither reads anything back to the host.
"""
from __future__ import annotations

import torch

from .._backend import use_triton
from .._checks import check_tensor
from .._host import next_power_of_2
from .reference import align_capacity, moe_align_reference

MAX_ASSIGNMENTS = 8192  # one program sorts this many (token, slot) pairs
INT_DTYPES = (torch.int32, torch.int64)

__all__ = ["moe_align", "moe_align_torch", "moe_align_reference", "align_capacity", "MAX_ASSIGNMENTS"]


def _check(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    check_tensor("topk_ids", topk_ids, dtype=INT_DTYPES, ndim=2)
    if num_experts < 1:
        raise ValueError(f"num_experts: must be positive, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m: {block_m} must be a positive power of two")


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """topk_ids: [T, k] -> (sorted_ids [cap] int32, expert_ids [cap / block_m] int32, num_padded [1] int32).

    cap = :func:`align_capacity` (T·k, num_experts, block_m). Ids outside [0, num_experts) are dropped.
    """
    _check(topk_ids, num_experts, block_m)
    num_assignments = topk_ids.numel()
    if not use_triton(topk_ids):
        return moe_align_reference(topk_ids, num_experts, block_m)
    if num_assignments > MAX_ASSIGNMENTS or num_assignments == 0:
        return moe_align_torch(topk_ids, num_experts, block_m)
    from .kernel import _moe_align_kernel

    dev = topk_ids.device
    cap = align_capacity(num_assignments, num_experts, block_m)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    # at least 16 lanes everywhere: no degenerate one-element sorts or histograms
    block_a = max(16, next_power_of_2(num_assignments))
    block_e = max(16, next_power_of_2(num_experts + 1))
    _moe_align_kernel[(1,)](
        topk_ids.contiguous(), sorted_ids, expert_ids, num_padded, num_assignments, num_experts, cap,
        BLOCK_M=block_m, BLOCK_A=block_a, BLOCK_E=block_e, BLOCK_FILL=min(1024, max(16, next_power_of_2(cap))),
        BLOCK_B=max(16, 8192 // block_e), num_warps=max(4, min(16, block_a // 256)))
    return sorted_ids, expert_ids, num_padded


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """The same result as :func:`moe_align` from device-side torch ops only (stable sort + scatter)."""
    _check(topk_ids, num_experts, block_m)
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    num_assignments = ids.numel()
    cap = align_capacity(num_assignments, num_experts, block_m)
    bucket = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # dropped -> bucket E
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts[num_experts] = 0
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    cnt_start = counts.cumsum(0) - counts
    order = torch.argsort(bucket, stable=True)
    s_bucket = bucket[order]
    dest = pad_start[s_bucket] + torch.arange(num_assignments, device=dev) - cnt_start[s_bucket]
    dest = torch.where(s_bucket < num_experts, dest, cap)  # dropped ones land in a spare last slot
    sorted_ids = torch.full((cap + 1,), num_assignments, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    total = pad_end[-1:]
    row0 = torch.arange(0, cap, block_m, device=dev)
    owner = torch.searchsorted(pad_end[:num_experts], row0, right=True)
    expert_ids = torch.where(row0 < total, owner, -1).to(torch.int32)
    return sorted_ids[:cap], expert_ids, total.to(torch.int32)
