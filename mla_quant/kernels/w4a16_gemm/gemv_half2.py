"""The one-token W4A16 GEMV with whole rows per program in fp16x2 arithmetic (``w4a16_gemm(..., gemv="rows_half2")``).

y[n] = Σ_k x[k] · s[n, k / GROUP] · (q[n, k] - 8) for one activation row x [K] (bf16 / fp16) and W [N, K/8] int32.

The rows GEMV of ``gemv.py`` (``BN`` output rows per program, no split-K, the weights of the first chunks loaded
before the PDL wait) with the half2 GEMV's arithmetic (``_half2_gemv.run_dot``: per run of 32 K, 4 words against
16 fp16 activation pairs, one LOP3 + one conversion + one HFMA2 per pair of weights; about 0.6x the plane GEMV's
instructions per weight). The arithmetic takes x in *pair order*, each run's pairs scaled by a power of two into
fp16's range; the GEMV multiplies each run's sum by that power of two and the run's group scale in fp32. Since
session 37 the GEMV makes the pairs itself from a 16-byte aligned x (``INLINE_X``, ``half2_launch_x``:
``_half2_gemv.inline_pairs``, the same bits); otherwise ``_half2_gemv.pair_order`` writes them in one small launch
before it (``half2_launch``). Numerics are the half2 GEMV's (docs/moe.md "The half2 GEMV"):
bf16-level, not the fp32 sums of ``gemv="rows"``. With ``SWIGLU`` (``half2_launch_swiglu``, session 39) one launch
runs a SwiGLU MLP's gate and up GEMVs, half of each program's rows from each weight, and stores silu(gate) · up.

A program's tile is [BN rows, BR runs]: 4 words per element in one 128-bit load, a warp's lanes on consecutive runs
of one row (512 contiguous bytes; lanes on the rows of one run, the first form, were slower at every width). A row of
R = K/32 runs is walked in chunks of BR runs; runs past R (the last chunk of a row whose run count is not a multiple
of BR) re-read the last run and have their scale zeroed (finite fp16 sums times 0). A run's 16 pairs are 4 128-bit
loads per thread (or, inline, the run's 64 bytes of x in 4), shared by the rows the thread holds of that run; they are
read after the PDL wait (the kernel before writes them), the weights before it.
"""
import triton
import triton.language as tl

from .._gemm_utils import _load_in_place, four_words
from .._half2_gemv import inline_pairs, inline_pairs_ok, load_pairs, pair_offsets, run_dot
from .._triton_utils import gdc_launch_dependents, gdc_wait, rounded_to
from .gemv import span_launch


@triton.jit
def _span_runs(OFF: tl.constexpr, SIZE: tl.constexpr, RUNS: tl.constexpr, BN: tl.constexpr):
    """Run indices [BN, SIZE] of runs OFF .. OFF + SIZE (clamped to the last run) and where they are real runs."""
    run = OFF + tl.arange(0, SIZE)[None, :] + tl.zeros((BN, 1), dtype=tl.int32)
    return tl.minimum(run, RUNS - 1), run < RUNS


