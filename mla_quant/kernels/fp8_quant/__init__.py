"""FP8 (e4m3) quantization ops: per-token-group activations, 128×128 weight blocks, KV rows.

Each public op checks its inputs, then runs the Triton kernel (CUDA, or TRITON_INTERPRET=1) or the
reference of the same signature (``reference.py``). See docs/formats.md for the layouts.
"""
from __future__ import annotations

import torch

from .._backend import triton_interpreted, use_triton
from .._checks import check_divisible, check_same_device, check_tensor
from .._host import cdiv, next_power_of_2
from .reference import (
    FP8,
    FP8_MAX,
    act_quant_fp8_reference,
    block_dequant_fp8_reference,
    block_quant_fp8_reference,
    kv_quant_fp8_reference,
)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)

__all__ = [
    "FP8", "FP8_MAX", "launch_config", "persistent_programs",
    "act_quant_fp8", "block_quant_fp8", "block_dequant_fp8", "kv_quant_fp8",
    "act_quant_fp8_reference", "block_quant_fp8_reference", "block_dequant_fp8_reference",
    "kv_quant_fp8_reference",
]


def launch_config(config: dict | None, defaults: dict, powers_of_two: tuple[str, ...] = ()) -> dict:
    """``defaults`` updated by ``config`` (a launch setting the sweep ``benchmarks/sweep_quant.py`` pins).
    Unknown keys, and entries of ``powers_of_two`` (and ``num_warps``) that are not powers of two, raise."""
    cfg = dict(defaults)
    if config:
        unknown = sorted(set(config) - set(defaults))
        if unknown:
            raise ValueError(f"config: unknown keys {unknown}, expected some of {sorted(defaults)}")
        cfg.update(config)
    for key in (*powers_of_two, "num_warps"):
        v = cfg[key]
        if not isinstance(v, int) or v <= 0 or v & (v - 1):
            raise ValueError(f"config: {key}={v!r} must be a positive power of two")
    return cfg


