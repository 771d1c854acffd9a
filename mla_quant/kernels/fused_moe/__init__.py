"""Fused MoE experts: ``fused_moe(x, topk_weights, topk_ids, gate, up, down, kind=...)``.

Pipeline on the GPU (see docs/moe.md): ``moe_align`` groups the T·k assignments by expert into blocks of
``block_m`` rows; a grouped gate+up GEMM with SiLU-and-multiply in its epilogue writes the intermediate
``h [T·k, I]``; a grouped down GEMM multiplies each row by its routing weight and writes ``y [T·k, H]`` in
fp32; a combine kernel sums each token's k rows (and the shared experts' output, if given) and rounds once.
At ``block_m == 1`` and one token (decode; ``decode_fusion="auto"``) there is neither align nor combine launch: GEMV
program m takes assignment m directly, the gate-up launch zeroes one arrival counter per (token, output tile),
and in the down launch the last of a token's k programs of a tile to arrive does the combine of that tile.
The CPU path is the per-expert reference (``reference.py``) of the same signature.
"""
from __future__ import annotations

import torch
import triton.language as tl

from .._backend import triton_interpreted, use_triton
from .._checks import check_same_device, check_tensor
from .._host import cdiv, next_power_of_2
from .._pdl import pdl_launch
from ..fp8_quant import FP8, act_quant_fp8, act_quant_fp8_reference
from ..int4_quant import GROUP_SIZES
from ..moe_align import moe_align
from .reference import KINDS, dequantize_expert, fused_moe_reference

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# the INT4 GEMV (block_m == 1): nibble planes with a register double buffer of the next K block's words (the
# default for fp32 x: 1.02-1.04x the plain planes in the H200 runs of 8b4c3e0 and 5a85563 at one Kimi token and at
# 16), the plain planes, the previous tile form, mma.sync on fragments built in registers (fragments.py; the decode
# path), or fp16x2 arithmetic on activation pairs (_half2_gemv.py; bf16 / fp16 x), plain or with the next K block's
# words prefetched likewise.
GEMV_FORMS = ("prefetch", "planes", "tile", "fragments", "half2", "half2_prefetch")
# gemv="auto" (the default) for bf16 / fp16 x: half2_prefetch up to this many tokens, half2 above; prefetch for fp32
# x. H200, Kimi experts, interleaved rounds (results/sweep_moe_half2_h200.json), µs half2_prefetch / half2 / the
# prefetch planes: one token 69.0 / 76.8 / 73.6 (1eb45a1) and 66.7 / 75.1 / 73.4 (6cf5cd6, pair_order with PDL);
# 4 tokens 225.9 / 222.1 / 271.1 (6cf5cd6); 16 tokens 855.1 / 869.4 / 1083.4 and 891.2 / 838.1 / 1004.0. Since
# half2_prefetch runs its tiles as [columns, runs] (HALF2_ROWS, session 27, d6104a5): 1 token 61.9 / 75.0 / 73.4,
# 4 tokens 214.6 / 224.6 / 307.3, 16 tokens 788.5 / 870.5 / 1041.9
HALF2_PREFETCH_MAX_TOKENS = 16
# The half2_prefetch launches ("gate_up", "down") that read the routing and their first K block's weights before
# their PDL wait, i.e. while the kernel before them still runs (docs/moe.md "Weights before the wait"); a sweep
# setting.
WEIGHTS_BEFORE_WAIT = ("gate_up", "down")
# half2_prefetch: the gate-up's epilogue writes h in pair order (its tiles whole runs of 32 columns), so no pair_order
# launch runs between the GEMVs; a sweep setting.
PAIRS_IN_GATE_UP = True
# half2 GEMVs: the experts' words and scales loaded without L1 lines (read once), as the dense one-token GEMVs do
# since session 33 (gemv_half2.STREAM_WEIGHTS: 4-7 % faster there); a sweep setting, off: H200, Kimi experts,
# sweep_moe_half2 --stream-weights (session 34), half2_prefetch's tiles: 1 token 62.1 µs against 59.9 without, 4 tokens
# 210.0 / 208.8, 16 tokens 759.5 / 767.0.
HALF2_STREAM_WEIGHTS = False
# half2 GEMVs on bf16 / fp16 x with 16-byte aligned rows: the gate-up puts x in pair order in its registers
# (_half2_gemv.inline_pairs, the bits pair_order writes), so no pair_order launch runs before it. Its routing and
# first weights are then read after its wait (the pair_order launch with hold_next was what made reading them early
# safe): "gate_up" leaves WEIGHTS_BEFORE_WAIT. A sweep setting (sweep_moe_half2 --inline-x), off: H100, Kimi experts
# (session 37, 0573667, run session37_h100_inline): one token 84.4 µs against 76.2 with the pair_order launch, 4 tokens
# 273.7 / 273.3 (why is not profiled: the gate-up also loses its early reads, and every one of its programs converts
# all of x's 224 runs).
HALF2_INLINE_X = False
# the INT4 tensor-core tile (block_m > 1): "auto" (below), nibble planes (the default before session 40: 1.85-2.05x
# the dequantized tile at 256 Kimi tokens on the H200), the dequantized [BLOCK_N, BLOCK_K] tile, or the aligned
# blocks' rows as the token columns of mma.sync on weight fragments (fragments._moe_frag_block_kernel)
INT4_TILE_FORMS = ("auto", "planes", "dequant", "fragments")
# int4_tile="fragments": blocks of this many rows (the MMA's token columns: 8 per token tile)
FRAG_BLOCK_MS = (8, 16, 32)
# int4_tile="auto" (the default) with block_m None: the fragment blocks up to this many rows per expert on average
# (where frag_block_m takes blocks, and the operands allow them), the plane tile above. H100, Kimi experts,
# sweep_moe_rows (session 40): with BK 128 (run session40_call1) 16-row fragment blocks took 0.97-0.99x the plane
# tile's time at 8-256 tokens (4496 / 4645 µs at 96 tokens, 5378 / 5511 at 256); with BK 256 (fragments.
# MOE_FRAG_BLOCK_TILES; runs session40_call4 / call5) 0.87-0.91x: 4163 / 4757 µs at 128 tokens, 4634-4716 / 5170-5321
# at 256 (FP8 experts 5651 / 6209-6211). Not measured above 256 tokens (5.4 rows per active expert).
FRAG_AUTO_MAX_ROWS = 8
# choose_block_m: INT4 experts run as GEMVs (block_m 1) up to this many rows per expert on average. H100, Kimi
# experts, sweep_moe_rows (session 40, run session40_call1), µs GEMV / 16-row plane tile / FP8 experts: 32 tokens
# (0.67 rows per expert) 1698 / 2554 / 2799, 64 tokens (1.33) 3174 / 3969 / 4256, 96 tokens (2.0) 4571 / 4645 /
# 4995 (16-row fragment blocks 4496), 128 tokens (2.67) 6019 / 4942 / 5382. The switch was at 0.5 until then.
GEMV_MAX_ROWS_PER_EXPERT = 1.75
# fused_moe(decode_fusion="auto"): the decode path without align and combine launches up to this many tokens.
# H200, Kimi experts, INT4 (run of 1a54790): one token 76.1 µs vs 80.0 aligned; 16 tokens 994.6 vs 975.7.
FUSION_MAX_TOKENS = 1
WEIGHT_KEYS = {"bf16": ("weight",), "fp8_block": ("weight", "weight_scale_inv"),
               "int4_group": ("weight_packed", "weight_scale")}

