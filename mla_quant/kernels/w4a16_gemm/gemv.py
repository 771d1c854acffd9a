"""The one-token W4A16 GEMV with whole rows per program (``w4a16_gemm(..., gemv="rows")``).

y[n] = Σ_k x[k] · s[n, k / GROUP] · (q[n, k] - 8) for one activation row x [K] and W [N, K/8] int32 nibbles.

Each program owns ``BN`` output rows and walks their whole K: no split-K, so no partials, arrival counters or
zero-fill launch, and every output is summed in one fixed order. Rows of up to 1024 words (Kimi's K = 7168: 896)
come as up to three power-of-two *spans* (:func:`row_spans`: 512 + 256 + 128, no masked words), all loaded — words
and scales of its rows — before the first arithmetic, on one warp per program (no cross-warp sum). Longer rows are
walked in chunks of ``BKW`` words, the next one loaded after a chunk's arithmetic or, with ``PIPE``, before it (a
register double buffer); their per-run partials are summed across warps once, at the end of the row. The
arithmetic is the plane GEMV's (``kernel.int4_x_plane_dot``: one LOP3 + FFMA + FFMA per weight, each word's 8
activations in one 128-bit load, the group scale once per run of 4 words). The weights are read once, so they
stream past L1 (``STREAM``: words evict-first, scales with no L1 line), which leaves L1 to the activation row. Tiles
by row length: :func:`gemv_tile`; measured in docs/moe.md "W4A16 at M = 1: whole rows", "one warp per program" and
"the weights stream past L1".

``PDL`` (launched with programmatic dependent launch, :mod:`.._pdl`): the program lets the next kernel be
scheduled, loads its spans or first chunk of words and scales (two with ``PIPE``), and only then waits for the kernel
before it (``griddepcontrol.wait``) before reading x. The weights of a decode step do not depend on the kernel
before, so their loads overlap that kernel's tail and the launch gap — which is the caller's promise
(``w4a16_gemm``'s ``prefetch_weights``): the weight and scale tensors are not written by the kernel launched just
before.
"""
import triton
import triton.language as tl

from .._gemm_utils import _load_in_place
from .._triton_utils import gdc_launch_dependents, gdc_wait
from .kernel import int4_x_plane_dot


