"""MLA prefill in the naive (expanded K/V) form for a ragged batch, causal over a cached prefix.

``mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, softmax_scale, causal=True)`` ->
``(out [T, H, d_v], lse [T, H])``. The queries of sequence b are its last ``n_q`` tokens (chunked prefill);
see ``reference.py`` for the exact semantics and docs/mla.md for how MLAttention builds k and v.
"""
from __future__ import annotations

import math

import torch

from .._backend import triton_interpreted, use_triton
from .._checks import check_same_device, check_tensor
from .._host import cdiv, next_power_of_2
from .._outputs import output_buffer
from .reference import mla_prefill_reference

__all__ = ["mla_prefill", "mla_prefill_reference"]

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _validate_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor, t: int, t_kv: int,
                         causal: bool) -> int:
    """Checks the prefix sums (one device sync) and returns max_seqlen_q."""
    n_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    n_kv = cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]
    stats = torch.stack([cu_seqlens_q[0], cu_seqlens_q[-1], cu_seqlens_kv[0], cu_seqlens_kv[-1],
                         (n_q < 0).sum() + (n_kv < 0).sum(), (n_kv < n_q).sum(),
                         n_q.max() if n_q.numel() else cu_seqlens_q[0]]).tolist()
    if stats[0] != 0 or stats[1] != t:
        raise ValueError(f"cu_seqlens_q: must run from 0 to the {t} query tokens, got {stats[0]}..{stats[1]}")
    if stats[2] != 0 or stats[3] != t_kv:
        raise ValueError(f"cu_seqlens_kv: must run from 0 to the {t_kv} key tokens, got {stats[2]}..{stats[3]}")
    if stats[4]:
        raise ValueError("cu_seqlens_q / cu_seqlens_kv: must be non-decreasing")
    if causal and stats[5]:
        b = int((n_kv < n_q).nonzero()[0])
        raise ValueError(f"cu_seqlens_kv: sequence {b} has {int(n_kv[b])} keys but {int(n_q[b])} queries; with "
                         f"causal=True the queries are the last tokens of the keys")
    return int(stats[6])


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_kv: torch.Tensor, max_seqlen_q: int | None, softmax_scale: float,
                causal: bool = True, *, validate: bool = True, out: torch.Tensor | None = None,
                lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged multi-head attention: q [T, H, d_qk], k [T_kv, H, d_qk], v [T_kv, H, d_v] (last dimension
    contiguous, any token / head strides) -> (out [T, H, d_v] in q.dtype, lse fp32 [T, H]).

    ``max_seqlen_q``: host int bounding the queries per sequence (None: computed, one sync).
    ``validate``: check the prefix sums against T / T_kv (one device sync). ``out`` / ``lse``: optional
    preallocated outputs (contiguous, the shapes and dtypes above).
    """
    check_tensor("q", q, dtype=FLOATS, ndim=3)
    check_tensor("k", k, dtype=q.dtype, ndim=3)
    check_tensor("v", v, dtype=q.dtype, ndim=3)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous")
    t, heads, d_qk = q.shape
    if k.shape[1:] != (heads, d_qk):
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)} in heads / head dim")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k {tuple(k.shape)} in tokens / heads")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        check_tensor(name, cu, dtype=torch.int32, ndim=1, contiguous=True)
        if cu.shape[0] < 1:
            raise ValueError(f"{name}: needs B + 1 ≥ 1 entries")
    if cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError(f"cu_seqlens_kv: {cu_seqlens_kv.shape[0]} entries, cu_seqlens_q has {cu_seqlens_q.shape[0]}")
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv)
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: {softmax_scale} must be a positive finite number")
    if validate:
        longest = _validate_cu_seqlens(cu_seqlens_q, cu_seqlens_kv, t, k.shape[0], causal)
        if max_seqlen_q is not None and max_seqlen_q < longest:
            raise ValueError(f"max_seqlen_q: {max_seqlen_q} < the longest query run {longest}")
        max_seqlen_q = longest if max_seqlen_q is None else max_seqlen_q
    elif max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    if not use_triton(q, k, v, cu_seqlens_q):
        o_ref, lse_ref = mla_prefill_reference(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, softmax_scale,
                                               causal)
        if out is None and lse is None:
            return o_ref, lse_ref
        out = output_buffer("out", out, o_ref.shape, q.dtype, q.device)
        lse = output_buffer("lse", lse, lse_ref.shape, torch.float32, q.device)
        return out.copy_(o_ref), lse.copy_(lse_ref)

    if d_qk < 16:
        raise ValueError(f"q: the Triton kernel needs a head dimension of at least 16, got {d_qk}")
    from .kernel import _mla_prefill_kernel, _mla_prefill_kernel_tuned

    d_v = v.shape[2]
    out = output_buffer("out", out, (t, heads, d_v), q.dtype, q.device)
    lse = output_buffer("lse", lse, (t, heads), torch.float32, q.device)
    bsz = cu_seqlens_q.shape[0] - 1
    if t == 0 or heads == 0 or bsz == 0 or max_seqlen_q == 0:
        return out, lse
    d1 = 1 << (d_qk.bit_length() - 1)  # the largest power of two ≤ d_qk, then the remainder
    d2 = d_qk - d1
    interpreted = triton_interpreted()
    args = (q, k, v, cu_seqlens_q, cu_seqlens_kv, out, lse, softmax_scale * math.log2(math.e),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), heads)
    meta = dict(D1=d1, D2=d2, D2P=max(16, next_power_of_2(d2)), DV=d_v, DVP=max(16, next_power_of_2(d_v)),
                CAUSAL=causal, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", INTERPRET=interpreted)

    def grid(m):
        return (cdiv(max_seqlen_q, m["BLOCK_M"]), heads, bsz)

    if interpreted:
        _mla_prefill_kernel[grid](*args, **meta, BLOCK_M=16, BLOCK_N=16)
    else:
        _mla_prefill_kernel_tuned[grid](*args, **meta)
    return out, lse
