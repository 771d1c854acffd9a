"""Pure-torch reference of ``kv_append``: quantize a step's KV rows with ``kv_layout.quantize_kv_rows`` and
scatter them into one layer's pages at their slots. Written for clarity; the Triton kernel matches it bit
for bit on the GPU."""
from __future__ import annotations

import torch

from ..kv_layout import quantize_kv_rows


def kv_append_reference(rows: torch.Tensor, slot_mapping: torch.Tensor, data: torch.Tensor,
                        scales: torch.Tensor | None, kind: str = "bf16", scale: str = "token",
                        d_latent: int = 512) -> None:
    """Write ``rows [T, d_latent + d_rope]`` into ``data [num_pages, page_size, width]`` (and the per-token
    ``scales [num_pages, page_size]``) at ``slot_mapping [T]`` (slot = page · page_size + offset), in place.

    Rows whose slot is negative are skipped (padding tokens). ``scale`` is ``"token"`` or ``"tensor"``
    (``fp8_e4m3`` only; the per-tensor scale is ``scales [1]``, read, never written).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return None
    tensor_scale = scales if (kind == "fp8_e4m3" and scale == "tensor") else None
    q, s = quantize_kv_rows(rows[keep], kind, d_latent, tensor_scale=tensor_scale)
    data.view(-1, data.shape[-1])[slots] = q
    if kind == "fp8_e4m3" and scale == "token":
        scales.view(-1)[slots] = s
    return None
