"""Triton kernel: quantize indexer keys per token (FP8 pages) or cast them (float pages) and scatter them
to their physical slots. Math and rounding match ``reference.py`` bit for bit on the GPU."""
import triton
import triton.language as tl

from .._triton_utils import cast_fp8_saturating, finite_abs, fp8_scale, reciprocal


@triton.jit
def _indexer_k_append_kernel(k_ptr, slot_ptr, cache_ptr, scale_ptr, T, D, stride_kt,
                             FP8: tl.constexpr, UE8M0: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    in_t = rows < T
    slot = tl.load(slot_ptr + rows, mask=in_t, other=-1).to(tl.int64)
    write = in_t & (slot >= 0)
    mask = write[:, None] & (cols[None, :] < D)
    x = tl.load(k_ptr + rows[:, None] * stride_kt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = cache_ptr + slot[:, None] * D + cols[None, :]
    if FP8:
        s = fp8_scale(tl.max(finite_abs(x), axis=1), UE8M0)
        tl.store(dst, cast_fp8_saturating(x * reciprocal(s)[:, None]), mask=mask)
        tl.store(scale_ptr + slot, s, mask=write)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
