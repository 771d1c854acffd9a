"""``indexer_k_append``: write a step's indexer keys into the indexer key pages (in place).

Pages: ``k_cache [num_pages, page_size, D]`` (e4m3, bf16, fp16 or fp32) and, for e4m3 pages,
``k_scale [num_pages, page_size]`` fp32 (one scale per token). ``slot_mapping [T]`` holds each token's
physical slot ``page · page_size + offset`` (the same slots as the MLA latent pages, from ``PagedBatch``);
negative slots are skipped. See ``reference.py`` for the quantization rule.
"""
from __future__ import annotations

import torch

from .._backend import use_triton
from .._checks import check_same_device, check_tensor
from .._host import cdiv, next_power_of_2
from .reference import indexer_k_append_reference, quantize_indexer_keys_reference

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn

__all__ = ["indexer_k_append", "indexer_k_append_reference", "quantize_indexer_keys_reference"]


def check_key_pages(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> None:
    """Shape/dtype rules of one layer's indexer key pages (shared with the scoring op)."""
    check_tensor("k_cache", k_cache, dtype=(FP8, *FLOATS), ndim=3, contiguous=True)
    if k_cache.dtype == FP8:
        if k_scale is None:
            raise ValueError("k_scale: e4m3 key pages need per-token scales [num_pages, page_size]")
        check_tensor("k_scale", k_scale, dtype=torch.float32, ndim=2, contiguous=True)
        if tuple(k_scale.shape) != tuple(k_cache.shape[:2]):
            raise ValueError(f"k_scale: shape {tuple(k_scale.shape)} != k_cache pages {tuple(k_cache.shape[:2])}")
        check_same_device(k_cache=k_cache, k_scale=k_scale)
    elif k_scale is not None:
        raise ValueError(f"k_scale: float key pages ({k_cache.dtype}) take no scales")


def indexer_k_append(k: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                     k_scale: torch.Tensor | None = None, ue8m0: bool = False) -> None:
    """Write ``k [T, D]`` to ``k_cache`` (and ``k_scale``) at ``slot_mapping [T]`` (int32/int64), in place."""
    check_tensor("k", k, dtype=FLOATS, ndim=2)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), ndim=1)
    check_key_pages(k_cache, k_scale)
    check_same_device(k=k, slot_mapping=slot_mapping, k_cache=k_cache)
    t, d = k.shape
    if d != k_cache.shape[-1]:
        raise ValueError(f"k: {d} features, but the key pages hold {k_cache.shape[-1]}")
    if slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {t} tokens")
    if k.stride(-1) != 1:
        raise ValueError("k: the last dimension must be contiguous")
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    if not slot_mapping.is_cuda and t and int(slot_mapping.max()) >= n_slots:
        raise IndexError(f"slot_mapping: slot {int(slot_mapping.max())} past the {n_slots} slots of k_cache")
    if not use_triton(k, k_cache):
        return indexer_k_append_reference(k, slot_mapping, k_cache, k_scale, ue8m0)
    from .kernel import _indexer_k_append_kernel

    if t == 0:
        return None
    block_d = next_power_of_2(d)
    block_t = max(1, min(64, 4096 // block_d))
    fp8 = k_cache.dtype == FP8
    _indexer_k_append_kernel[(cdiv(t, block_t),)](
        k, slot_mapping, k_cache, k_scale if fp8 else k_cache, t, d, k.stride(0),
        FP8=fp8, UE8M0=ue8m0, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return None