def act_quant_fp8(
    x: torch.Tensor, group_size: int = 128, ue8m0: bool = False, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1×group FP8 quantization. x: [..., K] -> (q [..., K] e4m3, scale [..., K/group] fp32).

    ``config`` (``BLOCK_G`` groups per program, ``num_warps``) overrides the kernel's launch setting."""
    check_tensor("x", x, dtype=FLOATS, contiguous=True)
    if x.dim() == 0:
        raise ValueError("x: needs at least one dimension")
    check_divisible("x.shape[-1]", x.shape[-1], group_size, "group_size")
    if group_size & (group_size - 1):
        raise ValueError(f"group_size: {group_size} must be a power of two")
    cfg = launch_config(config, {"BLOCK_G": max(1, min(64, 4096 // group_size)), "num_warps": 4}, ("BLOCK_G",))
    if not use_triton(x):
        return act_quant_fp8_reference(x, group_size, ue8m0)
    from .kernel import _act_quant_fp8_kernel

    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(*x.shape[:-1], x.shape[-1] // group_size, dtype=torch.float32, device=x.device)
    n_groups = x.numel() // group_size
    if n_groups:
        _act_quant_fp8_kernel[(cdiv(n_groups, cfg["BLOCK_G"]),)](
            x, q, scale, n_groups, GROUP=group_size, UE8M0=ue8m0, **cfg)
    return q, scale


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    bn, bk = (int(b) for b in block)
    if bn <= 0 or bk <= 0 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"block: {block} must be two positive powers of two")
    return bn, bk


def _block_grid(nb: int, kb: int, k_fast: bool) -> tuple[int, int]:
    return (kb, nb) if k_fast else (nb, kb)


def persistent_programs(work: int, cfg: dict, device: torch.device) -> int:
    """Programs of a persistent launch: ``PROGRAMS_PER_SM`` per SM (popped from ``cfg``), at most ``work``;
    interpreted, as if on one SM, so that the programs loop."""
    per_sm = cfg.pop("PROGRAMS_PER_SM")
    if not isinstance(per_sm, int) or per_sm <= 0:
        raise ValueError(f"config: PROGRAMS_PER_SM={per_sm!r} must be a positive integer")
    sms = 1 if triton_interpreted() else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(work, per_sm * sms))


def block_quant_fp8(
    w: torch.Tensor, block: tuple[int, int] = (128, 128), config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled weight quantization. w: [N, K] -> (q [N, K] e4m3, weight_scale_inv [⌈N/bn⌉, ⌈K/bk⌉] fp32).

    ``config`` (``num_warps``; ``K_FAST``: consecutive programs walk along K; ``STAGES`` >= 1 with
    ``PROGRAMS_PER_SM``: a persistent grid looping over the blocks, loads pipelined) overrides the launch setting."""
    check_tensor("w", w, dtype=FLOATS, ndim=2)
    bn, bk = _check_block(block)
    if w.stride(-1) != 1:
        raise ValueError("w: the last dimension must be contiguous")
    # K-walking programs, 8 warps: 0.81-0.84 of copy in the H200 sweeps (benchmarks/sweep_quant.py, commits 2bed842
    # and 94d00a0) against 0.80 for the previous 16 warps along N
    cfg = launch_config(config, {"K_FAST": True, "num_warps": 8, "STAGES": 0, "PROGRAMS_PER_SM": 2})
    if not use_triton(w):
        return block_quant_fp8_reference(w, (bn, bk))
    from .kernel import _block_quant_fp8_kernel

    n, k = w.shape
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    q = torch.empty((n, k), dtype=FP8, device=w.device)
    scale = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
    grid = _block_grid(nb, kb, cfg["K_FAST"])
    if cfg["STAGES"]:
        grid = (persistent_programs(nb * kb, cfg, w.device),)
    else:
        cfg.pop("PROGRAMS_PER_SM")
    if n and k:
        _block_quant_fp8_kernel[grid](w, q, scale, n, k, w.stride(0), q.stride(0), kb, nb * kb, BN=bn, BK=bk,
                                      EVEN=n % bn == 0 and k % bk == 0, **cfg)
    return q, scale


def block_dequant_fp8(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """[N, K] e4m3 with [⌈N/bn⌉, ⌈K/bk⌉] fp32 block scales -> [N, K] ``out_dtype``.

    ``config`` (``num_warps``, ``K_FAST``) overrides the launch setting."""
    check_tensor("q", q, dtype=FP8, ndim=2)
    check_tensor("scale_inv", scale_inv, dtype=torch.float32, ndim=2, contiguous=True)
    check_same_device(q=q, scale_inv=scale_inv)
    bn, bk = _check_block(block)
    n, k = q.shape
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    if tuple(scale_inv.shape) != (nb, kb):
        raise ValueError(f"scale_inv: shape {tuple(scale_inv.shape)} does not match q {tuple(q.shape)} "
                         f"with block {block} (expected {(nb, kb)})")
    if q.stride(-1) != 1:
        raise ValueError("q: the last dimension must be contiguous")
    # K-walking programs: 0.84-0.86 of copy in the H200 sweeps against 0.79-0.80 along N
    cfg = launch_config(config, {"K_FAST": True, "num_warps": 4})
    if not use_triton(q, scale_inv):
        return block_dequant_fp8_reference(q, scale_inv, (bn, bk), out_dtype)
    from .kernel import _block_dequant_fp8_kernel

    out = torch.empty((n, k), dtype=out_dtype, device=q.device)
    if n and k:
        _block_dequant_fp8_kernel[_block_grid(nb, kb, cfg["K_FAST"])](
            q, scale_inv, out, n, k, q.stride(0), out.stride(0), kb, BN=bn, BK=bk,
            EVEN=n % bn == 0 and k % bk == 0, **cfg)
    return out


def kv_quant_fp8(
    x: torch.Tensor, scale: torch.Tensor | None = None, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 KV rows. x: [T, D]; scale None -> per-token scales [T]; scale [1] fp32 -> per-tensor.

    ``config`` (``BLOCK_T`` rows per tile, ``num_warps``; ``STAGES`` >= 1 with ``PROGRAMS_PER_SM``: a persistent
    grid whose programs loop over the tiles, loads pipelined ``STAGES`` deep) overrides the launch setting."""
    check_tensor("x", x, dtype=FLOATS, ndim=2, contiguous=True)
    if scale is not None:
        check_tensor("scale", scale, dtype=torch.float32)
        if scale.numel() != 1:
            raise ValueError(f"scale: a per-tensor scale has one element, got shape {tuple(scale.shape)}")
        check_same_device(x=x, scale=scale)
        if not bool(scale.reshape(()).gt(0).item() if not scale.is_cuda else True):
            raise ValueError("scale: must be positive")
    t, d = x.shape
    d_head = 1 << (max(d, 1).bit_length() - 1)
    d_tail = next_power_of_2(max(d - d_head, 1))
    # ~2k values per program (4 rows of 576 with 2 warps) on a persistent grid of 8 programs per SM, loads 3 deep:
    # 0.818 of copy in the H200 sweep of 8b4c3e0 (one tile per program: 0.802; 8 rows / 4 warps: 0.68-0.74)
    cfg = launch_config(config, {"BLOCK_T": max(1, 2048 // d_head), "num_warps": 2, "STAGES": 3,
                                 "PROGRAMS_PER_SM": 8}, ("BLOCK_T",))
    if not use_triton(x, *(s for s in (scale,) if s is not None)):
        return kv_quant_fp8_reference(x, scale)
    from .kernel import _kv_quant_fp8_kernel

    q = torch.empty((t, d), dtype=FP8, device=x.device)
    s = torch.empty(t, dtype=torch.float32, device=x.device) if scale is None else scale.reshape(1)
    tiles = cdiv(t, cfg["BLOCK_T"])
    if cfg["STAGES"]:
        tiles = persistent_programs(tiles, cfg, x.device)
    else:
        cfg.pop("PROGRAMS_PER_SM")
    if t and d:
        _kv_quant_fp8_kernel[(tiles,)](x, q, s, t, D=d, PER_TOKEN=scale is None, D_HEAD=d_head, D_TAIL=d_tail, **cfg)
    return q, (s if scale is None else scale)
