"""The collectives the parallel transforms use, over a ``torch.distributed`` process group.

Every function takes the group explicitly (``None`` = the default group); nothing here is a module-level
mutable global. The collectives work on gloo (CPU tensors) and NCCL (CUDA tensors). They are inference
collectives: they do not propagate gradients.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class GroupInfo:
    """A process group with this process's rank in it and its size."""

    group: ProcessGroup | None
    rank: int
    world: int


def group_info(group: ProcessGroup | None, what: str) -> GroupInfo:
    """(group, rank, world) for ``group`` (None = the default group), or a clear error when
    ``torch.distributed`` is not initialized."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) first (torchrun sets the environment)")
    return GroupInfo(group, dist.get_rank(group), dist.get_world_size(group))


def all_reduce_(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``t`` over the group, in place; returns ``t``."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_last_dim(t: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """[..., n] on each rank -> [..., world · n], rank r's columns at [r·n, (r+1)·n)."""
    parts = [torch.empty_like(t) for _ in range(info.world)]
    dist.all_gather(parts, t.contiguous(), group=info.group)
    return torch.cat(parts, dim=-1)


def all_gather_rows(t: torch.Tensor, rows: list[int], info: GroupInfo) -> torch.Tensor:
    """Rank r holds ``rows[r]`` rows ``t [rows[r], ...]``; returns all of them in rank order
    ``[sum(rows), ...]`` on every rank. Rows are padded to the largest count for the collective."""
    pad = max(rows)
    buf = t.new_zeros((pad, *t.shape[1:]))
    buf[: t.shape[0]] = t
    parts = [torch.empty_like(buf) for _ in range(info.world)]
    dist.all_gather(parts, buf, group=info.group)
    return torch.cat([p[:n] for p, n in zip(parts, rows)], dim=0)


def exchange_counts(send_counts: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """int64 [world]: how many rows this rank sends to each rank -> how many it receives from each."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return recv


def all_to_all_rows(t: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                    group: ProcessGroup | None) -> torch.Tensor:
    """Rows of ``t [sum(send_counts), ...]`` grouped by destination rank -> the rows the other ranks sent
    here ``[sum(recv_counts), ...]``, grouped by source rank."""
    out = t.new_empty((sum(recv_counts), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=group)
    return out


__all__ = ["GroupInfo", "group_info", "all_reduce_", "all_gather_last_dim", "all_gather_rows", "exchange_counts",
           "all_to_all_rows"]
