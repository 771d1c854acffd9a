"""W4A16 GEMM: bf16/fp16 activations times INT4 group-quantized weights (compressed-tensors
``pack-quantized``). ``y = x @ W.T``. Up to ``DEQUANT_GEMM_MIN_M`` tokens the weights are dequantized in registers
(``kernel.py`` for the tiling, ``gemv*.py`` and ``fragments.py`` for the decode paths); from there on the whole weight
is dequantized once by ``int4_dequantize`` and multiplied by cuBLAS."""
from __future__ import annotations

import math

import torch

from .._backend import is_hopper, triton_interpreted, use_triton
from .._checks import check_divisible, check_same_device, check_tensor
from .._gemm_utils import m_bucket, num_sms, split_k_workspace
from .._host import cdiv
from .._pdl import pdl_launch
from ..int4_quant import GROUP_SIZES, SCALE_DTYPES, int4_dequantize
from .._half2_gemv import swiglu_pair_order_reference
from .reference import w4a16_gemm_reference, w4a16_gemv_pairs_reference, w4a16_swiglu_gemv_reference

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the one-token GEMV: "auto" (below), whole rows per program (gemv.py: H200, sweep_w4a16_gemv of f107819, 5.8 / 9.3 µs
# at 2048 / 4096 x 7168 launched plainly, 3.6 / 7.1 with prefetch_weights, against 7.5 / 13.0 for planes1 with kept
# counters; one warp per program since session 32: 3.45 / 6.60 with prefetch_weights), the same grid in fp16x2
# arithmetic (gemv_half2.py), the split-K plane GEMV in one launch, nibble planes after a plane_order launch, or the
# first form. The prefetch_weights figures here and in gemv.py / gemv_half2.py were of racy kernels until session 36
# (x read before the PDL wait; docs/moe.md "activations only after the PDL wait")
GEMV_FORMS = ("auto", "rows", "rows_half2", "planes1", "planes", "tile")
# gemv="auto" (the default): the half2 rows GEMV (gemv_half2.py) for bf16 / fp16 x with rows of at least this many
# words (K >= 2048), the fp32 rows GEMV otherwise. Until session 36 only rows of more than 1024 words (session 27,
# H200: 7168 x 18432 25.0 µs against 33.0 for the rows GEMV) — the rows GEMV's lead at K = 7168 and 2048 was its race
# (docs/moe.md "activations only after the PDL wait"). H100, session 37, both with prefetch_weights and their best
# tiles, the half2 GEMV on x itself: 2048 x 7168 4.47 µs against 5.02, 4096 x 7168 7.99 against 9.07, 7168 x 2048
# 4.37 against 5.00, 7168 x 18432 30.7 against 32.5 (results/sweep_w4a16_gemv_h200.json session37_h100_*)
HALF2_MIN_ROW_WORDS = 256
# the half2 GEMV reads a 16-byte aligned bf16 / fp16 x as it is and puts it in pair order in registers
# (``_half2_gemv.inline_pairs``), with no pair_order launch before it; False: always the pair_order launch (a sweep
# setting)
HALF2_INLINE_X = True
CONFIG_KEYS = ("BM", "BN", "BK", "SPLIT_K", "GROUP_M", "num_warps", "num_stages", "FAST_DEQUANT")

__all__ = ["w4a16_gemm", "w4a16_gemm_reference", "w4a16_gemv_pairs", "w4a16_gemv_pairs_reference",
           "swiglu_pair_order", "swiglu_pair_order_reference", "w4a16_swiglu_gemv", "w4a16_swiglu_gemv_reference",
           "CONFIG_KEYS", "GEMV_FORMS", "FAST_AUTO_MAX_M", "SWAP_MAX_M", "SWAP_FORCED_MAX_M",
           "FRAG_MAX_M", "FRAG_AUTO_MAX_M", "DEQUANT_GEMM_MIN_M"]


def _check(x, weight_packed, weight_scale, group_size) -> tuple[int, int]:
    check_tensor("x", x, dtype=X_DTYPES)
    if x.dim() == 0 or x.stride(-1) != 1:
        raise ValueError("x: needs at least one dimension, with the last one contiguous")
    n, k = _check_weight(weight_packed, weight_scale, group_size, x=x)
    if x.shape[-1] != k:
        raise ValueError(f"x: last dimension {x.shape[-1]} != K = 8 * weight_packed.shape[1] = {k}")
    return n, k


def _check_weight(weight_packed, weight_scale, group_size, **activations) -> tuple[int, int]:
    """(N, K) of an INT4 weight, checked, on the device of ``activations`` (name -> tensor)."""
    check_tensor("weight_packed", weight_packed, dtype=torch.int32, ndim=2, contiguous=True)
    check_tensor("weight_scale", weight_scale, dtype=SCALE_DTYPES, ndim=2, contiguous=True)
    check_same_device(**activations, weight_packed=weight_packed, weight_scale=weight_scale)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: {group_size} not supported, expected one of {GROUP_SIZES}")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    check_divisible("K", k, group_size, "group_size")
    if tuple(weight_scale.shape) != (n, k // group_size):
        raise ValueError(f"weight_scale: shape {tuple(weight_scale.shape)}, expected {(n, k // group_size)} "
                         f"for weight_packed {tuple(weight_packed.shape)} and group_size {group_size}")
    return n, k


# fast_dequant="auto" takes FAST_DEQUANT 1 for 2..FAST_AUTO_MAX_M tokens: on the H200 (runs of 8b4c3e0 and 71d17aa,
# bench rows int4_g32_fast at M = 16) 24.0 vs 31.8-41.5 µs at 2048 x 7168 and 37.7-38.0 vs 56.1-56.7 at 4096 x 7168;
# at M >= 512 it is 1.7-2x slower, and M = 1 runs the plane GEMV
FAST_AUTO_MAX_M = 16


def _fast_level(value, m: int, pinned: bool) -> int:
    """The FAST_DEQUANT level for ``m`` tokens: ``value`` (0 / False, 1 / True, 2 or "auto")."""
    if isinstance(value, str) and value == "auto":
        return 1 if not pinned and 1 < m <= FAST_AUTO_MAX_M else 0
    if value not in (0, 1, 2):  # False / True compare equal to 0 / 1
        raise ValueError(f"fast_dequant: {value!r} must be 0 (off), 1 or 2 (FAST_DEQUANT levels) or 'auto'")
    return int(value)


# swap_ab="auto" runs the swapped-operand kernel (kernel._w4a16_swap_kernel) for 2..SWAP_MAX_M tokens of bf16 / fp16
# activations without a pinned config or FAST_DEQUANT level where the fragment kernel does not (fp32 or mismatched
# scales, 2-byte aligned rows, fragments=False; session 13's default there): on the H200 (c286741, bench gemm)
# 1.15 / 1.50x tinygemm at 16 tokens x 2048 / 4096 x 7168, 1.39 / 1.51x the FAST_DEQUANT tile it replaced; at 8 tokens
# 0.79 / 1.00x tinygemm (still 1.46 / 1.52x the tile)
SWAP_MAX_M = 16
# swap_ab=True takes up to this many tokens (BM, the wgmma N side, the power of two >= M; kernel.swap_plan)
SWAP_FORCED_MAX_M = 128


# fragments="auto" runs the fragment kernel (fragments.py: mma.sync on fragments built in each thread's registers, no
# shared memory for the operands) for 2..FRAG_AUTO_MAX_M tokens of bf16 / fp16 activations whose scales have their
# dtype: on the H200 (24b2d41, bench gemm) 1.1-1.9x faster than the swapped kernel it replaced there at 2048 / 4096 x
# 7168; 1.06-2.24x tinygemm with kept counters (QuantLinear), 0.97-2.11x for a bare call (docs/moe.md "W4A16 at 2-16
# tokens: MMA fragments in registers"). Up to 32 since session 41 (H100, sweep_w4a16_frag, kept counters, interleaved
# rounds): 32 tokens 26.0 µs against the tiles' 31.6 at 4096 x 7168, 106.2 against 128.6 at 7168 x 18432 (cuBLAS on
# bf16 weights 26.2 / 102.1); at 64 tokens the tiles were faster (32.1 against 41.4, 129.8 against 202.8)
FRAG_AUTO_MAX_M = 32
# the fragment kernel takes up to this many tokens (fragments=True; chunks of fragments.FRAG_CHUNK_TOKENS past 32)
FRAG_MAX_M = 128


def _tokens_problem(m: int, max_m: int, x: torch.Tensor, scale_dtype: torch.dtype) -> str | None:
    """Why a kernel that takes up to ``max_m`` tokens of bf16 / fp16 x, its weight rounded to x's dtype once, cannot
    take this call (None: it can)."""
    if m > max_m:
        return f"{m} tokens (it takes up to {max_m})"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x of {x.dtype} (it takes bf16 / fp16)"
    if scale_dtype != x.dtype:
        return f"weight_scale of {scale_dtype} (it needs x's dtype, {x.dtype}: the weight is rounded to it once)"
    return None


def _frag_problem(m: int, x: torch.Tensor, weight_packed: torch.Tensor, scale_dtype: torch.dtype) -> str | None:
    """Why the fragment kernel cannot take this call (None: it can)."""
    problem = _tokens_problem(m, FRAG_MAX_M, x, scale_dtype)
    if problem is not None:
        return problem
    if x.data_ptr() % 4 or (m > 1 and x.stride(0) % 2):
        return "x rows not 4-byte aligned"
    if weight_packed.data_ptr() % 16:
        return "weight_packed not 16-byte aligned (its words load 128 bits at a time)"
    return None


def _takes_frag(fragments, m: int, x2: torch.Tensor, weight_packed: torch.Tensor, scale_dtype: torch.dtype,
                unpinned: bool) -> bool:
    """Whether this call runs the fragment kernel (``fragments``: "auto", True or False; x2 [M, K])."""
    if isinstance(fragments, str) and fragments == "auto":
        return unpinned and 2 <= m <= FRAG_AUTO_MAX_M and _frag_problem(m, x2, weight_packed, scale_dtype) is None
    if fragments is False:
        return False
    if fragments is not True:
        raise ValueError(f"fragments: {fragments!r} must be True, False or 'auto'")
    problem = _frag_problem(m, x2, weight_packed, scale_dtype)
    if problem is not None:
        raise ValueError(f"fragments=True: the fragment kernel cannot take {problem}")
    return True


def _frag_launch(x2, weight_packed, weight_scale, y, group_size, counters, interpreted, stream=None):
    """Launch ``fragments._w4a16_frag_kernel`` (the tile of ``fragments.frag_tile`` for the token count; one fixed
    small tile under the interpreter) for x2 [M <= FRAG_MAX_M, K] into y [M, N]; ``stream``: the kernel's STREAM
    (the weights past L1; default ``fragments.STREAM_WEIGHTS``)."""
    from . import fragments
    from .fragments import _w4a16_frag_kernel, frag_chunks, frag_plan

    (m, k), n = x2.shape, y.shape[1]
    split, (mt, bk, warps, _) = frag_plan(n, k, m, num_sms(x2.device), interpreted)
    chunks, nt = frag_chunks(m)
    tiles = cdiv(n, 16 * mt * warps) * chunks
    part, count = split_k_workspace(m, n, split, tiles, x2.device, counters)
    _w4a16_frag_kernel[(tiles, split)](
        x2, weight_packed, weight_scale, y, part, count, m, n, k, x2.stride(0), y.stride(0), m * n,
        GROUP=group_size, MT=mt, NT=nt, BK=bk, SPLIT_K=split, EVEN_K=k % bk == 0,
        X_VEC=x2.data_ptr() % 16 == 0 and (m == 1 or (x2.stride(0) * x2.element_size()) % 16 == 0),
        INTERPRET=interpreted, W=warps, STREAM=fragments.STREAM_WEIGHTS if stream is None else stream,
        CHUNKS=chunks, num_warps=warps)
    return y


def _wgmma_problem(m: int, x2: torch.Tensor, weight_packed: torch.Tensor, scale_dtype: torch.dtype) -> str | None:
    """Why the wgmma kernel cannot take this call (None: it can; the device is checked by the caller)."""
    from .wgmma import WGMMA_BK, WGMMA_MAX_M

    problem = _tokens_problem(m, WGMMA_MAX_M, x2, scale_dtype)
    if problem is None and x2.shape[1] % WGMMA_BK:
        problem = f"K = {x2.shape[1]}, not a multiple of {WGMMA_BK}"
    if problem is None and weight_packed.data_ptr() % 16:
        problem = "weight_packed not 16-byte aligned (TMA)"
    return problem


def _takes_wgmma(wgmma, m: int, x2: torch.Tensor, weight_packed: torch.Tensor, scale_dtype: torch.dtype,
                 unpinned: bool) -> bool:
    """Whether this call runs the Gluon wgmma kernel (``wgmma``: "auto", True or False; x2 [M, K])."""
    if isinstance(wgmma, str) and wgmma == "auto":
        return (unpinned and WGMMA_AUTO_MIN_M <= m <= WGMMA_AUTO_MAX_M and use_triton(x2) and is_hopper(x2.device)
                and not triton_interpreted() and _wgmma_problem(m, x2, weight_packed, scale_dtype) is None)
    if wgmma is False:
        return False
    if wgmma is not True:
        raise ValueError(f"wgmma: {wgmma!r} must be True, False or 'auto'")
    problem = _wgmma_problem(m, x2, weight_packed, scale_dtype)
    if problem is None and use_triton(x2) and (triton_interpreted() or not is_hopper(x2.device)):
        problem = "this device: it is a Gluon kernel for Hopper (sm_90); the interpreter cannot run it"
    if problem is not None:
        raise ValueError(f"wgmma=True: the wgmma kernel cannot take {problem}")
    return True


# wgmma="auto" runs the Gluon wgmma kernel (wgmma.py) for WGMMA_AUTO_MIN_M..WGMMA_AUTO_MAX_M tokens on Hopper
WGMMA_AUTO_MIN_M, WGMMA_AUTO_MAX_M = 0, -1  # off until measured


def _takes_swap(swap_ab, m: int, dtype: torch.dtype, unpinned: bool) -> bool:
    """Whether this call runs the swapped-operand kernel (``swap_ab``: "auto", True or False)."""
    ok_dtype = dtype in (torch.bfloat16, torch.float16)
    if isinstance(swap_ab, str) and swap_ab == "auto":
        return unpinned and ok_dtype and 2 <= m <= SWAP_MAX_M
    if swap_ab is False:
        return False
    if swap_ab is not True:
        raise ValueError(f"swap_ab: {swap_ab!r} must be True, False or 'auto'")
    if not ok_dtype or m > SWAP_FORCED_MAX_M:
        raise ValueError(f"swap_ab=True: needs at most {SWAP_FORCED_MAX_M} tokens of bf16 / fp16 activations, "
                         f"got {m} of {dtype}")
    return True


# dequant_gemm="auto" dequantizes the weight to x's dtype (int4_dequantize, ~82 % of copy) and multiplies it by cuBLAS
# from this many tokens on. The tiles that dequantize in their main loop ran at 0.32-0.34x bf16 cuBLAS at M = 512 and
# 4096 (H200, bench gemm of session 34), a third of the bf16 MMA rate; dequantizing first costs 2.56 bytes of traffic
# per weight (codes and scales read, the weight written) once per call, and cuBLAS then runs at the bf16 rate. The
# two meet where 2/3 of a bf16 GEMM's time equals that traffic: 4·M / 700 TFLOP/s = 2.56 B / 3.5 TB/s, M ≈ 128.
# Measured (H100, session 41, benchmarks/sweep_w4a16_prefill, a Kimi dense layer's projections): 842 against the
# tiles' 908 µs at 128 tokens, 1172 against 2537 at 512, 3124 against 8756 at 2048 (bf16 cuBLAS 2731); at 64 tokens
# the tiles win (docs/recipes.md "INT4 at prefill")
DEQUANT_GEMM_MIN_M = 128


def _takes_dequant_gemm(dequant_gemm, m: int, unpinned: bool) -> bool:
    """Whether this call dequantizes the whole weight and runs cuBLAS (``dequant_gemm``: "auto", True or False)."""
    if isinstance(dequant_gemm, str) and dequant_gemm == "auto":
        return unpinned and m >= DEQUANT_GEMM_MIN_M
    if dequant_gemm is not True and dequant_gemm is not False:
        raise ValueError(f"dequant_gemm: {dequant_gemm!r} must be True, False or 'auto'")
    return dequant_gemm


def _interpreter_config(m: int, group_size: int, fast: int = 0) -> dict:
    """A small fixed config for the CPU interpreter (autotuning there would only cost time; few, large
    programs run fastest there). The tests pin the other configs, split-K included. ``fast`` uses the
    16-row tensor-core tile at one token too (the GEMV is the same with and without FAST_DEQUANT)."""
    bm = 1 if m == 1 and not fast else 16 if m <= 16 else 32
    bk = 256 if bm == 1 else max(128, group_size)  # one token: a whole plane block (the plane GEMV)
    return {"BM": bm, "BN": 64, "BK": bk, "SPLIT_K": 1, "GROUP_M": 4, "num_warps": 4,
            "num_stages": 1, "FAST_DEQUANT": fast}


def w4a16_gemm(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               group_size: int = 32, *, out: torch.Tensor | None = None, config: dict | None = None,
               fast_dequant: int | str = "auto", gemv: str = "auto",
               counters: torch.Tensor | None = None, swap_ab: bool | str = "auto",
               fragments: bool | str = "auto", prefetch_weights: bool = False,
               dequant_gemm: bool | str = "auto", wgmma: bool | str = "auto") -> torch.Tensor:
    """y = x @ W.T for W = int4 codes × group scales.

    x: [..., K] bf16/fp16/fp32 (last dim contiguous); weight_packed: int32 [N, K/8]; weight_scale:
    [N, K/group_size] (bf16/fp16/fp32). Returns y: [..., N] in x.dtype (written into ``out`` if given:
    contiguous, that shape and dtype).

    ``config`` (keys of ``CONFIG_KEYS``; SPLIT_K optional) pins one kernel configuration instead of the
    autotuned choice, for tests and benchmarks. BM = 1 selects the one-token GEMV path, 16 the small-batch
    ``mma`` path, ≥ 32 the tiled path.

    ``fast_dequant`` (0 = off; 1 or True, 2; also ``config["FAST_DEQUANT"]``; ``"auto"``, the default: 1 for 2 to
    ``FAST_AUTO_MAX_M`` tokens without a pinned config, else 0) selects the group-scaled tensor-core form of
    ``kernel.py`` (codes from 16-bit lanes, one scale multiply per group partial; 2: biased codes, no float op
    per weight) and its own autotuned configs, which also try the 16-row tile at one token (docs/recipes.md).

    ``gemv`` picks the one-token GEMV (M = 1, ``fast_dequant`` off, no pinned ``config``): ``"auto"`` (default:
    ``"rows_half2"`` for bf16 / fp16 x with rows of at least ``HALF2_MIN_ROW_WORDS`` words, else ``"rows"``),
    ``"rows"`` (``gemv.py``, whole rows per program, all of a row's words in flight, no split-K, fp32 sums; its tile
    by ``gemv.gemv_tile``; docs/moe.md "W4A16 at M = 1: whole rows"), ``"rows_half2"`` (bf16 / fp16 x only:
    ``gemv_half2.py``, the same grid in fp16x2 arithmetic on x in pair order, which it makes in registers from a
    16-byte aligned x, else one ``pair_order`` launch before it; bf16-level sums; docs/moe.md "W4A16 at M = 1 in
    fp16x2"), ``"planes1"`` (the plane
    GEMV in one launch: each program reads its activations from x itself, with its own configs and split-K,
    ``kernel.planes1_split``; docs/moe.md "W4A16 at M = 1 in one launch"), ``"planes"`` (x re-ordered into fp32
    nibble planes by one small launch, the core shared with ``fused_moe``; docs/moe.md "The INT4 plane GEMV")
    or ``"tile"`` (the previous nibble-plane loop reading x with strided loads). A pinned BM = 1 config whose K
    tile the chosen plane GEMV cannot use (``kernel.planes1_tile_ok`` / ``kernel.planes_tile_ok``) runs the
    tile GEMV.

    ``swap_ab`` ("auto", the default; True; False) picks the swapped-operand kernel for up to ``SWAP_MAX_M`` tokens of
    bf16 / fp16 activations: the weight is the wgmma A operand (from registers, dequantized by elementwise ops on its
    packed bytes), the tokens the N side, one group of 32 K per pair of dots, the group scale once per output
    (``kernel._w4a16_swap_kernel``; docs/moe.md "W4A16 at 2-16 tokens: swapped operands"). "auto" takes it for 2 to
    ``SWAP_MAX_M`` tokens when neither ``config`` nor a ``fast_dequant`` level is given; True takes up to
    ``SWAP_FORCED_MAX_M`` tokens (the token tile the power of two >= M).

    ``fragments`` ("auto", the default; True; False) picks the fragment kernel: m16n8k16 ``mma.sync`` whose operand
    fragments each thread builds in its own registers (the weight scaled and rounded to x's dtype on the way, as
    ``int4_dequantize`` stores it; no shared memory; ``fragments.py``; docs/moe.md "W4A16 at 2-16 tokens: MMA fragments
    in registers"). It takes 1 to ``FRAG_MAX_M`` tokens of bf16 / fp16 activations with scales of the same dtype and
    4-byte aligned rows (past 32 tokens as chunks of up to 32, each its own programs); "auto" takes it for 2 to
    ``FRAG_AUTO_MAX_M`` such tokens when neither ``config``, a
    ``fast_dequant`` level nor ``swap_ab`` True / False is given (``swap_ab`` then decides between the swapped kernel
    and the tile). True forces it (a call it cannot take raises, naming why), False keeps it off.

    ``prefetch_weights`` (the ``"rows"`` / ``"rows_half2"`` GEMVs on sm_90+, unless ``MLA_QUANT_PDL=0``): launch it
    with programmatic dependent launch and load the weights and scales *before* waiting for the kernel launched just
    before (for ``"rows_half2"`` on an unaligned x: its ``pair_order`` launch, itself launched with PDL), so they
    stream during that kernel's tail and the launch gap. It is the caller's promise that ``weight_packed`` and
    ``weight_scale`` are not written by that kernel (true of a model's weights at decode: ``QuantLinear`` sets it);
    x is read only after the wait. Off by default.

    ``counters`` (optional, any path): int32 zeros, contiguous, at least one per output tile when the launch
    may split K (at one token N entries suffice); the split-K arrival counters, which every launch leaves at
    zero again — a buffer kept across calls (on one stream) saves the ``torch.zeros`` launch of each call.

    ``dequant_gemm`` ("auto", the default; True; False): dequantize the whole weight to x's dtype with
    ``int4_dequantize`` (the reference's rounding: ``q · scale`` rounded once), then ``torch.mm`` (cuBLAS; fp32 sums).
    "auto" takes it from ``DEQUANT_GEMM_MIN_M`` tokens when neither ``config`` nor a ``fast_dequant`` level is given:
    prefill, where the tiles that dequantize in their main loop run at a third of the bf16 MMA rate. It holds an
    [N, K] temporary in x's dtype for the call (264 MB for Kimi's 18432 × 7168 gate projection in bf16).

    ``wgmma`` ("auto", the default; True; False): the Gluon kernel of ``wgmma.py`` for 1 to 128 tokens on Hopper —
    the weight dequantized in registers straight into the wgmma A operand, words and activations by TMA through a
    ring of shared-memory slots (bf16 / fp16 x with scales of its dtype, K a multiple of 64). True forces it (a
    call it cannot take raises, naming why); "auto" takes it for ``WGMMA_AUTO_MIN_M`` to ``WGMMA_AUTO_MAX_M``
    tokens when nothing else is pinned.
    """
    if gemv not in GEMV_FORMS:
        raise ValueError(f"gemv: {gemv!r} not in {GEMV_FORMS}")
    n, k = _check(x, weight_packed, weight_scale, group_size)
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    m = x2.shape[0]
    unpinned = config is None and isinstance(fast_dequant, str) and fast_dequant == "auto"
    forced = fragments is True or swap_ab is True or wgmma is True
    if sum(v is True for v in (fragments, swap_ab, wgmma)) > 1:
        raise ValueError("fragments=True, swap_ab=True, wgmma=True: pick one kernel")
    free = unpinned and not forced  # no config, level or small-batch kernel forced
    dequant = _takes_dequant_gemm(dequant_gemm, m, free)
    if dequant and not free:
        raise ValueError("dequant_gemm=True with a pinned config, a fast_dequant level, fragments=True, "
                         "swap_ab=True or wgmma=True: pick one path")
    wg = not dequant and _takes_wgmma(wgmma, m, x2, weight_packed, weight_scale.dtype,
                                      free and not isinstance(fragments, bool) and not isinstance(swap_ab, bool))
    swap = not (dequant or wg) and _takes_swap(swap_ab, m, x.dtype, unpinned)
    frag = not (dequant or wg) and _takes_frag(fragments, m, x2, weight_packed, weight_scale.dtype,
                                       unpinned and not isinstance(swap_ab, bool))
    swap = swap and not frag
    fast_dequant = _fast_level(fast_dequant if config is None else config.get("FAST_DEQUANT", fast_dequant),
                               m, config is not None)
    lead = x.shape[:-1]
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, contiguous=True)
        check_same_device(x=x, out=out)
        if tuple(out.shape) != (*lead, n):
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {(*lead, n)}")
    if counters is not None:
        check_tensor("counters", counters, dtype=torch.int32, ndim=1, contiguous=True)
        check_same_device(x=x, counters=counters)
    if not use_triton(x, weight_packed, weight_scale):
        y = w4a16_gemm_reference(x, weight_packed, weight_scale, group_size)
        return y if out is None else out.copy_(y)
    if dequant:
        y = torch.empty((*lead, n), dtype=x.dtype, device=x.device) if out is None else out
        w = int4_dequantize(weight_packed, weight_scale, group_size, x.dtype)  # [N, K], freed on return
        torch.mm(x2, w.T, out=y.view(m, n))
        return y
    if gemv == "auto":
        gemv = "rows_half2" if x.dtype != torch.float32 and k // 8 >= HALF2_MIN_ROW_WORDS else "rows"
    if gemv == "rows_half2" and x.dtype == torch.float32:
        raise ValueError("gemv='rows_half2' takes bf16 / fp16 activations (fp16 pairs), x is float32")
    if m == 1 and gemv.startswith("rows") and config is None and not fast_dequant and not (frag or swap) and n:
        y = torch.empty((*lead, n), dtype=x.dtype, device=x.device) if out is None else out
        interpreted = triton_interpreted()
        pdl = pdl_launch(x.device, "w4a16_gemv") if prefetch_weights else {"PDL": False}
        if gemv == "rows_half2":
            from .._half2_gemv import inline_pairs_ok, pair_order
            from .gemv_half2 import half2_launch, half2_launch_x, half2_tile

            tile = half2_tile(n, k, interpreted)
            if HALF2_INLINE_X and inline_pairs_ok(x2):  # x put in pair order inside the GEMV
                half2_launch_x(x2[0], weight_packed, weight_scale, y.view(n), group_size, tile, pdl, interpreted)
            else:
                pairs, pair_scales = pair_order(x2)
                half2_launch(pairs[0], pair_scales[0], weight_packed, weight_scale, y.view(n), group_size, tile,
                             pdl, interpreted)
        else:
            from .gemv import gemv_launch, gemv_tile

            gemv_launch(x2[0], weight_packed, weight_scale, y.view(n), group_size, gemv_tile(n, k, interpreted),
                        pdl, interpreted)
        return y
    from .._gemm_utils import plane_order
    from .kernel import (FAST_AUTOTUNED, _w4a16_gemm_kernel, dot_k, dot_k_ok, planes1_split, planes1_tile_ok,
                         planes_tile_ok, split_k, w4a16_gemm_autotuned, w4a16_gemv_planes1_autotuned,
                         w4a16_gemv_planes_autotuned, workspace_bounds)

    y = (torch.empty((*lead, n), dtype=x.dtype, device=x.device) if out is None else out).view(m, n)
    if m == 0 or n == 0:
        return y.view(*lead, n)
    sms = num_sms(x.device)
    interpreted = triton_interpreted()
    if wg:
        from .wgmma import wgmma_launch

        return wgmma_launch(x2, weight_packed, weight_scale, y, group_size, counters, sms).view(*lead, n)
    if frag:
        return _frag_launch(x2, weight_packed, weight_scale, y, group_size, counters, interpreted).view(*lead, n)
    if swap:
        return _swap_launch(x2, weight_packed, weight_scale, y, group_size, counters, interpreted).view(*lead, n)
    if config is None and interpreted:
        config = _interpreter_config(m, group_size, fast_dequant)
    x_vec = x2.data_ptr() % 16 == 0  # planes1: 128-bit activation loads (else one strided load per plane)
    planes1 = (m == 1 and gemv == "planes1" and not fast_dequant
               and (config is None or (config["BM"] == 1 and planes1_tile_ok(config["BK"], config["num_warps"],
                                                                             x_vec))))
    if config is not None:
        cfg = {**config, "FAST_DEQUANT": fast_dequant}
        bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
        if bk % group_size or bk % 8:
            raise ValueError(f"config: BK={bk} must be a multiple of group_size {group_size}")
        if bm == 1 and m != 1:
            raise ValueError(f"config: BM=1 is the one-token path, got {m} tokens")
        if not dot_k_ok(bm, bk, group_size, fast_dequant):
            kd = dot_k(bm, bk, group_size, fast_dequant)
            raise ValueError(f"config: BM={bm}, BK={bk} gives tl.dot a K extent of {kd} < 16, which does not "
                             f"compile on the GPU (the 16-row tile dots one nibble plane, BK/8: use BK >= 128)")
        split = cfg.pop("SPLIT_K", None) or (planes1_split(n, k, bn, bk, sms) if planes1
                                             else split_k(m, n, k, bm, bn, bk, sms))
        max_split, max_tiles = split, cdiv(m, bm) * cdiv(n, bn)
    else:
        cfg = None
        max_split, max_tiles = workspace_bounds(m, n, k, group_size, sms, fast_dequant, planes1)
    part, count = split_k_workspace(m, n, max_split, max_tiles, x.device, counters)
    planes = (m == 1 and gemv == "planes" and not fast_dequant
              and (cfg is None or (cfg["BM"] == 1 and planes_tile_ok(cfg["BK"], cfg["num_warps"]))))
    common = dict(GROUP=group_size, INTERPRET=interpreted,
                  DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PLANES=planes, PLANES1=planes1,
                  X_VEC=planes1 and x_vec)
    if planes:
        x2 = plane_order(x2)
    args = (x2, weight_packed, weight_scale, y, part, count, m, n, k, x2.stride(0), y.stride(0), m * n,
            m_bucket(m), sms)

    def grid(meta):
        return (cdiv(m, meta["BM"]) * cdiv(n, meta["BN"]), meta["SPLIT_K"])

    if cfg is None:
        tuned = (w4a16_gemv_planes1_autotuned if planes1 else w4a16_gemv_planes_autotuned if planes
                 else FAST_AUTOTUNED.get(fast_dequant, w4a16_gemm_autotuned))
        tuned[grid](*args, **common)
    else:
        meta = {**cfg, "SPLIT_K": split, "EVEN_K": k % cfg["BK"] == 0}
        _w4a16_gemm_kernel[grid(meta)](*args, **common, **meta)
    return y.view(*lead, n)


def swiglu_pair_order(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A SwiGLU MLP's h = silu(gate) · up, made and put in *pair order* in one launch, for the down projection's
    :func:`w4a16_gemv_pairs` (the layout: ``_half2_gemv``'s module docstring).

    gate, up: [R, K] bf16 / fp16, one shape and dtype, last dim contiguous. h is computed in fp32 and rounded once to
    that dtype (eager ``F.silu(gate) * up`` rounds twice: after the SiLU and after the product). Returns ``(pairs,
    scales)``: int32 [R, plane_width(K) / 2] and fp32 [R, plane_width(K) / 32], each run of 32 K scaled by a power of
    two into fp16's range. On CUDA one Triton launch (with PDL on Hopper), else :func:`swiglu_pair_order_reference`."""
    check_tensor("gate", gate, dtype=(torch.bfloat16, torch.float16), ndim=2)
    check_tensor("up", up, dtype=gate.dtype, ndim=2)
    check_same_device(gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"up: shape {tuple(up.shape)} != gate's {tuple(gate.shape)}")
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("gate, up: the last dimension must be contiguous")
    if not use_triton(gate, up):
        return swiglu_pair_order_reference(gate, up)
    from .._half2_gemv import pair_order_swiglu

    return pair_order_swiglu(gate, up)


def w4a16_gemv_pairs(pairs: torch.Tensor, pair_scales: torch.Tensor, weight_packed: torch.Tensor,
                     weight_scale: torch.Tensor, group_size: int = 32, *, dtype: torch.dtype = torch.bfloat16,
                     out: torch.Tensor | None = None, prefetch_weights: bool = False) -> torch.Tensor:
    """The one-token W4A16 GEMV on an activation row already in pair order: y = x @ W.T for the x that ``(pairs,
    pair_scales)`` hold, by the half2 GEMV of ``w4a16_gemm(gemv="rows_half2")`` without making the pairs (the kernel
    before it made them, e.g. :func:`swiglu_pair_order` for a down projection). docs/moe.md "The down projection on
    pairs made by the SwiGLU".

    pairs: int32 [1, plane_width(K) / 2]; pair_scales: fp32 [1, plane_width(K) / 32]; weight_packed, weight_scale,
    group_size as in :func:`w4a16_gemm`. ``dtype`` (bf16 / fp16): the output's (and h's) dtype. Returns y: [1, N]
    (into ``out`` if given: contiguous, that shape and dtype). ``prefetch_weights``: as in :func:`w4a16_gemm` (the
    weights loaded before the PDL wait). The sums are the half2 GEMV's (bf16-level); on CPU
    :func:`w4a16_gemv_pairs_reference`."""
    from .._gemm_utils import plane_width

    check_tensor("pairs", pairs, dtype=torch.int32, ndim=2, contiguous=True)
    check_tensor("pair_scales", pair_scales, dtype=torch.float32, ndim=2, contiguous=True)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: {dtype}, expected bfloat16 or float16 (the half2 GEMV's activations)")
    n, k = _check_weight(weight_packed, weight_scale, group_size, pairs=pairs, pair_scales=pair_scales)
    width = plane_width(k)
    if pairs.shape[0] != 1:
        raise ValueError(f"pairs: {pairs.shape[0]} rows; the pair-order GEMV takes one token")
    if tuple(pairs.shape) != (1, width // 2) or tuple(pair_scales.shape) != (1, width // 32):
        raise ValueError(f"pairs {tuple(pairs.shape)} / pair_scales {tuple(pair_scales.shape)}: expected "
                         f"{(1, width // 2)} / {(1, width // 32)} for K = {k}")
    if out is not None:
        check_tensor("out", out, dtype=dtype, contiguous=True)
        check_same_device(pairs=pairs, out=out)
        if tuple(out.shape) != (1, n):
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {(1, n)}")
    if not use_triton(pairs, weight_packed, weight_scale):
        y = w4a16_gemv_pairs_reference(pairs, pair_scales, weight_packed, weight_scale, group_size, dtype=dtype)
        return y if out is None else out.copy_(y)
    from .gemv_half2 import half2_launch, half2_tile

    y = torch.empty((1, n), dtype=dtype, device=pairs.device) if out is None else out
    if n:
        interpreted = triton_interpreted()
        pdl = pdl_launch(pairs.device, "w4a16_gemv") if prefetch_weights else {"PDL": False}
        half2_launch(pairs[0], pair_scales[0], weight_packed, weight_scale, y.view(n), group_size,
                     half2_tile(n, k, interpreted), pdl, interpreted)
    return y


def w4a16_swiglu_gemv(x: torch.Tensor, gate_packed: torch.Tensor, gate_scale: torch.Tensor, up_packed: torch.Tensor,
                      up_scale: torch.Tensor, group_size: int = 32, *, out: torch.Tensor | None = None,
                      prefetch_weights: bool = False) -> torch.Tensor:
    """A SwiGLU MLP's gate and up projections for one token in one launch: h = silu(x @ Wg.T) · (x @ Wu.T).

    x: [1, K] bf16 / fp16 (last dim contiguous); gate_packed / up_packed: int32 [I, K/8]; gate_scale / up_scale:
    [I, K/group_size]. Returns h: [1, I] in x's dtype (into ``out`` if given: contiguous, that shape and dtype).
    Each program of the half2 GEMV (``gemv_half2``, ``SWIGLU``) sums BN / 2 rows of each weight and writes
    silu(gate) · up from the two fp32 sums, rounded once (the two GEMVs and an eager SwiGLU round gate and up, the
    SiLU and the product: four roundings). The tile is :func:`gemv_half2.half2_tile` of 2I rows. x is put in pair
    order inside the GEMV when it is 16-byte aligned, else by one ``pair_order`` launch before it.
    ``prefetch_weights``: as in :func:`w4a16_gemm` (both weights read before the PDL wait). On CPU
    :func:`w4a16_swiglu_gemv_reference`. docs/moe.md "The gate and up GEMVs in one launch"."""
    check_tensor("x", x, dtype=(torch.bfloat16, torch.float16), ndim=2)
    if x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(f"x: shape {tuple(x.shape)}, stride {x.stride()}: one token, last dim contiguous")
    inter, k = gate_packed.shape[0], x.shape[1]
    for name, (packed, scale) in {"gate": (gate_packed, gate_scale), "up": (up_packed, up_scale)}.items():
        if _check(x, packed, scale, group_size) != (inter, k):
            raise ValueError(f"{name}_packed: shape {tuple(packed.shape)}, expected {(inter, k // 8)} (gate's)")
    if up_scale.dtype != gate_scale.dtype:
        raise ValueError(f"up_scale: {up_scale.dtype} != gate_scale's {gate_scale.dtype}")
    if out is not None:
        check_tensor("out", out, dtype=x.dtype, contiguous=True)
        check_same_device(x=x, out=out)
        if tuple(out.shape) != (1, inter):
            raise ValueError(f"out: shape {tuple(out.shape)}, expected {(1, inter)}")
    if not use_triton(x, gate_packed, up_packed):
        h = w4a16_swiglu_gemv_reference(x, gate_packed, gate_scale, up_packed, up_scale, group_size)
        return h if out is None else out.copy_(h)
    from .._half2_gemv import inline_pairs_ok, pair_order
    from .gemv_half2 import half2_launch_swiglu, half2_tile

    h = torch.empty((1, inter), dtype=x.dtype, device=x.device) if out is None else out
    if inter:
        interpreted = triton_interpreted()
        pdl = pdl_launch(x.device, "w4a16_gemv") if prefetch_weights else {"PDL": False}
        pairs = None
        if not (HALF2_INLINE_X and inline_pairs_ok(x)):
            p, ps = pair_order(x)
            pairs = (p[0], ps[0])
        half2_launch_swiglu(x[0], gate_packed, gate_scale, up_packed, up_scale, h.view(inter), group_size,
                            half2_tile(2 * inter, k, interpreted), pdl, interpreted, pairs)
    return h


def _swap_launch(x2, weight_packed, weight_scale, y, group_size, counters, interpreted, split=None, tile=None,
                 x_split=None):
    """Launch ``kernel._w4a16_swap_kernel`` for x2 [M <= SWAP_FORCED_MAX_M, K] into y [M, N]: BM and the split from
    ``kernel.swap_plan``, the tile ``kernel.SWAP_TILE`` (BN, BK, warps, stages), the activations' load form
    (``X_SPLIT``) from ``kernel.SWAP_X_SPLIT_MIN_M``; ``split`` / ``tile`` / ``x_split`` pin them (sweeps)."""
    from .kernel import SWAP_TILE, SWAP_X_SPLIT_MIN_M, _w4a16_swap_kernel, swap_plan

    (m, k), n = x2.shape, y.shape[1]
    bn, bk, warps, stages = tile or SWAP_TILE
    bm, planned = swap_plan(m, n, k, num_sms(x2.device))
    split = split or planned
    part, count = split_k_workspace(m, n, split, cdiv(n, bn), x2.device, counters)
    _w4a16_swap_kernel[(cdiv(n, bn), split)](
        x2, weight_packed, weight_scale, y, part, count, m, n, k, x2.stride(0), y.stride(0), m * n,
        GROUP=group_size, BM=bm, BN=bn, BK=bk, SPLIT_K=split, EVEN_K=k % bk == 0, INTERPRET=interpreted,
        X_SPLIT=m >= SWAP_X_SPLIT_MIN_M if x_split is None else x_split, num_warps=warps, num_stages=stages)
    return y