__all__ = ["fused_moe", "fused_moe_reference", "dequantize_expert", "choose_block_m", "frag_block_m", "KINDS",
           "WEIGHT_KEYS", "GEMV_FORMS", "INT4_TILE_FORMS", "FUSION_MAX_TOKENS"]


def choose_block_m(num_assignments: int, num_experts: int, kind: str = "int4_group") -> int:
    """Rows per block. INT4 weights: 1 (a GEMV per assignment, the rows aligned by expert so that an expert's rows
    run side by side and share its weights in L2) while the experts hold up to ``GEMV_MAX_ROWS_PER_EXPERT`` rows
    on average (decode at up to ~84 Kimi tokens); the tensor-core forms unpack a whole tile per 16 rows there. BF16
    and FP8 weights feed the tensor cores directly, so they take the smallest tensor-core tile (16) at once (FP8 at
    one token: 112 vs 254 µs as a GEMV). Larger tiles follow as the rows per expert grow (prefill), so each expert's
    weights are re-read less often."""
    per_expert = num_assignments / max(num_experts, 1)
    if per_expert <= GEMV_MAX_ROWS_PER_EXPERT and kind == "int4_group":
        return 1
    for bm in (16, 32, 64):
        if per_expert <= bm:
            return bm
    return 128


def frag_block_m(num_assignments: int, num_experts: int) -> int:
    """Rows per block for ``int4_tile="fragments"`` (the MMA's token columns): 1 (the GEMV) where
    :func:`choose_block_m` takes it, else 16 (two token tiles; 8 rows was not faster at any of 8-256 Kimi tokens in
    session 40's sweep)."""
    return 1 if choose_block_m(num_assignments, num_experts, "int4_group") == 1 else 16


