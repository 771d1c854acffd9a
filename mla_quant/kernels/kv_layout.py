"""Byte layouts of one MLA KV row (one token of one layer) in each KV format — the pure-torch reference
that ``kv_append`` kernels must match and that attention references read through.

A row is ``[latent (d_latent) ; rope (d_rope)]`` — for Kimi K2.6 / GLM 5.2, 512 + 64 = 576 values: the
RMS-normalised ``kv_a`` latent and the post-RoPE ``k_pe``.

===================  ========================================================  =========================
kind / scale         ``data`` per row                                          ``scales``
===================  ========================================================  =========================
``bf16``             bf16 [d]                                                  None
``fp8_e4m3``/token   e4m3 [d], one scale over the whole row                    fp32 [T] (one per row)
``fp8_e4m3``/tensor  e4m3 [d], a given per-layer scale                         fp32 [1]
``fp8_ds_mla``       uint8 [d_latent + 4·d_latent/128 + 2·d_rope] (656 bytes):  None (inside the row)
                     bytes [0, d_latent) e4m3 latent, then d_latent/128 fp32
                     power-of-two tile scales (one per 128 latent values,
                     little-endian), then d_rope bf16 rope values (unquantized)
===================  ========================================================  =========================

Scales follow ``fp8_quant``: ``amax`` over finite values, floored at 1e-4, ``/448``; ``real = q * scale``.
"""
from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor
from .fp8_quant.reference import (
    FP8,
    act_quant_fp8_reference,
    cast_fp8_saturating,
    finite_abs,
    fp8_scale_from_amax,
    reciprocal,
)

KV_KINDS = ("bf16", "fp8_e4m3", "fp8_ds_mla")
KV_SCALES = ("token", "tensor")
DS_MLA_TILE = 128


def kv_row_width(kind: str, d_latent: int, d_rope: int) -> int:
    """Elements of ``data``'s last dimension for one row (bytes for fp8 kinds)."""
    if kind in ("bf16", "fp8_e4m3"):
        return d_latent + d_rope
    if kind == "fp8_ds_mla":
        if d_latent % DS_MLA_TILE:
            raise ValueError(f"fp8_ds_mla: d_latent {d_latent} must be a multiple of {DS_MLA_TILE}")
        return d_latent + 4 * (d_latent // DS_MLA_TILE) + 2 * d_rope
    raise ValueError(f"kind: {kind!r} not in {KV_KINDS}")


def kv_data_dtype(kind: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp8_e4m3": FP8, "fp8_ds_mla": torch.uint8}[kind]


def quantize_kv_rows(rows: torch.Tensor, kind: str, d_latent: int,
                     tensor_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows: [T, d_latent + d_rope] float -> (data [T, width], scales) in the layout above.

    For ``fp8_e4m3``, ``tensor_scale`` ([1] fp32) selects the per-tensor mode; None means per-row scales.
    """
    t, d = rows.shape
    x = rows.float()
    if kind == "bf16":
        return rows.to(torch.bfloat16), None
    if kind == "fp8_e4m3":
        if tensor_scale is not None:
            return cast_fp8_saturating(x * reciprocal(tensor_scale.float())), tensor_scale
        scale = fp8_scale_from_amax(finite_abs(x).amax(dim=-1))
        return cast_fp8_saturating(x * reciprocal(scale)[:, None]), scale
    if kind == "fp8_ds_mla":
        d_rope = d - d_latent
        q, s = act_quant_fp8_reference(x[:, :d_latent].contiguous(), DS_MLA_TILE, ue8m0=True)
        rope = x[:, d_latent:].to(torch.bfloat16).contiguous()
        data = torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8).reshape(t, -1),
                          rope.view(torch.uint8).reshape(t, 2 * d_rope)], dim=1)
        return data, None
    raise ValueError(f"kind: {kind!r} not in {KV_KINDS}")


def dequantize_kv_rows(data: torch.Tensor, scales: torch.Tensor | None, kind: str, d_latent: int,
                       d_rope: int) -> torch.Tensor:
    """Inverse of :func:`quantize_kv_rows`: data [..., width] -> fp32 [..., d_latent + d_rope].

    ``scales`` is [...] (per row), [1] (per tensor) or None, as stored.
    """
    if kind == "bf16":
        return data.float()
    if kind == "fp8_e4m3":
        s = scales.float()
        return data.float() * (s.reshape(()) if s.numel() == 1 else s[..., None])
    if kind == "fp8_ds_mla":
        n_tiles = d_latent // DS_MLA_TILE
        lead = data.shape[:-1]
        raw = data.reshape(-1, data.shape[-1])
        q = raw[:, :d_latent].contiguous().view(FP8).float()
        s = raw[:, d_latent:d_latent + 4 * n_tiles].contiguous().view(torch.float32)
        rope = raw[:, d_latent + 4 * n_tiles:].contiguous().view(torch.bfloat16).float()
        latent = (q.reshape(-1, n_tiles, DS_MLA_TILE) * s[..., None]).reshape(-1, d_latent)
        return torch.cat([latent, rope], dim=1).reshape(*lead, d_latent + d_rope)
    raise ValueError(f"kind: {kind!r} not in {KV_KINDS}")


def check_kv_pages(kv_data: torch.Tensor, kv_scales: torch.Tensor | None, kind: str, d_latent: int, d_rope: int,
                   scale: str | None = None, names: tuple[str, str] = ("kv_data", "kv_scales")) -> None:
    """The rules of one layer's pages, shared by every op that reads or writes them: ``kv_data``
    ``[num_pages, page_size, kv_row_width(kind)]`` contiguous in ``kv_data_dtype(kind)``; fp8_e4m3 scales
    contiguous fp32, per token ``[num_pages, page_size]`` or per tensor ``[1]`` (``scale`` pins which; None
    accepts either); no separate scales for the other kinds. ``names`` are the caller's argument names."""
    data_name, scales_name = names
    if kind not in KV_KINDS:
        raise ValueError(f"kind: {kind!r} not in {KV_KINDS}")
    if scale is not None and scale not in KV_SCALES:
        raise ValueError(f"scale: {scale!r} not in {KV_SCALES}")
    check_tensor(data_name, kv_data, dtype=kv_data_dtype(kind), ndim=3)
    width = kv_row_width(kind, d_latent, d_rope)
    if kv_data.shape[-1] != width:
        raise ValueError(f"{data_name}: rows of {kv_data.shape[-1]} elements, but kind {kind!r} with "
                         f"d_latent={d_latent}, d_rope={d_rope} needs {width}")
    check_tensor(data_name, kv_data, contiguous=True)
    if kind != "fp8_e4m3":
        if kv_scales is not None:
            raise ValueError(f"{scales_name}: must be None for kind {kind!r} (bf16 has none, fp8_ds_mla keeps "
                             "them in the row)")
        return
    if kv_scales is None:
        raise ValueError(f"{scales_name}: fp8_e4m3 pages need scales ([num_pages, page_size] or [1])")
    check_tensor(scales_name, kv_scales, dtype=torch.float32, contiguous=True)
    per_token, per_tensor = tuple(kv_data.shape[:2]), (1,)
    allowed = {"token": [per_token], "tensor": [per_tensor], None: [per_token, per_tensor]}[scale]
    if tuple(kv_scales.shape) not in allowed:
        raise ValueError(f"{scales_name}: shape {tuple(kv_scales.shape)}, expected one of {allowed}")
    check_same_device(**{data_name: kv_data, scales_name: kv_scales})