@triton.jit
def _span(w_cols, s_cols, OFF: tl.constexpr, SIZE: tl.constexpr, KW: tl.constexpr, GROUP: tl.constexpr,
          INTERPRET: tl.constexpr, STREAM: tl.constexpr = False):
    """Words int32 [SIZE, BN] and scales fp32 [SIZE/4, BN] of words OFF .. OFF + SIZE of the rows (words past K/8
    read as 0, scales as 0). STREAM: the words evict-first, the scales without an L1 line (read once)."""
    FULL: tl.constexpr = OFF + SIZE <= KW
    EVICT: tl.constexpr = "evict_first" if STREAM else ""
    rw = OFF + tl.arange(0, SIZE)[:, None]
    runs = OFF // 4 + tl.arange(0, SIZE // 4)[:, None]  # runs of 4 words (32 K): one scale each
    if FULL:
        words = tl.load(w_cols + rw, eviction_policy=EVICT)
    else:
        words = tl.load(w_cols + rw, mask=rw < KW, other=0, eviction_policy=EVICT)
    scales = _load_in_place(s_cols + (32 * runs) // GROUP, runs < KW // 4, FULL, INTERPRET, STREAM)  # 0 past K
    return words, scales


@triton.jit
def _span_dot(words, scales, x_ptr, OFF: tl.constexpr, SIZE: tl.constexpr, KW: tl.constexpr,
              INTERPRET: tl.constexpr, VEC: tl.constexpr):
    """x · codes · scale of words OFF .. OFF + SIZE summed per run of 4 words: fp32 [SIZE/4, BN] (the sum over
    runs is left to the caller: once per span, or once per row for chunks). x is read in place (element 8w of word
    w; past K/8 the last word's, whose products the zero scales drop)."""
    rw = OFF + tl.arange(0, SIZE)[:, None]
    x_ptrs = x_ptr + 8 * tl.minimum(rw, KW - 1)
    inner = int4_x_plane_dot(words, x_ptrs, None, True, INTERPRET, VEC)          # [SIZE, BN]
    runs = tl.sum(tl.reshape(inner, (SIZE // 4, 4, words.shape[1])), axis=1)    # [SIZE/4, BN]
    return runs * scales


@triton.jit
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N,
                       K: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr,
                       PIPE: tl.constexpr, VEC: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
                       SPAN1: tl.constexpr = 0, SPAN2: tl.constexpr = 0, STREAM: tl.constexpr = False):
    # x [K] (16-byte aligned for VEC), w [N, K/8] int32, s [N, K/GROUP], y [N]. PIPE: chunk c + 1 is loaded before
    # chunk c's arithmetic (a register double buffer; two chunks before the PDL wait); else after it. SPAN1 > 0:
    # the row as spans of BKW, SPAN1 and SPAN2 (powers of two, only the last one masked) words, all loaded first.
    KW: tl.constexpr = K // 8
    CHUNKS: tl.constexpr = (KW + BKW - 1) // BKW
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    cols = (rn % N)[None, :].to(tl.int64)  # rows past N re-read valid ones; never stored
    w_cols = w_ptr + cols * KW
    s_cols = s_ptr + cols * (K // GROUP)
    if PDL:
        gdc_launch_dependents()
    if SPAN1 > 0:
        words, scales = _span(w_cols, s_cols, 0, BKW, KW, GROUP, INTERPRET, STREAM)
        words1, scales1 = _span(w_cols, s_cols, BKW, SPAN1, KW, GROUP, INTERPRET, STREAM)
        if SPAN2 > 0:
            words2, scales2 = _span(w_cols, s_cols, BKW + SPAN1, SPAN2, KW, GROUP, INTERPRET, STREAM)
        if PDL:
            gdc_wait()
        y = tl.sum(_span_dot(words, scales, x_ptr, 0, BKW, KW, INTERPRET, VEC), axis=0)
        y += tl.sum(_span_dot(words1, scales1, x_ptr, BKW, SPAN1, KW, INTERPRET, VEC), axis=0)
        if SPAN2 > 0:
            y += tl.sum(_span_dot(words2, scales2, x_ptr, BKW + SPAN1, SPAN2, KW, INTERPRET, VEC), axis=0)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)
    else:
        words, scales = _span(w_cols, s_cols, 0, BKW, KW, GROUP, INTERPRET, STREAM)
        if PIPE and CHUNKS > 1:
            ahead, ahead_scales = _span(w_cols, s_cols, BKW, BKW, KW, GROUP, INTERPRET, STREAM)
        if PDL:  # the weights above may be read early; x (and y) only after the kernel before has finished
            gdc_wait()
        acc = _span_dot(words, scales, x_ptr, 0, BKW, KW, INTERPRET, VEC)
        for c in tl.static_range(1, CHUNKS):
            if PIPE:
                words, scales = ahead, ahead_scales
                if c + 1 < CHUNKS:
                    ahead, ahead_scales = _span(w_cols, s_cols, (c + 1) * BKW, BKW, KW, GROUP, INTERPRET, STREAM)
            else:
                words, scales = _span(w_cols, s_cols, c * BKW, BKW, KW, GROUP, INTERPRET, STREAM)
            acc += _span_dot(words, scales, x_ptr, c * BKW, BKW, KW, INTERPRET, VEC)
        tl.store(y_ptr + rn, tl.sum(acc, axis=0).to(y_ptr.dtype.element_ty), mask=rn < N)


# The tiles (BN, BKW, num_warps, PIPE) by row length. Up to 1024 words: one warp per program, the rows in power-of-two
# spans (BKW 0, row_spans), BN rows so that a thread holds ~64 words: no cross-warp sum, no barrier, no masked words.
# H200, sweep_w4a16_gemv --forms rows,spans (session 32, interleaved CUDA-graph rounds, with prefetch_weights):
# 4096 x 7168 2 rows 6.60 µs against 7.03 for the previous tile (8 rows, one 1024-word chunk, 4 warps), 2048 x 7168
# 3.45 against 3.56, 7168 x 2048 (8 rows, one 256-word span) 3.43 against 3.58 (32 rows, pipelined 128-word chunks,
# 8 warps); at 4096 x 7168 the spans on 2 / 4 warps (4 / 8 rows) 6.90 / 7.34, 4 rows on one warp 7.39, one chunk of 1024
# words on one warp (2 / 4 rows) 7.71 / 7.18. Longer rows (K = 18432: 2304 words; one chunk, or 4 warps, would spill):
# pipelined 512-word chunks, 8 warps. Session 27 timed it with bf16 x (with PDL): 33.0 µs at 7168 x 18432, 18.7 at
# 6144 x 12288; 4 rows on 4 warps 30.6-30.9 / 17.3-17.5, 8 x 256 on 8 warps 30.5 / 18.7, 8 x 512 on 4 warps 43.4 / 16.8.
# 16-bit x runs gemv_half2.py there since (faster still), so this tile serves fp32 x, which was not timed (4 x 512 on 4
# warps takes 168 registers with fp32 x at K = 18432 against 128 with bf16): the rule is left as it was.
# The weights stream past L1 (the kernel's STREAM): the words evict-first, the scales' scalar loads without an L1
# line. H100, sweep --forms stream / hints (session 33, interleaved CUDA-graph rounds, PDL): 4096 x 7168 6.84 µs
# against 7.34 with plain loads, 2048 x 7168 3.67 / 3.86, 7168 x 2048 3.54 / 3.73, 7168 x 18432 (8 x 512 chunks)
# 34.6 / 36.8; the words evict-first alone 7.22 / 3.79 / 3.77 / 37.0, the scales alone 7.36 / 3.87 / 3.74, .cg
# 7.35 / 3.86 / 3.73 / 36.8 (those variants: commit 900e38f). H200, sweep --forms stream (session 34): 4096 x 7168
# 6.31 µs against 6.60, 2048 x 7168 3.31 / 3.46, 7168 x 2048 3.30 / 3.43. All those PDL timings let ptxas run most of
# the arithmetic before the wait, on an x read too early (fixed in session 36; docs/moe.md "activations only after the
# PDL wait"): H100 without the race, streamed / plain loads: 4096 x 7168 10.01 / 10.17 µs, 2048 x 7168 5.49 / 5.73,
# 7168 x 2048 6.67 / 6.77, 7168 x 18432 36.5 / 38.7.
STREAM_WEIGHTS = True
LONG_ROW_WORDS = 1024
WORDS_PER_THREAD = 64  # one warp's rows: BN = 32 * WORDS_PER_THREAD / (the row's words rounded up)
INTERPRETER_TILE = (8, 64, 4, 1)  # small chunks for the CPU interpreter: several chunks, pipelined


def gemv_tile(n: int, k: int, interpreted: bool = False) -> tuple[int, int, int, bool]:
    """(BN, BKW, num_warps, PIPE) for an N x K weight, by the row's words rounded up to a power of two; a BKW of 0:
    the row in :func:`row_spans`."""
    words = triton.next_power_of_2(k // 8)
    if interpreted:
        bn, bkw, warps, pipe = INTERPRETER_TILE
        return bn, min(bkw, words), warps, pipe
    if words <= LONG_ROW_WORDS:
        return max(1, 32 * WORDS_PER_THREAD // words), 0, 1, False
    return 8, 512, 8, True


def row_spans(width: int) -> tuple[int, int, int]:
    """A row of ``width`` words (or runs) as at most three power-of-two spans, largest first, only the last one past
    the row (896 = 512 + 256 + 128; 2304 = 2048 + 256 + 0): no masked words where a chunk of the row's width rounded
    up would carry 128 of 1024 (K = 7168)."""
    first = 1 << (width.bit_length() - 1)
    second = 1 << ((width - first).bit_length() - 1) if width > first else 0
    left = width - first - second
    return first, second, triton.next_power_of_2(left) if left else 0


def span_launch(width: int, first: int, pipe: bool) -> tuple[int, bool, dict]:
    """(first span or chunk, PIPE, the SPAN1 / SPAN2 keywords) of a tile whose first span is ``first``: a 0 stands
    for the row's :func:`row_spans` (PIPE off); any other ``first`` is a chunk length, launched as given."""
    if first:
        return first, pipe, {}
    first, span1, span2 = row_spans(width)
    return first, False, {"SPAN1": span1, "SPAN2": span2}


def gemv_launch(x1, weight_packed, weight_scale, y1, group_size: int, tile: tuple, pdl: dict | None = None,
                interpreted: bool = False, stream: bool | None = None) -> None:
    """Launch :func:`_w4a16_gemv_kernel` for x1 [K] -> y1 [N] (both contiguous) with ``tile`` = (BN, BKW, num_warps,
    PIPE); a BKW of 0: the row in the spans of :func:`row_spans`, all loaded before the arithmetic (PIPE unused);
    ``pdl``: ``_pdl.pdl_launch``'s keywords (PDL, launch_pdl): the weights then read before the wait. ``stream``:
    the kernel's STREAM (the weights past L1; default ``STREAM_WEIGHTS``)."""
    n, kw = weight_packed.shape
    bn, bkw, warps, pipe = tile
    bkw, pipe, spans = span_launch(kw, bkw, pipe)
    vec = not interpreted and x1.data_ptr() % 16 == 0
    _w4a16_gemv_kernel[(triton.cdiv(n, bn),)](
        x1, weight_packed, weight_scale, y1, n, K=8 * kw, GROUP=group_size, BN=bn, BKW=bkw, PIPE=bool(pipe), VEC=vec,
        INTERPRET=interpreted, STREAM=STREAM_WEIGHTS if stream is None else stream, num_warps=warps, **spans,
        **(pdl or {"PDL": False}))