def _check_weights(name: str, w: dict, kind: str, e: int | None, n: int | None, k: int,
                   group_size: int, block: tuple[int, int]) -> tuple[int, int]:
    """Check one stacked projection ([E, N, K] in ``kind``); returns (E, N)."""
    if not isinstance(w, dict) or set(w) != set(WEIGHT_KEYS[kind]):
        got = sorted(w) if isinstance(w, dict) else type(w).__name__
        raise ValueError(f"{name}: expected a dict with keys {WEIGHT_KEYS[kind]} for kind {kind!r}, got {got}")
    main = WEIGHT_KEYS[kind][0]
    t = w[main]
    if kind == "bf16":
        check_tensor(f"{name}['weight']", t, dtype=FLOATS, ndim=3)
    elif kind == "fp8_block":
        check_tensor(f"{name}['weight']", t, dtype=FP8, ndim=3)
    else:
        check_tensor(f"{name}['weight_packed']", t, dtype=torch.int32, ndim=3)
    e = t.shape[0] if e is None else e
    n = t.shape[1] if n is None else n
    k_stored = k // 8 if kind == "int4_group" else k
    if tuple(t.shape) != (e, n, k_stored):
        raise ValueError(f"{name}['{main}']: shape {tuple(t.shape)}, expected {(e, n, k_stored)}")
    if kind == "fp8_block":
        s = check_tensor(f"{name}['weight_scale_inv']", w["weight_scale_inv"], dtype=torch.float32, ndim=3)
        want = (e, -(-n // block[0]), -(-k // block[1]))
    elif kind == "int4_group":
        s = check_tensor(f"{name}['weight_scale']", w["weight_scale"], dtype=FLOATS, ndim=3)
        want = (e, n, k // group_size)
    else:
        s = None
    if s is not None and tuple(s.shape) != want:
        raise ValueError(f"{name}: scale shape {tuple(s.shape)}, expected {want}")
    for key, x in w.items():  # experts and rows may be strided (e.g. gate and up as views of one [E, 2I, H])
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            raise ValueError(f"{name}['{key}']: the last dimension must be contiguous")
    return e, n


def _check_inputs(x, topk_weights, topk_ids, gate, up, down, kind, group_size, block, act_quant, act_group,
                  shared_out, out):
    check_tensor("x", x, dtype=FLOATS, ndim=2, contiguous=True)
    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor("topk_weights", topk_weights, dtype=FLOATS, ndim=2)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [T, k] with T = x.shape[0] = {x.shape[0]}")
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} not in {KINDS}")
    hidden = x.shape[1]
    if kind == "int4_group":
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size: {group_size} not in {GROUP_SIZES}")
        if hidden % group_size:
            raise ValueError(f"x.shape[1]: hidden {hidden} is not divisible by group_size {group_size}")
    if kind == "fp8_block":
        if len(block) != 2 or any(b <= 0 or b & (b - 1) for b in block):
            raise ValueError(f"block: {block} must be two positive powers of two")
        if act_quant and hidden % act_group:
            raise ValueError(f"x.shape[1]: hidden {hidden} is not divisible by act_group {act_group}")
    e, inter = _check_weights("gate", gate, kind, None, None, hidden, group_size, block)
    _check_weights("up", up, kind, e, inter, hidden, group_size, block)
    for key in WEIGHT_KEYS[kind]:  # one kernel argument carries the strides of both
        if gate[key].stride() != up[key].stride():
            raise ValueError(f"up['{key}']: strides {up[key].stride()} differ from gate's {gate[key].stride()}")
    if kind == "int4_group" and inter % group_size:
        raise ValueError(f"gate: intermediate size {inter} is not divisible by group_size {group_size}")
    if kind == "fp8_block" and act_quant and inter % act_group:
        raise ValueError(f"gate: intermediate size {inter} is not divisible by act_group {act_group}")
    _check_weights("down", down, kind, e, hidden, inter, group_size, block)
    for name, t in (("shared_out", shared_out), ("out", out)):
        if t is not None:
            check_tensor(name, t, dtype=FLOATS, ndim=2, contiguous=True)
            if t.shape != x.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)} must equal x's {tuple(x.shape)}")
    if out is not None and out.dtype != x.dtype:
        raise TypeError(f"out: dtype {out.dtype} must equal x's {x.dtype}")
    tensors = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "shared_out": shared_out, "out": out}
    tensors.update({f"{p}['{s}']": t for p, w in (("gate", gate), ("up", up), ("down", down)) for s, t in w.items()})
    check_same_device(**tensors)
    return e, inter


