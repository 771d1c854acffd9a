"""Pure-torch reference for writing indexer keys into their pages (fp32 math, written for clarity).

Layout (one "full" indexer layer): ``k_cache [num_pages, page_size, D]`` and, for FP8 pages only,
``k_scale [num_pages, page_size]`` fp32 — physical slot ``page · page_size + offset`` holds one token's key.
FP8 keys get one scale per token (DeepSeek's ``act_quant`` with a block of D = 128):
``scale = max(amax, 1e-4) / 448`` (optionally rounded up to a power of two, "ue8m0"),
``q = e4m3(clamp(k · (1 / scale), ±448))`` with the reciprocal rounded once per token (as ``fp8_quant``),
``k ≈ q · scale``. Float pages store the key cast to their dtype. Tokens whose slot is negative (padding)
are skipped.
"""
from __future__ import annotations

import torch

from ..fp8_quant.reference import cast_fp8_saturating, finite_abs, fp8_scale_from_amax, reciprocal


def quantize_indexer_keys_reference(k: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """k: [T, D] float -> (e4m3 [T, D], scale [T] fp32), one scale per token."""
    x = k.float()
    scale = fp8_scale_from_amax(finite_abs(x).amax(dim=-1), ue8m0)
    return cast_fp8_saturating(x * reciprocal(scale)[:, None]), scale


def indexer_k_append_reference(k: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                               k_scale: torch.Tensor | None = None, ue8m0: bool = False) -> None:
    """Write k [T, D] into k_cache [P, page_size, D] (and k_scale [P, page_size]) at slot_mapping [T], in place."""
    d = k_cache.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = k[keep]
    if k_scale is None:
        k_cache.view(-1, d)[slots] = rows.to(k_cache.dtype)
        return
    q, s = quantize_indexer_keys_reference(rows, ue8m0)
    k_cache.view(-1, d)[slots] = q
    k_scale.view(-1)[slots] = s