@triton.jit
def _span(w_rows, s_rows, OFF: tl.constexpr, SIZE: tl.constexpr, RUNS: tl.constexpr, GROUP: tl.constexpr,
          BN: tl.constexpr, INTERPRET: tl.constexpr, STREAM: tl.constexpr = False, EARLY: tl.constexpr = False):
    """Words (4 int32 [BN, SIZE]) and fp32 scales [BN, SIZE] of runs OFF .. OFF + SIZE (scales 0 past the row).
    STREAM: both without L1 lines (read once). EARLY: loaded before the PDL wait, so coherently (``ld4``'s
    CONSTANT=False): ptxas moves ``.nc`` loads below the wait."""
    run, ok = _span_runs(OFF, SIZE, RUNS, BN)
    words = four_words(w_rows + 4 * run, INTERPRET, STREAM, not EARLY)
    scales = _load_in_place(s_rows + (32 * run) // GROUP, ok, True, INTERPRET, STREAM, not EARLY)
    if OFF + SIZE > RUNS:
        scales = tl.where(ok, scales, 0.0)
    return words, scales


@triton.jit
def _span_dot(words, scales, p_ptr, ps_ptr, OFF: tl.constexpr, SIZE: tl.constexpr, RUNS: tl.constexpr,
              BN: tl.constexpr, INTERPRET: tl.constexpr, INLINE_X: tl.constexpr = False):
    """Run sums × group scale × the run's activation scale, fp32 [BN, SIZE] (summed over runs at the row's end).
    INLINE_X: ``p_ptr`` is x itself, put in pair order here, once per run for all BN rows (``inline_pairs``)."""
    if INLINE_X:
        x = inline_pairs(p_ptr, _span_runs(OFF, SIZE, RUNS, 1)[0], INTERPRET)
        return run_dot(words, x, INTERPRET) * (scales * x[16])
    run, ok = _span_runs(OFF, SIZE, RUNS, 1)  # [1, SIZE]: each run's pairs and scale loaded once for the BN rows
    x = load_pairs(p_ptr + pair_offsets(run), INTERPRET)
    xs = _load_in_place(ps_ptr + run, ok, True, INTERPRET, CONSTANT=False)
    return run_dot(words, x, INTERPRET) * (scales * xs)


@triton.jit
def _w4a16_gemv_half2_kernel(p_ptr, ps_ptr, w_ptr, s_ptr, y_ptr, N,
                             K: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                             PIPE: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
                             SPAN1: tl.constexpr = 0, SPAN2: tl.constexpr = 0, STREAM: tl.constexpr = False,
                             INLINE_X: tl.constexpr = False, SWIGLU: tl.constexpr = False, w2_ptr=None, s2_ptr=None):
    # p: x's pairs (int32, pair order), ps: its run scales (fp32 [K/32]), w [N, K/8] int32, s [N, K/GROUP], y [N].
    # INLINE_X: p is x itself (bf16 / fp16 [K], 16-byte aligned), put in pair order in registers; ps unused.
    # PIPE: chunk c + 1 is loaded before chunk c's arithmetic (two chunks before the PDL wait); else after it.
    # SPAN1 > 0: the row as spans of BR, SPAN1 and SPAN2 runs (powers of two, only the last one past the row), all
    # loaded first (gemv.row_spans).
    # SWIGLU: w / s are a SwiGLU MLP's gate weight and w2 / s2 its up weight (both [N, K/8]); a program's first
    # BN / 2 rows are gate rows, the other BN / 2 the same rows of up; y [N] = silu(gate · x) · (up · x) (fp32 sums).
    RUNS: tl.constexpr = K // 32
    CHUNKS: tl.constexpr = (RUNS + BR - 1) // BR
    if SWIGLU:
        j = tl.arange(0, BN)
        rn = tl.program_id(0) * (BN // 2) + j % (BN // 2)
        up = (j >= BN // 2)[:, None]
        rows = (rn % N)[:, None].to(tl.int64)
        w_rows = tl.where(up, w2_ptr, w_ptr) + rows * (K // 8)
        s_rows = tl.where(up, s2_ptr, s_ptr) + rows * (K // GROUP)
    else:
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        rows = (rn % N)[:, None].to(tl.int64)  # rows past N re-read valid ones; never stored
        w_rows = w_ptr + rows * (K // 8)
        s_rows = s_ptr + rows * (K // GROUP)
    if PDL:
        gdc_launch_dependents()
    if SPAN1 > 0:
        words, scales = _span(w_rows, s_rows, 0, BR, RUNS, GROUP, BN, INTERPRET, STREAM, PDL > 0)
        words1, scales1 = _span(w_rows, s_rows, BR, SPAN1, RUNS, GROUP, BN, INTERPRET, STREAM, PDL > 0)
        if SPAN2 > 0:
            words2, scales2 = _span(w_rows, s_rows, BR + SPAN1, SPAN2, RUNS, GROUP, BN, INTERPRET, STREAM, PDL > 0)
        if PDL:
            gdc_wait()
        y = tl.sum(_span_dot(words, scales, p_ptr, ps_ptr, 0, BR, RUNS, BN, INTERPRET, INLINE_X), axis=1)
        y += tl.sum(_span_dot(words1, scales1, p_ptr, ps_ptr, BR, SPAN1, RUNS, BN, INTERPRET, INLINE_X), axis=1)
        if SPAN2 > 0:
            y += tl.sum(_span_dot(words2, scales2, p_ptr, ps_ptr, BR + SPAN1, SPAN2, RUNS, BN, INTERPRET,
                                   INLINE_X), axis=1)
        _store_rows(y_ptr, y, N, BN, SWIGLU)
    else:
        words, scales = _span(w_rows, s_rows, 0, BR, RUNS, GROUP, BN, INTERPRET, STREAM, PDL > 0)
        if PIPE and CHUNKS > 1:
            ahead, ahead_scales = _span(w_rows, s_rows, BR, BR, RUNS, GROUP, BN, INTERPRET, STREAM, PDL > 0)
        if PDL:  # the weights above may be read early; x or its pairs (and y) only after the kernel before has finished
            gdc_wait()
        acc = _span_dot(words, scales, p_ptr, ps_ptr, 0, BR, RUNS, BN, INTERPRET, INLINE_X)
        for c in tl.static_range(1, CHUNKS):
            if PIPE:
                words, scales = ahead, ahead_scales
                if c + 1 < CHUNKS:
                    ahead, ahead_scales = _span(w_rows, s_rows, (c + 1) * BR, BR, RUNS, GROUP, BN, INTERPRET, STREAM)
            else:
                words, scales = _span(w_rows, s_rows, c * BR, BR, RUNS, GROUP, BN, INTERPRET, STREAM)
            acc += _span_dot(words, scales, p_ptr, ps_ptr, c * BR, BR, RUNS, BN, INTERPRET, INLINE_X)
        _store_rows(y_ptr, tl.sum(acc, axis=1), N, BN, SWIGLU)


@triton.jit
def _store_rows(y_ptr, y, N, BN: tl.constexpr, SWIGLU: tl.constexpr):
    """Store a program's row sums y [BN] at its outputs; SWIGLU: y holds BN / 2 gate then BN / 2 up sums, and
    silu(gate) · up is stored (rounded once to y's dtype) at BN / 2 outputs."""
    if SWIGLU:
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, BN // 2)), (1, 0)))
        rn = tl.program_id(0) * (BN // 2) + tl.arange(0, BN // 2)
        h = rounded_to(gate * tl.sigmoid(gate) * up, y_ptr.dtype.element_ty)  # (the interpreter truncates casts)
        tl.store(y_ptr + rn, h.to(y_ptr.dtype.element_ty), mask=rn < N)
    else:
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


# The tiles (BN, BR, num_warps, PIPE) by the row's runs. H200, sweep_w4a16_gemv (session 27, interleaved CUDA-graph
# rounds, the pair-order launch and the GEMV both with PDL; results/sweep_w4a16_gemv_h200.json, session27_call2a/b
# and session27_call4):
# - 576 runs (K = 18432, Kimi's dense down projection): 32 rows, 32-run chunks, 8 warps 25.0-25.1 µs in two calls
#   (8 x 32 on 2 or 4 warps 26.8-27.2; the fp32 rows GEMV's default 33.0, its best tile 30.5; tinygemm 48.1);
# - 384 runs (K = 12288, GLM's dense down): 4 rows, 64-run chunks, 2 warps 16.0-16.1 µs in two calls (32 x 32 on
#   8 warps 21.2; the rows GEMV's default 18.7, its best tile 16.8; tinygemm 30.8);
# - 224 runs (K = 7168): 4 rows, 128-run chunks, 4 warps 8.7 µs at 4096 rows, 6.4 at 2048 (the rows GEMV 7.0 / 3.6);
# - 64 runs (K = 2048): 32 rows, 32-run chunks, 8 warps 5.1 µs at 7168 rows (the rows GEMV 3.6).
# Then only the two long rows were faster than the fp32 rows GEMV; since session 37 (x in pair order inside the GEMV,
# the activations honestly after the PDL wait) this GEMV is the faster one at every measured shape: w4a16_gemm's
# gemv="auto" takes it from HALF2_MIN_ROW_WORDS.
# The weights stream past L1 (the kernel's STREAM: words and scales without L1 lines). H100, sweep --forms stream /
# half2hints (session 33, the rule tiles after the pair-order launch, PDL): 7168 x 18432 31.2 µs against 31.9 with
# plain loads, 6144 x 12288 18.6 / 19.8; the scales alone (commit 900e38f) 31.9 / 19.7. H200 (session 34): 24.1 /
# 24.9 and 14.95 / 16.0 (2.0x and 2.06x tinygemm).
# Session 37 (H100, sweep --forms stream,half2, the GEMV on x itself with PDL: x put in pair order in registers, no
# pair_order launch; results/sweep_w4a16_gemv_h200.json session37_h100_inline): 7168 x 2048 16 rows in 32-run
# chunks on 4 warps 4.37 µs (32 x 32 on 8 warps 4.66; tinygemm 8.27); at 224 runs the best tile depends on N:
# 2048 x 7168 one 256-run chunk of 8 rows on 4 warps 4.47 µs (4 x 128 pipelined 5.34, 16 x 32 on 8 warps 6.72),
# 4096 x 7168 16 x 32 on 8 warps 7.99 (8 x 256 10.04, 4 x 128 9.45; tinygemm 12.81); 7168 x 18432 32 x 32 on 8 warps
# 30.7 (the best, 8 x 64 on 4 warps, 30.3). ONE_CHUNK_MAX_RUNS splits the 224-run rows by N x runs (2048 x 256).
ONE_CHUNK_MAX_RUNS = 2048 * 256
STREAM_WEIGHTS = True
INTERPRETER_TILE = (8, 4, 4, 1)  # small chunks for the CPU interpreter: several chunks, pipelined


def half2_tile(n: int, k: int, interpreted: bool = False) -> tuple[int, int, int, bool]:
    """(BN, BR, num_warps, PIPE) for an N x K weight, by the row's runs (K / 32) rounded up to a power of two."""
    runs = triton.next_power_of_2(k // 32)
    if interpreted:
        bn, br, warps, pipe = INTERPRETER_TILE
        return bn, min(br, runs), warps, pipe
    if runs <= 64:
        bn, br, warps, pipe = 16, 32, 4, True
    elif runs <= 256:  # one-chunk rows while the whole weight is about one register-resident wave, else short chunks
        bn, br, warps, pipe = (8, runs, 4, False) if n * runs <= ONE_CHUNK_MAX_RUNS else (16, 32, 8, True)
    elif runs <= 512:
        bn, br, warps, pipe = 4, 64, 2, True
    else:
        bn, br, warps, pipe = 32, 32, 8, True
    return bn, min(br, runs), warps, pipe


def half2_launch(pairs, pair_scales, weight_packed, weight_scale, y1, group_size: int, tile: tuple,
                 pdl: dict | None = None, interpreted: bool = False, stream: bool | None = None) -> None:
    """Launch :func:`_w4a16_gemv_half2_kernel` for x in pair order (``pairs`` int32 / ``pair_scales`` fp32: one row
    of ``_half2_gemv.pair_order``) -> y1 [N] (contiguous) with ``tile`` = (BN, BR, num_warps, PIPE); ``pdl``:
    ``_pdl.pdl_launch``'s keywords (the weights then read before the wait). A BR of 0: the row's runs in the spans
    of :func:`gemv.row_spans`, all loaded before the arithmetic (PIPE unused). ``stream``: the kernel's STREAM
    (the weights past L1; default ``STREAM_WEIGHTS``)."""
    _launch(pairs, pair_scales, weight_packed, weight_scale, y1, group_size, tile, pdl, interpreted, stream, False)


def half2_launch_x(x1, weight_packed, weight_scale, y1, group_size: int, tile: tuple, pdl: dict | None = None,
                   interpreted: bool = False, stream: bool | None = None) -> None:
    """:func:`half2_launch` on the activation row itself: x1 [K] bf16 / fp16, contiguous and 16-byte aligned
    (``_half2_gemv.inline_pairs_ok``), put in pair order inside the GEMV (``_half2_gemv.inline_pairs``: the same
    pairs, bit for bit, without the pair-order launch before it)."""
    if x1.dim() != 1 or not inline_pairs_ok(x1[None]):
        raise ValueError(f"half2_launch_x: x must be a contiguous bf16 / fp16 row at a 16-byte aligned address, "
                         f"got {x1.dtype}, stride {x1.stride()}, address {x1.data_ptr():#x}")
    _launch(x1, x1, weight_packed, weight_scale, y1, group_size, tile, pdl, interpreted, stream, True)


def half2_launch_swiglu(x1, gate_packed, gate_scale, up_packed, up_scale, h1, group_size: int, tile: tuple,
                        pdl: dict | None = None, interpreted: bool = False, pairs: tuple | None = None) -> None:
    """A SwiGLU MLP's gate and up GEMVs in one launch: h1 [I] = silu(gate · x) · (up · x) from the two fp32 row sums,
    rounded once to h1's dtype. x1 [K] as in :func:`half2_launch_x` (put in pair order in registers), or ``pairs``
    (``(pairs, scales)``, one row of ``pair_order``) for an x that is not 16-byte aligned. ``tile``: (BN, BR,
    num_warps, PIPE) with BN even, BN / 2 rows of each weight per program (:func:`half2_tile` of 2I rows)."""
    if tile[0] % 2:
        raise ValueError(f"half2_launch_swiglu: BN {tile[0]} must be even (BN / 2 gate and BN / 2 up rows)")
    if pairs is None and (x1.dim() != 1 or not inline_pairs_ok(x1[None])):
        raise ValueError(f"half2_launch_swiglu: x must be a contiguous bf16 / fp16 row at a 16-byte aligned address, "
                         f"got {x1.dtype}, stride {x1.stride()}, address {x1.data_ptr():#x}; else pass its pairs")
    p, ps = (x1, x1) if pairs is None else pairs
    _launch(p, ps, gate_packed, gate_scale, h1, group_size, tile, pdl, interpreted, None, pairs is None,
            swiglu=(up_packed, up_scale))


def _launch(p, ps, weight_packed, weight_scale, y1, group_size, tile, pdl, interpreted, stream, inline_x,
            swiglu=None):
    n, kw = weight_packed.shape
    bn, br, warps, pipe = tile
    br, pipe, spans = span_launch(kw // 4, br, pipe)
    w2, s2 = swiglu or (None, None)
    _w4a16_gemv_half2_kernel[(triton.cdiv(n, bn // 2 if swiglu else bn),)](
        p, ps, weight_packed, weight_scale, y1, n, K=8 * kw, GROUP=group_size, BN=bn, BR=br,
        PIPE=bool(pipe), INTERPRET=interpreted, STREAM=STREAM_WEIGHTS if stream is None else stream, num_warps=warps,
        INLINE_X=inline_x, SWIGLU=swiglu is not None, w2_ptr=w2, s2_ptr=s2, **spans, **(pdl or {"PDL": False}))