def fused_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate: dict[str, torch.Tensor],
    up: dict[str, torch.Tensor],
    down: dict[str, torch.Tensor],
    *,
    kind: str = "bf16",
    group_size: int = 32,
    block: tuple[int, int] = (128, 128),
    act_quant: bool = False,
    act_group: int = 128,
    ue8m0: bool = False,
    shared_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    gemv: str = "auto",
    int4_tile: str = "auto",
    decode_fusion: bool | str = "auto",
) -> torch.Tensor:
    """Routed experts of a MoE layer. x: [T, H]; topk_weights, topk_ids: [T, k] -> [T, H] in x.dtype.

    ``gate``/``up``: stacked [E, I, H] and ``down``: [E, H, I] projections, each a dict of the format's
    checkpoint tensors (``reference.py``); ``kind`` in ``KINDS``. ``act_quant`` (fp8_block only) quantizes
    activations per token (W8A8). ``shared_out`` [T, H] is added before the final rounding. ``block_m``
    overrides :func:`choose_block_m` (GPU path only).
    ``gemv`` picks the INT4 GEMV (``block_m == 1``): ``"auto"`` (default: with bf16 / fp16 x ``"half2_prefetch"``
    up to ``HALF2_PREFETCH_MAX_TOKENS`` tokens and ``"half2"`` above, with fp32 x ``"prefetch"``), ``"planes"`` (the
    activations re-ordered into fp32 nibble planes, words unpacked in place; docs/moe.md "The INT4 plane GEMV"),
    ``"prefetch"`` (the same with the next K block's words loaded before this block's products; 1.02-1.04× the
    planes on the H200),
    ``"half2"`` (bf16 / fp16 x only: the activations as fp16 pairs with a power-of-two scale per 32, each pair of
    weights one LOP3 + one HFMA2, runs of 32 products summed in fp16 then scaled in fp32 — about twice the
    rounding error of the fp32 forms, still below bf16's; docs/moe.md "The half2 GEMV"), ``"half2_prefetch"`` (the
    same with the next K block's words loaded one block ahead) or
    ``"tile"`` (the previous form: a dequantized [BLOCK_N, BLOCK_K] fp32 tile) or ``"fragments"`` (``mma.sync`` on
    operand fragments each thread builds in its registers, as ``w4a16_gemm``'s fragment kernel: the decode path
    without align or combine launch at any token count; bf16 / fp16 x with scales of x's dtype and 16-byte aligned
    weight rows, else a ValueError naming why; ``fragments.py``).
    ``int4_tile`` picks the INT4 tensor-core tile (``block_m > 1``): ``"auto"`` (default: with ``block_m`` None,
    ``"fragments"`` up to ``FRAG_AUTO_MAX_ROWS`` rows per expert on average where the operands allow it, else
    ``"planes"``), ``"planes"`` (the words kept in
    their load layout, one dot per nibble plane against the activations re-ordered into planes; docs/moe.md
    "The INT4 plane tile"; 1.75-2.05x the dequantized tile at 256-1024 Kimi tokens on the H200), ``"dequant"``
    (the words unpacked into a [BLOCK_N, BLOCK_K] tile) or ``"fragments"`` (each aligned block's rows are the token
    columns of ``mma.sync`` on weight fragments built in registers, as ``gemv="fragments"`` builds them: every
    weight unpacked once per block of ``block_m`` in ``FRAG_BLOCK_MS`` rows, no shared memory; ``block_m`` None
    takes :func:`frag_block_m`; bf16 / fp16 x with scales of x's dtype and 16-byte aligned weight rows, else a
    ValueError naming why; ``fragments._moe_frag_block_kernel``).
    ``decode_fusion``: True runs ``block_m == 1`` without ``moe_align`` and without a combine launch: program m
    of each GEMV takes assignment m, and the last of a token's k down programs of a column tile to finish sums
    the token's rows (docs/moe.md "The decode path"); False: the aligned path with its combine launch (same
    result); ``"auto"`` (default): True at ``FUSION_MAX_TOKENS`` token(s), False above — a token's k experts are
    distinct, but between tokens the aligned order puts the rows of a shared expert side by side (one weight
    read from DRAM for both). ``block_m > 1`` is unaffected.
    """
    if decode_fusion not in (True, False, "auto"):
        raise ValueError(f"decode_fusion: {decode_fusion!r} must be True, False or 'auto'")
    block = tuple(int(b) for b in block)
    if gemv not in GEMV_FORMS + ("auto",):
        raise ValueError(f"gemv: {gemv!r} not in {GEMV_FORMS + ('auto',)}")
    if gemv == "auto":
        half2_ok = x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
        gemv = ("half2_prefetch" if x.shape[0] <= HALF2_PREFETCH_MAX_TOKENS else "half2") if half2_ok else "prefetch"
    if gemv.startswith("half2") and kind == "int4_group" and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv={gemv!r}: x is {x.dtype}; the fp16x2 GEMV takes bf16 / fp16 activations")
    if int4_tile not in INT4_TILE_FORMS:
        raise ValueError(f"int4_tile: {int4_tile!r} not in {INT4_TILE_FORMS}")
    frag_tile = kind == "int4_group" and int4_tile == "fragments"
    if block_m is not None and not (block_m == 1 or (block_m >= 16 and block_m & (block_m - 1) == 0)
                                    or (frag_tile and block_m in FRAG_BLOCK_MS)):
        raise ValueError(f"block_m: {block_m} must be 1 (GEMV) or a power of two ≥ 16 (a tensor-core tile; "
                         f"with int4_tile='fragments' one of {FRAG_BLOCK_MS})")
    num_experts, inter = _check_inputs(x, topk_weights, topk_ids, gate, up, down, kind, group_size, block,
                                       act_quant, act_group, shared_out, out)
    act_quant = act_quant and kind == "fp8_block"
    args = dict(kind=kind, group_size=group_size, block=block, act_quant=act_quant, act_group=act_group,
                ue8m0=ue8m0, shared_out=shared_out, out=out)
    if not use_triton(x):
        return fused_moe_reference(x, topk_weights, topk_ids, gate, up, down, **args)
    if gemv == "fragments" and kind == "int4_group" and (block_m or choose_block_m(
            topk_ids.numel(), num_experts, kind)) == 1:
        problem = _frag_problem(x, gate, up, down, decode_fusion)
        if problem is not None:
            raise ValueError(f"gemv='fragments': {problem}")
        return _fused_moe_fragments(x, topk_weights, topk_ids, gate, up, down, group_size, shared_out, out)
    # "auto" tries the fragment blocks (block_m None, up to FRAG_AUTO_MAX_ROWS rows per expert) and keeps the plane
    # tile where the operands do not allow them; "fragments" asked for raises instead
    auto_frag = int4_tile == "auto" and kind == "int4_group" and block_m is None and \
        topk_ids.numel() <= FRAG_AUTO_MAX_ROWS * num_experts
    if frag_tile or auto_frag:
        bm = block_m or frag_block_m(topk_ids.numel(), num_experts)
        if bm > 1:  # (at block_m 1 the GEMV runs, whatever the tile)
            problem = _frag_operand_problem(x, gate, up, down)
            if problem is None:
                if bm not in FRAG_BLOCK_MS:
                    raise ValueError(f"int4_tile='fragments': block_m {bm} must be one of {FRAG_BLOCK_MS}")
                return _fused_moe_frag_blocks(x, topk_weights, topk_ids, gate, up, down, group_size, bm,
                                              shared_out, out)
            if frag_tile:
                raise ValueError(f"int4_tile='fragments': {problem}")
    if int4_tile == "auto":
        int4_tile = "planes"
    from .._gemm_utils import PLANE_BLOCK_K, plane_order, plane_width
    from .._half2_gemv import inline_pairs_ok, pair_order
    from .kernel import (KIND_DENSE, KIND_FP8, KIND_INT4, _moe_gemm_kernel, moe_gemm_autotuned,
                         moe_gemm_plane_tile_autotuned, moe_gemv_autotuned, moe_gemv_half2_autotuned,
                         moe_gemv_half2_prefetch_autotuned,
                         moe_gemv_planes_autotuned, moe_gemv_prefetch_autotuned)

    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    result = out if out is not None else torch.empty_like(x)
    if tokens == 0:
        return result
    num_assignments = tokens * top_k
    bm = block_m or choose_block_m(num_assignments, num_experts, kind)
    topk_ids = topk_ids.contiguous()
    if decode_fusion == "auto":
        decode_fusion = tokens <= FUSION_MAX_TOKENS
    direct = bm == 1 and decode_fusion
    # PDL for the GEMV (decode) launches only, where a launch gap is a visible share of a ~40 µs kernel
    pdl = pdl_launch(x.device, "fused_moe") if bm == 1 else {"PDL": False}
    if direct:  # the identity alignment: block m = assignment m, its expert topk_ids.flat[m] (dropped ids skipped)
        expert_ids = topk_ids.view(-1)
        sorted_ids = num_padded = expert_ids  # unread
    else:
        sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, bm)

    planes = kind == "int4_group" and bm == 1 and gemv in ("planes", "prefetch")
    half2 = kind == "int4_group" and bm == 1 and gemv.startswith("half2")
    plane_tile = kind == "int4_group" and bm > 1 and int4_tile == "planes"
    pairs_out = half2 and gemv == "half2_prefetch" and PAIRS_IN_GATE_UP
    inline_x = half2 and HALF2_INLINE_X and inline_pairs_ok(x)
    gate_up_pdl = down_pdl = pdl
    # interpreted (no PDL): the same code order, with waits that return at once
    early = WEIGHTS_BEFORE_WAIT if (pdl["PDL"] or triton_interpreted()) and half2 and gemv == "half2_prefetch" \
        else ()
    if inline_x:  # no pair_order launch with hold_next before the gate-up: it reads the routing after its wait
        early = tuple(launch for launch in early if launch != "gate_up")
    if early:
        # The order that makes the early reads safe. The gate-up signals the down's pair_order launch only after
        # its own wait (PDL mode 1), so once the down launch runs, x's pair_order and every kernel before this
        # call have finished; only the gate-up and h's pair_order (unless PAIRS_IN_GATE_UP) may still run, and they
        # write h, its pairs and the counters, never the routing or the weights. For the gate-up's own early reads, x's pair_order
        # likewise signals only after its wait (hold_next), so the gate-up starts after every earlier kernel.
        gate_up_pdl = {**pdl, "PDL": 1 if pdl["PDL"] else False, "WEIGHTS_FIRST": "gate_up" in early}
        down_pdl = {**pdl, "WEIGHTS_FIRST": "down" in early}
    kind_id = {"bf16": KIND_DENSE, "fp8_block": KIND_FP8, "int4_group": KIND_INT4}[kind]
    interpret = triton_interpreted()
    consts = dict(KIND=kind_id, W8A8=act_quant, GROUP=group_size, SBN=block[0], SBK=block[1], ACT_G=act_group,
                  IEEE=x.dtype == torch.float32 and not act_quant, INTERPRET=interpret, BLOCK_M=bm, DIRECT=direct,
                  STREAM=half2 and HALF2_STREAM_WEIGHTS)
    if planes:  # the plane GEMV reads fp32 nibble planes; the gate-up epilogue writes h as planes too
        consts.update(PLANES=True, H_DT=_TL_DTYPES[x.dtype])
        tuned = moe_gemv_prefetch_autotuned if gemv == "prefetch" else moe_gemv_planes_autotuned
    elif half2:  # activation pairs in (x, then h: pair_order between the launches)
        tuned = moe_gemv_half2_prefetch_autotuned if gemv == "half2_prefetch" else moe_gemv_half2_autotuned
    elif plane_tile:  # its configs set PLANE_TILE (the tile reads unscaled planes in x's dtype, the gate-up
        tuned = moe_gemm_plane_tile_autotuned  # epilogue writes h so too)
    else:
        tuned = moe_gemv_autotuned if bm == 1 else moe_gemm_autotuned
    # interpreted: one small tile (the interpreter is slow and has nothing to tune)
    if planes or half2:
        interp_bk = PLANE_BLOCK_K
    elif plane_tile:  # the plane dots' K (BLOCK_K/8 words) must be >= 16
        interp_bk = max(128, group_size)
    else:
        interp_bk = max(64, group_size) if kind == "int4_group" else min(64, block[1], act_group)
    interp_bn = 64  # ragged N tiles at the tests' widths (multiples of the group)
    programs = num_assignments if direct else expert_ids.numel()

    def gemm(a, a_scale, w1, w3, dst, gated, routing_weights, n, k, combine=(), pdl=pdl, dst_scale=None, **extra):
        keys = WEIGHT_KEYS[kind]
        w1_main, w3_main = w1[keys[0]], w3[keys[0]]
        w1_s = w1[keys[1]] if len(keys) > 1 else w1_main  # dense weights have no scale tensor
        w3_s = w3[keys[1]] if len(keys) > 1 else w3_main
        counters, res, shared = combine or (dst, dst, dst)  # (unread unless direct)
        dst_scale = dst if dst_scale is None else dst_scale  # (unread unless PAIRS_OUT)
        launch_args = (a, a_scale, w1_main, w1_s, w3_main, w3_s, dst, routing_weights,
                       sorted_ids, expert_ids, num_padded, counters, res, shared, dst_scale,
                       num_assignments, n, k, top_k if gated else 1, num_experts, counters.numel(),
                       a.stride(0), a_scale.stride(0), w1_main.stride(0), w1_main.stride(1),
                       w1_s.stride(0), w1_s.stride(1), dst.stride(0), res.stride(0), shared.stride(0),
                       dst_scale.stride(0))
        if interpret:
            grid = (programs, cdiv(n, interp_bn))
            _moe_gemm_kernel[grid](*launch_args, GATED=gated, **consts, **extra, BLOCK_N=interp_bn,
                                   BLOCK_K=interp_bk, EVEN_K=k % interp_bk == 0,
                                   PREFETCH=(planes or half2) and gemv.endswith("prefetch"),
                                   PLANE_TILE=plane_tile, HALF2=half2, HALF2_ROWS=half2 and gemv == "half2_prefetch",
                                   WEIGHTS_FIRST=pdl.get("WEIGHTS_FIRST", False))
        else:
            grid = lambda meta: (programs, cdiv(n, meta["BLOCK_N"]))  # noqa: E731
            tuned[grid](*launch_args, GATED=gated, **consts, **extra, **pdl)

    # The interpreter rounds fp32 -> e4m3 wrongly (DESIGN.md): there the activation rounding runs in torch.
    quant = act_quant_fp8_reference if interpret else act_quant_fp8
    if act_quant:
        xa, xa_scale = quant(x, act_group, ue8m0)
    elif planes:
        xa = xa_scale = plane_order(x)  # once per call, shared by every expert
    elif inline_x:  # the gate-up reads x itself
        xa, xa_scale = x, x
    elif half2:
        xa, xa_scale = pair_order(x, hold_next="gate_up" in early)
    elif plane_tile:
        xa = xa_scale = plane_order(x, scaled=False)
    else:
        xa, xa_scale = x, x
    if planes:  # h as nibble planes (fp32, whole plane blocks) for the down projection's plane GEMV
        h = torch.empty((num_assignments, plane_width(inter)), dtype=torch.float32, device=x.device)
    elif plane_tile:  # h as unscaled planes in x's dtype for the down projection's plane tile
        h = torch.empty((num_assignments, plane_width(inter)), dtype=x.dtype, device=x.device)
    elif pairs_out:  # h in pair order straight from the gate-up's epilogue (as pair_order(h) would make it)
        h = torch.empty((num_assignments, plane_width(inter) // 2), dtype=torch.int32, device=x.device)
        h_scale = torch.empty((num_assignments, plane_width(inter) // 32), dtype=torch.float32, device=x.device)
    else:
        h = torch.empty((num_assignments, inter), dtype=x.dtype, device=x.device)
    h_out = dict(dst_scale=h_scale, PAIRS_OUT=True, H_DT=_TL_DTYPES[x.dtype]) if pairs_out else {}
    if inline_x:
        h_out["INLINE_X"] = True
    weights_flat = topk_weights.contiguous()
    y = torch.empty((num_assignments, hidden), dtype=torch.float32, device=x.device)
    shared = shared_out if shared_out is not None else result
    if direct:
        # One arrival counter per token and down-projection column tile, for the smallest tile the down launch
        # may pick (its BLOCK_N is autotuned); the gate-up launch zeroes them (COUNTERS per program m), the down
        # launch leaves them zero.
        min_bn = interp_bn if interpret else min(c.kwargs["BLOCK_N"] for c in tuned.configs)
        counters = torch.empty(tokens * cdiv(hidden, min_bn), dtype=torch.int32, device=x.device)
        combine = (counters, result, shared)
        zero_block = next_power_of_2(cdiv(counters.numel(), num_assignments))
        gemm(xa, xa_scale, gate, up, h, True, weights_flat, inter, hidden, combine, gate_up_pdl, COUNTERS=zero_block,
             **h_out)
    else:
        gemm(xa, xa_scale, gate, up, h, True, weights_flat, inter, hidden, (), gate_up_pdl, **h_out)
    if act_quant:
        ha, ha_scale = quant(h, act_group, ue8m0)
    elif pairs_out:
        ha, ha_scale = h, h_scale
    elif half2:  # h (rounded to x's dtype as in every form) as pairs for the down projection's half2 GEMV
        ha, ha_scale = pair_order(h)
    else:
        ha = ha_scale = h
    if direct:  # the combine happens in the down launch, as each token's rows arrive
        gemm(ha, ha_scale, down, down, y, False, weights_flat, hidden, inter, combine, down_pdl, TOP_K=top_k,
             HAS_SHARED=shared_out is not None)
        return result
    gemm(ha, ha_scale, down, down, y, False, weights_flat, hidden, inter, (), down_pdl)
    return _combine(y, topk_ids, num_experts, shared_out, result)


def _frag_problem(x: torch.Tensor, gate: dict, up: dict, down: dict, decode_fusion) -> str | None:
    """Why ``gemv="fragments"`` cannot take this call (None: it can)."""
    if decode_fusion is False:
        return "it runs the decode path (no align, no combine launch); decode_fusion=False asks for the other"
    return _frag_operand_problem(x, gate, up, down)


def _frag_operand_problem(x: torch.Tensor, gate: dict, up: dict, down: dict) -> str | None:
    """Why the fragment kernels cannot take these operands (None: they can)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}; the MMA fragments take bf16 / fp16"
    if (x.stride(0) * x.element_size()) % 4 or x.data_ptr() % 4:
        return "x rows are not 4-byte aligned"
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        words, scale = w["weight_packed"], w["weight_scale"]
        if scale.dtype != x.dtype:
            return f"{name}['weight_scale'] is {scale.dtype}, not x's {x.dtype} (the weights are scaled in x's dtype)"
        if words.data_ptr() % 16 or any((st * 4) % 16 for st in words.stride()[:2]):
            return f"{name}['weight_packed'] rows are not 16-byte aligned (128-bit loads)"
    if gate["weight_packed"].stride() != up["weight_packed"].stride() or \
            gate["weight_scale"].stride() != up["weight_scale"].stride():
        return "gate and up have different strides"
    return None


def _combine(y, topk_ids, num_experts, shared_out, result) -> torch.Tensor:
    """The combine launch: ``result[t]`` = Σ_j ``y[t·k + j]`` over token t's kept slots (ids in [0, E)),
    + ``shared_out``, rounded once (``kernel._moe_combine_kernel``)."""
    from .kernel import _moe_combine_kernel

    tokens, hidden = result.shape
    shared = shared_out if shared_out is not None else result
    block_h = min(1024, next_power_of_2(hidden))
    _moe_combine_kernel[(tokens, cdiv(hidden, block_h))](
        y, topk_ids, shared, result, hidden, num_experts, y.stride(0), shared.stride(0), result.stride(0),
        TOP_K=topk_ids.shape[1], HAS_SHARED=shared_out is not None, BLOCK_H=block_h, num_warps=4)
    return result


def _fused_moe_frag_blocks(x, topk_weights, topk_ids, gate, up, down, group_size, bm, shared_out, out):
    """``fused_moe`` on ``moe_align``'s blocks of ``bm`` rows, each on the fragment kernel with its rows as the MMA's
    token columns (``fragments._moe_frag_block_kernel``): gate-up writing h, down writing the weighted fp32 rows, the
    combine launch."""
    from . import fragments as frag

    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    assignments = tokens * top_k
    experts, inter = gate["weight_packed"].shape[:2]
    result = out if out is not None else torch.empty_like(x)
    if tokens == 0:
        return result
    interpret = triton_interpreted()
    topk_ids = topk_ids.contiguous()
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, experts, bm)
    pdl = pdl_launch(x.device, "fused_moe")
    h = torch.empty(assignments, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(assignments, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.contiguous().view(-1)

    def launch(which, a, w, s, w3, s3, dst, n, k, a_div, gated, x_vec):
        bk, warps, prefetch = frag.MOE_FRAG_BLOCK_INTERPRETER if interpret else frag.MOE_FRAG_BLOCK_TILES[which]
        frag._moe_frag_block_kernel[(expert_ids.numel(), cdiv(n, 16 * warps))](
            a, sorted_ids, expert_ids, num_padded, w, s, w3, s3, dst, weights,
            assignments, n, k, a_div, a.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), dst.stride(0),
            GATED=gated, GROUP=group_size, BK=bk, NT=bm // 8, EVEN_K=k % bk == 0, X_VEC=x_vec, INTERPRET=interpret,
            W=warps, PREFETCH=prefetch, num_warps=warps, **pdl)

    gw, gs, uw, us = gate["weight_packed"], gate["weight_scale"], up["weight_packed"], up["weight_scale"]
    launch("gate_up", x, gw, gs, uw, us, h, inter, hidden, top_k, True,
           x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0)
    dw, ds = down["weight_packed"], down["weight_scale"]
    launch("down", h, dw, ds, dw, ds, y, hidden, inter, 1, False, (inter * x.element_size()) % 16 == 0)
    return _combine(y, topk_ids, experts, shared_out, result)


def _fused_moe_fragments(x, topk_weights, topk_ids, gate, up, down, group_size, shared_out, out) -> torch.Tensor:
    """``fused_moe`` on the fragment kernel (``fragments._moe_frag_kernel``): a gate-up launch writing h, a down
    launch whose last arrival per token and row tile combines; one zeroed counter buffer per call."""
    from .._gemm_utils import num_sms
    from ..w4a16_gemm.fragments import frag_split
    from . import fragments as frag

    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    assignments = tokens * top_k
    experts, inter = gate["weight_packed"].shape[:2]
    result = out if out is not None else torch.empty_like(x)
    if tokens == 0:
        return result
    interpret = triton_interpreted()
    sms = num_sms(x.device)
    ids = topk_ids.contiguous().view(-1)
    weights = topk_weights.contiguous().view(-1)
    shared = shared_out if shared_out is not None else result
    pdl = pdl_launch(x.device, "fused_moe")

    def plan(which: str, rows: int, k: int):
        bk, per_sm, warps, prefetch = frag.MOE_FRAG_INTERPRETER if interpret else frag.MOE_FRAG_TILES[which]
        tiles = cdiv(rows, 16 * warps)
        split = frag_split(rows * assignments, k, 16 * warps, bk, sms, per_sm)
        return tiles, split, dict(GROUP=group_size, BK=bk, EVEN_K=k % bk == 0, INTERPRET=interpret, W=warps,
                                  TOP_K=top_k, PREFETCH=prefetch, num_warps=warps, **pdl)

    gu_tiles, gu_split, gu_meta = plan("gate_up", inter, hidden)
    dn_tiles, dn_split, dn_meta = plan("down", hidden, inter)
    counters = torch.zeros(assignments * gu_tiles + tokens * dn_tiles, dtype=torch.int32, device=x.device)
    h = torch.empty(assignments, inter, dtype=x.dtype, device=x.device)
    part_gu = torch.empty(gu_split * assignments * 2 * inter if gu_split > 1 else 1, dtype=torch.float32,
                          device=x.device)
    part_dn = torch.empty(top_k * dn_split * tokens * hidden, dtype=torch.float32, device=x.device)
    gw, gs, uw, us = gate["weight_packed"], gate["weight_scale"], up["weight_packed"], up["weight_scale"]
    frag._moe_frag_kernel[(gu_tiles, gu_split, assignments)](
        x, ids, gw, gs, uw, us, h, part_gu, counters, weights, shared,
        inter, hidden, experts, x.stride(0), gw.stride(0), gw.stride(1), gs.stride(0), gs.stride(1), h.stride(0),
        0, assignments * 2 * inter,
        GATED=True, SPLIT_K=gu_split, X_VEC=x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0,
        **gu_meta)
    dw, ds = down["weight_packed"], down["weight_scale"]
    frag._moe_frag_kernel[(dn_tiles, dn_split, assignments)](
        h, ids, dw, ds, dw, ds, result, part_dn, counters[assignments * gu_tiles:], weights, shared,
        hidden, inter, experts, h.stride(0), dw.stride(0), dw.stride(1), ds.stride(0), ds.stride(1), result.stride(0),
        shared.stride(0), tokens * hidden,
        GATED=False, SPLIT_K=dn_split, X_VEC=(inter * x.element_size()) % 16 == 0,
        HAS_SHARED=shared_out is not None, **dn_meta)
    return result
