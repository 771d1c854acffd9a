"""Pure-torch reference for ``moe_align``: group token→expert assignments by expert, in blocks of M rows.

An *assignment* is one (token, slot) pair of the router's ``topk_ids [T, k]``; its index is
``a = t * k + j`` (the row-major flat index). The grouped GEMMs process the assignments expert by
expert, ``block_m`` rows at a time, so each expert's list is padded to a multiple of ``block_m``:

* ``sorted_ids [capacity]`` int32: expert 0's assignments in increasing order, then padding up to a
  multiple of ``block_m``, then expert 1's, ...; experts without assignments take no room. Padding and
  the unused tail hold the sentinel ``A = T * k`` (one past the last assignment).
* ``expert_ids [capacity / block_m]`` int32: the expert of each block, -1 for blocks past the end.
* ``num_padded [1]`` int32: the used length of ``sorted_ids`` (a multiple of ``block_m``).

``capacity`` depends only on (A, E, block_m) (:func:`align_capacity`), so the grid of the GEMMs that
follow is known on the host without reading anything back from the device (no sync; CUDA-graph safe).
Assignments whose expert id lies outside ``[0, E)`` (e.g. -1, as expert parallelism marks the experts of
other ranks) are dropped: they appear nowhere.
"""
from __future__ import annotations

import torch


def align_capacity(num_assignments: int, num_experts: int, block_m: int) -> int:
    """An upper bound of ``num_padded``, rounded up to ``block_m``: every expert that receives
    assignments wastes at most ``block_m - 1`` padding rows, and at most min(E, A) experts receive any."""
    worst = num_assignments + min(num_experts, num_assignments) * (block_m - 1)
    return -(-worst // block_m) * block_m


def moe_align_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids: [T, k] integer expert ids -> (sorted_ids [cap] int32, expert_ids [cap / block_m] int32,
    num_padded [1] int32), with cap = align_capacity(T * k, num_experts, block_m)."""
    ids = topk_ids.reshape(-1).long().cpu()
    num_assignments = ids.numel()
    cap = align_capacity(num_assignments, num_experts, block_m)
    sorted_ids = torch.full((cap,), num_assignments, dtype=torch.int32)
    expert_ids = torch.full((cap // block_m,), -1, dtype=torch.int32)
    start = 0
    for e in range(num_experts):
        rows = (ids == e).nonzero().flatten()  # increasing assignment index
        if rows.numel() == 0:
            continue
        sorted_ids[start:start + rows.numel()] = rows.to(torch.int32)
        padded = -(-rows.numel() // block_m) * block_m
        expert_ids[start // block_m:(start + padded) // block_m] = e
        start += padded
    dev = topk_ids.device
    return sorted_ids.to(dev), expert_ids.to(dev), torch.tensor([start], dtype=torch.int32, device=dev)
