"""``kv_append``: write a step's new MLA KV rows into one layer's pages, quantizing on the way (in place).

Pages hold rows in the layouts of ``kv_layout`` (``data [num_pages, page_size, width]``; per-token fp8 scales
``[num_pages, page_size]``; a per-tensor scale ``[1]``). ``slot_mapping [T]`` gives each row's physical slot
``page · page_size + offset`` (``PagedBatch.slot_mapping``); negative slots are skipped (padding tokens).
Slots must be distinct within one call.
"""
from __future__ import annotations

import torch

from .._backend import use_triton
from .._checks import check_same_device, check_tensor
from .._host import cdiv, next_power_of_2
from ..kv_layout import DS_MLA_TILE, KV_KINDS, check_kv_pages
from .reference import kv_append_reference

FLOATS = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["kv_append", "kv_append_reference", "check_kv_pages", "check_slot_mapping"]


def check_slot_mapping(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Host-side check (syncs on CUDA): slots are -1 (skip) or in [0, num_slots), and distinct."""
    used = slot_mapping[slot_mapping >= 0]
    if (slot_mapping < -1).any():
        raise IndexError(f"slot_mapping: negative slot {int(slot_mapping.min())} (only -1 means skip)")
    if used.numel():
        hi = int(used.max())
        if hi >= num_slots:
            raise IndexError(f"slot_mapping: slot {hi} past the {num_slots} slots of the pages")
        if torch.unique(used).numel() != used.numel():
            raise ValueError("slot_mapping: a slot appears twice in one append")


def kv_append(rows: torch.Tensor, slot_mapping: torch.Tensor, data: torch.Tensor,
              scales: torch.Tensor | None, kind: str = "bf16", scale: str = "token", d_latent: int = 512,
              check_slots: bool | None = None) -> None:
    """Quantize ``rows [T, d_latent + d_rope]`` (bf16/fp16/fp32) into the pages at ``slot_mapping [T]``.

    ``check_slots``: None checks slot ranges and duplicates on CPU tensors only (no GPU sync); True
    checks on every device (one host sync); False trusts the caller (``PageAllocator.plan`` builds slots
    that are valid by construction). The kernel never writes outside the pages whatever the slots.
    """
    check_tensor("rows", rows, dtype=FLOATS, ndim=2)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1)
    t, d = rows.shape
    if not 0 < d_latent < d:
        raise ValueError(f"d_latent: {d_latent} must lie in (0, {d}) for rows of {d} features")
    check_kv_pages(data, scales, kind, d_latent, d - d_latent, scale, names=("data", "scales"))
    check_same_device(rows=rows, slot_mapping=slot_mapping, data=data)
    if slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {t} rows")
    if rows.stride(-1) != 1:
        raise ValueError("rows: the last dimension must be contiguous")
    num_slots = data.shape[0] * data.shape[1]
    if check_slots or (check_slots is None and not slot_mapping.is_cuda):
        check_slot_mapping(slot_mapping, num_slots)
    if not use_triton(rows, data):
        return kv_append_reference(rows, slot_mapping, data, scales, kind, scale, d_latent)
    if t == 0:
        return None
    from .kernel import _kv_append_kernel

    d_rope = d - d_latent
    block_l = next_power_of_2(d_latent)
    if kind == "fp8_ds_mla":
        block_l = max(block_l, DS_MLA_TILE)
    block_r = next_power_of_2(d_rope)
    fit = max(1, min(64, 4096 // (block_l + block_r)))
    block_t = 1 << (fit.bit_length() - 1)  # rows per program: a power of two, ~4k elements per tile
    _kv_append_kernel[(cdiv(t, block_t),)](
        rows, slot_mapping, data, scales if scales is not None else data, t, rows.stride(0), num_slots,
        D_LATENT=d_latent, D_ROPE=d_rope, WIDTH=data.shape[-1], KIND=KV_KINDS.index(kind),
        PER_TOKEN=scale == "token", TILE=DS_MLA_TILE, BLOCK_T=block_t, BLOCK_L=block_l, BLOCK_R=block_r,
        num_warps=4)
    return None
