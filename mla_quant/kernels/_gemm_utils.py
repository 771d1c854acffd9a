"""Helpers shared by the GEMM kernels (``fp8_gemm``, ``w4a16_gemm``, ``fused_moe``): tile ordering, launch
sizing and the INT4 code unpacking of the fast dequant path."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """Map a linear program id to (pid_m, pid_n), walking GROUP_M row tiles per column so that
    consecutive programs reuse the same weight tiles from L2 (the grouped ordering of Triton's tutorial)."""
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m, pid_n


@triton.jit
def int4_codes(nib, DT: tl.constexpr, INTERPRET: tl.constexpr, BIASED: tl.constexpr):
    """Nibbles n (int32 in 0..15) -> the signed codes q = n - 8, exact, without an int->float conversion:
    bf16 bits ``0x4300 | n`` are 128 + n and fp16 bits ``0x6400 | n`` are 1024 + n (the nibble lands in
    the low mantissa bits of a 16-bit lane), so one subtraction in the 16-bit type gives q; other dtypes
    use the fp32 form ``float(0x4B000000 | n) - (2^23 + 8)``. Returns q in DT (fp32 for fp32 and, under the
    interpreter, for bf16: its bf16 bitcast is wrong, and its dots upcast to fp32 anyway).

    ``BIASED`` skips the subtraction for bf16/fp16: it returns ``q + bias`` (128 + n = q + 136, or
    1024 + n = q + 1032; no floating-point op at all), and the caller subtracts ``bias · Σ x`` from the dot
    product once per group and row (the bias is ``int4_codes`` of nibble 8). fp32 codes are never biased."""
    # (the .to() after the subtraction is a no-op where the Python constant is weakly typed, as in Triton
    # 3.x; it keeps the dot operands in one dtype if a release promoted to fp32 — exact either way)
    if DT == tl.bfloat16 and not INTERPRET:
        q = (nib | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if not BIASED:
            q = (q - 136.0).to(tl.bfloat16)
    elif DT == tl.float16:
        q = (nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        if not BIASED:
            q = (q - 1032.0).to(tl.float16)
    elif DT == tl.bfloat16 and BIASED:  # interpreted: the same values as the bf16 lanes, in fp32
        q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388480.0  # 2^23 + n - (2^23 - 128)
    else:
        q = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return q


def m_bucket(m: int) -> int:
    """Autotuning key for the token count: 1, then powers of two up to 8192 (configs are kept per bucket,
    so a prefill with 1000 or 1024 tokens reuses one tuning)."""
    return 1 if m <= 1 else min(8192, triton.next_power_of_2(m))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for CPU tensors, so split-K runs in the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_for(tiles: int, k_iters: int, target_programs: int, max_split: int = 16) -> int:
    """Split the K loop (a power of two) while the grid stays within ``target_programs`` (a GEMV with
    N/BN tiles fills few SMs otherwise), never giving a split fewer than two K iterations."""
    split = 1
    while split < max_split and tiles * split * 2 <= target_programs and k_iters // (split * 2) >= 2:
        split *= 2
    return split


def autotune_bench(fn, quantiles=None):
    """The timing the GEMM autotuners use: short (they tune once per shape bucket, and a prefill
    benchmark meets many buckets), median of a few runs."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)
