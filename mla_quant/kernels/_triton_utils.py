"""Small @triton.jit helpers shared by the kernels (exact rounding rules that match the references)."""
import os

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Globals read inside @triton.jit code must be constexpr (Triton >= 3.2 refuses plain Python floats).
FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)
FP32_MAX = tl.constexpr(3.4028234663852886e38)
# Triton picks the interpreter when a kernel is decorated, from this variable; so may we.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def rint(x):
    """Round half to even (torch.round). On the GPU libdevice's rint (a software ``floor(x + 0.5)`` there
    would be contracted with the preceding multiply into an FMA and round differently); the interpreter has
    no libdevice, so it gets the software form, exact for |x| < 2**22."""
    if INTERPRETED:
        r = tl.floor(x + 0.5)
        tie = (r - x) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(tie & odd, r - 1.0, r)
    else:
        return libdevice.rint(x)


@triton.jit
def rounded_to(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to ``DT`` (nearest, ties to even) and back to fp32. The interpreter casts fp32 -> bf16 by
    truncation; there the bf16 rounding is done on the bits (NaN kept)."""
    if INTERPRETED and DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def finite_abs(x):
    ax = tl.abs(x)
    return tl.where(ax <= FP32_MAX, ax, 0.0)  # False for inf and for NaN


@triton.jit
def ue8m0_ceil(s):
    """Round a positive fp32 up to a power of two through its exponent bits."""
    bits = s.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale(amax, UE8M0: tl.constexpr):
    s = tl.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)
    if UE8M0:
        s = ue8m0_ceil(s)
    return s


@triton.jit
def reciprocal(s):
    """1 / s rounded once (IEEE); quantizers multiply by it — one division per group, not per element
    (div_rn per element made the quantizers compute-bound)."""
    return tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def cast_fp8_saturating(y):
    """Clamp to ±448 keeping NaN (tl.maximum would drop it), then round to e4m3."""
    c = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    return tl.where(y != y, y, c).to(tl.float8e4nv)


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    """With ``PDL`` (a launch through ``_pdl.pdl_launch``): wait until the previous kernel in the stream has
    finished and its writes are visible, then let the next kernel be scheduled (``PDL == 2``: let it be scheduled
    first, then wait). Call it before the kernel's first load or store. In a kernel launched without the PDL
    attribute the wait returns at once."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def timeline_stamp(ptr, slot: tl.constexpr, dep, mask=True):
    """Diagnostics (GPU only): store ``%globaltimer`` (ns, comparable across SMs) at ``ptr[2·slot]`` and
    ``%clock64`` (this SM's cycles) at ``ptr[2·slot + 1]``, read once the int32 scalar ``dep`` is known (a value the
    stamp must follow: a load's result, a loop's output). A kernel's ``PROBE`` mode (off by default) calls it."""
    g = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dep], dtype=tl.int64, is_pure=False,
                                  pack=1)
    c = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(ptr + 2 * slot, g, mask=mask)
    tl.store(ptr + 2 * slot + 1, c, mask=mask)


@triton.jit
def sm_id(dep):
    """The SM this program runs on (``%smid``; diagnostics)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [dep], dtype=tl.int32, is_pure=False, pack=1)
