"""INT4 symmetric group quantization in compressed-tensors ``pack-quantized`` layout (see reference.py)."""
from __future__ import annotations

import torch

from .._backend import use_triton
from .._checks import check_divisible, check_same_device, check_tensor
from .._host import cdiv
from ..fp8_quant import launch_config, persistent_programs
from .reference import (
    QMAX,
    QMIN,
    int4_dequantize_reference,
    int4_pack_reference,
    int4_quantize_reference,
    int4_unpack_reference,
)

GROUP_SIZES = (32, 64, 128)
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

__all__ = [
    "QMIN", "QMAX", "GROUP_SIZES", "int4_pack", "int4_unpack", "int4_quantize", "int4_dequantize",
    "int4_pack_reference", "int4_unpack_reference", "int4_quantize_reference", "int4_dequantize_reference",
]


def _check_group(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: {group_size} not supported, expected one of {GROUP_SIZES}")


def int4_pack(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7] -> int32 [N, K/8] (a layout op: exact, pure torch on every device)."""
    check_tensor("q", q, dtype=torch.int8, ndim=2)
    check_divisible("q.shape[1]", q.shape[1], 8, "the nibbles per int32 word")
    if q.numel() and (int(q.min()) < QMIN or int(q.max()) > QMAX):
        raise ValueError(f"q: codes must lie in [{QMIN}, {QMAX}]")
    return int4_pack_reference(q)


def int4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> int8 codes [N, K]."""
    check_tensor("packed", packed, dtype=torch.int32, ndim=2)
    return int4_unpack_reference(packed)


def _tile_config(config: dict | None, defaults: dict, group_size: int) -> dict:
    cfg = launch_config(config, defaults, ("BN", "BK"))
    if cfg["BK"] < max(group_size, 8):
        raise ValueError(f"config: BK={cfg['BK']} must be at least the group ({group_size}) and 8")
    return cfg


def int4_quantize(
    w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (weight_packed int32 [N, K/8], weight_scale [N, K/group] ``scale_dtype``).

    ``config`` (``BN`` rows × ``BK`` columns per program, ``num_warps``; ``K_FAST``: the grid's fast axis walks K,
    the default since the H200 sweep of 84444bd: 0.841 of copy against 0.819 row-major, as for the dequantization;
    ``STAGES`` >= 1 with ``PROGRAMS_PER_SM``: a persistent grid looping over the tiles, loads pipelined, 0.67-0.73)
    overrides the launch setting."""
    check_tensor("w", w, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=2)
    _check_group(group_size)
    check_divisible("w.shape[1]", w.shape[1], group_size, "group_size")
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype: {scale_dtype} not supported, expected one of {SCALE_DTYPES}")
    if w.stride(-1) != 1:
        raise ValueError("w: the last dimension must be contiguous")
    cfg = _tile_config(config, {"BN": 1, "BK": 1024, "num_warps": 1, "STAGES": 0, "PROGRAMS_PER_SM": 16,
                                "K_FAST": True}, group_size)  # K is masked
    if not use_triton(w):
        return int4_quantize_reference(w, group_size, scale_dtype)
    from .kernel import _int4_quant_pack_kernel

    n, k = w.shape
    packed = torch.empty((n, k // 8), dtype=torch.int32, device=w.device)
    scale = torch.empty((n, k // group_size), dtype=scale_dtype, device=w.device)
    nb, kb = cdiv(n, cfg["BN"]), cdiv(k, cfg["BK"])
    grid = (kb, nb) if cfg["K_FAST"] else (nb, kb)
    if cfg["STAGES"]:
        grid = (persistent_programs(nb * kb, cfg, w.device),)
    else:
        cfg.pop("PROGRAMS_PER_SM")
    if n and k:
        _int4_quant_pack_kernel[grid](w, packed, scale, n, k, w.stride(0), kb, nb * kb, GROUP=group_size, **cfg)
    return packed, scale


def int4_dequantize(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int = 32, out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """(weight_packed int32 [N, K/8], weight_scale [N, K/group]) -> [N, K] ``out_dtype``.

    ``config`` (``BN`` rows × ``BK`` columns per program, ``num_warps``, ``K_FAST``: the grid's fast axis walks K,
    so consecutive programs fill one BN-row slab of the output) overrides the launch setting. Swept on the H200
    (``benchmarks/sweep_quant.py``): K_FAST 0.815-0.816 of copy against 0.800-0.802 for the row-major grid in
    the same run (c5a7276); streaming stores (``st.global.cs``) lost (0.78 vs 0.80), and so did persistent grids
    with loads pipelined 2-4 deep (0.73-0.79, run of 1a54790), a [BN, BK/8, 8] word-major tile with per-word scales
    (0.65-0.75) and the nibble-to-float conversion by OR + FADD instead of I2F (0.79-0.80, no gain)."""
    check_tensor("packed", packed, dtype=torch.int32, ndim=2, contiguous=True)
    check_tensor("scale", scale, dtype=SCALE_DTYPES, ndim=2, contiguous=True)
    check_same_device(packed=packed, scale=scale)
    _check_group(group_size)
    n, k = packed.shape[0], packed.shape[1] * 8
    check_divisible("K (= 8 * packed.shape[1])", k, group_size, "group_size")
    if tuple(scale.shape) != (n, k // group_size):
        raise ValueError(f"scale: shape {tuple(scale.shape)} does not match packed {tuple(packed.shape)} "
                         f"with group {group_size} (expected {(n, k // group_size)})")
    cfg = _tile_config(config, {"BN": 8, "BK": 1024, "num_warps": 1, "K_FAST": True}, group_size)
    if not use_triton(packed, scale):
        return int4_dequantize_reference(packed, scale, group_size, out_dtype)
    from .kernel import _int4_dequant_kernel

    out = torch.empty((n, k), dtype=out_dtype, device=packed.device)
    if n and k:
        grid = (cdiv(n, cfg["BN"]), cdiv(k, cfg["BK"]))
        _int4_dequant_kernel[grid[::-1] if cfg["K_FAST"] else grid](packed, scale, out, n, k, GROUP=group_size, **cfg)
    return out
