"""W4A16 for 17-128 tokens on Hopper (Gluon): the INT4 weight as the wgmma A operand in registers, fed from a TMA
ring, the activations as the B operand straight from shared memory.

    y^T [N, M] = W [N, K] @ x'^T [K, M]        (x' = x with K permuted within blocks of BK, below)

One program owns ``BN = 64 · warp groups`` weight rows (each warp group one m64 slice) and all M <= BM tokens
(BM, the wgmma N side, the power of two >= M, from 32), over one split of the K blocks:

* TMA copies each K block's packed words [BN, BK/8] (int32) and activations [BM, BK] into a ring of ``STAGES``
  shared-memory slots, ``STAGES - 1`` blocks ahead of the math; one ``ready`` barrier per slot.
* Each thread loads its words from shared memory in 8- or 16-byte runs and dequantizes them in registers
  (``_dequant``: per word 4 x (shift, lop3, sub.bf16x2, mul.bf16x2), the scale multiply in x's dtype as
  ``int4_dequantize`` rounds it), already in the wgmma A-operand layout: no shared-memory round trip for the
  weight and no layout conversion.
* One async wgmma per K block (BK / 16 instructions) into the fp32 accumulator [BN, BM]; the next block's words are
  unpacked while it runs (``warpgroup_mma_wait(1)``), then the slot it read is refilled.
* Split-K partials are summed in split order by the last program of a row tile (as ``_gemm_utils.store_split_k``).

**Why x is permuted.** wgmma's A fragment gives lane ``l`` of a warp the K pairs ``{2j, 2j+1, 2j+8, 2j+9}`` of
each 16-wide K slice (``j = l % 4``) for rows ``l / 4`` and ``l / 4 + 8``. Dequantizing a word yields its nibbles
as the bf16 pairs (n0, n4), (n1, n5), (n2, n6), (n3, n7) (one lop3 each: Marlin's trick). So this kernel lets lane
``j`` of each quad read the contiguous words ``WPL·j .. WPL·j + WPL - 1`` (``WPL = BK / 32``: 8·WPL contiguous K,
16 at BK = 64, inside one quantization group) of its two rows and gives each pair a slot of the A fragment: pair
``i`` of word ``v`` goes to slice ``t = 2v + i // 2`` at offset ``8 (i % 2)``. The dot product sums over K in
whatever order both operands share, so x's columns are permuted the same way (``k_order``): logical column
``L = 16t + 8s + 2j + h`` of a block holds x's physical column ``p = 8·WPL·j + 8v + i + 4h`` (``v = t // 2``,
``i = 2 (t % 2) + s``), one gather of x per call. A lane's scale is one value per row and block.

x: bf16 / fp16 [M, K], K a multiple of BK; weight_packed int32 [N, K/8] (compressed-tensors ``pack-quantized``);
weight_scale [N, K/G] in x's dtype (G = 32, 64 or 128). Rows past N and tokens past M read zeros (TMA) or zero
scales and are not stored. The Triton interpreter does not run Gluon: GPU tests (tests/kernels/test_w4a16_wgmma.py)
check it against the reference; ``benchmarks.compile_check w4a16_gemm -k wgmma`` compiles it for sm_90.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .._host import cdiv

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier                     # (3.9: gl.barrier)

WGMMA_BK = 64  # K per block: x's TMA box is then 128 bytes wide (one 128-byte swizzle span)
WGMMA_MIN_BM = 32
WGMMA_MAX_M = 128


def k_order(bk: int = WGMMA_BK) -> torch.Tensor:
    """The permutation of one K block (int64 [bk]): ``x'[:, b·bk + L] = x[:, b·bk + k_order(bk)[L]]``."""
    wpl = bk // 32
    logical = torch.arange(bk)
    h, j, s, t = logical & 1, (logical >> 1) & 3, (logical >> 3) & 1, logical >> 4
    v, i = t >> 1, 2 * (t & 1) + s
    return 8 * wpl * j + 8 * v + i + 4 * h


@functools.lru_cache(maxsize=None)
def _k_index(k: int, bk: int, device: torch.device) -> torch.Tensor:
    """x's column for each column of x' over all of K (int64 [k]), cached per device."""
    return (torch.arange(0, k, bk)[:, None] + k_order(bk)[None, :]).reshape(-1).to(device)


def permute_x(x2: torch.Tensor, bk: int = WGMMA_BK) -> torch.Tensor:
    """x' [M, K]: x2's columns in this kernel's K order (contiguous; one gather)."""
    return x2.index_select(1, _k_index(x2.shape[1], bk, x2.device))


@gluon.constexpr_function
def word_layout(num_warps, bk):
    """Registers of the word tile [BN, BK/8]: lane (g, j) = (l / 4, l % 4) of warp w holds words WPL·j .. +WPL-1 of
    rows 16w + g and 16w + g + 8 — the rows of its wgmma A fragment."""
    num_warps, bk = (int(getattr(v, "value", v)) for v in (num_warps, bk))
    wpl = bk // 32
    regs = [[0, 1 << b] for b in range(wpl.bit_length() - 1)] + [[8, 0]]
    lanes = [[0, wpl], [0, 2 * wpl], [1, 0], [2, 0], [4, 0]]
    warps = [[16 << b, 0] for b in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [16 * num_warps, bk // 8])


def _pairs_asm(kind: str, one28: str, one36: str) -> str:
    """PTX of :func:`_pairs` for 16-bit float ``kind`` (bf16x2 / f16x2), with 128 + n at ``one28`` | n and the
    subtrahend ``one36`` (both as 32-bit pairs): per pair a shift, one lop3 ((w & 0x000F000F) | one28), sub, mul."""
    body = [f"lop3.b32 t, {'$8' if p == 0 else 'q'}, 0x000F000F, {one28}, 0xEA; sub.rn.{kind} t, t, c; "
            f"mul.rn.{kind} t, t, s2; mov.b32 {{${2 * p}, ${2 * p + 1}}}, t;" for p in range(4)]
    shifts = ["", "shr.u32 q, $8, 4;", "shr.u32 q, $8, 8;", "shr.u32 q, $8, 12;"]
    return ("{ .reg .b32 t, q, s2, c; mov.b32 s2, {$9, $9}; mov.b32 c, " + one36 + "; "
            + " ".join(sh + " " + b for sh, b in zip(shifts, body)) + " }")


PAIRS_ASM_BF16 = gl.constexpr(_pairs_asm("bf16x2", "0x43004300", "0x43084308"))  # 128 + n, 136
PAIRS_ASM_F16 = gl.constexpr(_pairs_asm("f16x2", "0x64006400", "0x64086408"))    # 1024 + n, 1032
BF16_X8 = gl.constexpr((gl.bfloat16,) * 8)
# _dequant's dims [BN, j, v, h, i%2, i//2] in the A operand's K order (v, i//2, i%2, j, h); tests mirror it
A_PERM = gl.constexpr((0, 2, 5, 4, 1, 3))
F16_X8 = gl.constexpr((gl.float16,) * 8)


@gluon.jit
def _pairs(w, s, DT: gl.constexpr):
    """The 8 dequantized weights of int32 words ``w`` as 8 tensors: (n0, n4), (n1, n5), (n2, n6), (n3, n7) times
    the scale ``s`` (DT: bf16 / fp16, x's dtype), each ``q · s`` rounded once (q = n - 8, exact: the nibble put in
    the mantissa of 128 + n (bf16: 0x4300) or 1024 + n (fp16: 0x6400), then 136 or 1032 subtracted)."""
    ASM: gl.constexpr = PAIRS_ASM_BF16 if DT == gl.bfloat16 else PAIRS_ASM_F16
    DTS: gl.constexpr = BF16_X8 if DT == gl.bfloat16 else F16_X8
    return gl.inline_asm_elementwise(ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, s], dtype=DTS, is_pure=True, pack=1)


@gluon.jit
def _dequant(words, s, a_layout: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, DT: gl.constexpr):
    """The A operand [BN, BK] (x's dtype, ``a_layout``) of words [BN, BK/8] and their scales (same shape): word
    ``WPL·j + v``'s pair i to logical column 16 (2v + i // 2) + 8 (i % 2) + 2j (+1 for the high nibble)."""
    WPL: gl.constexpr = BK // 32
    o0, o1, o2, o3, o4, o5, o6, o7 = _pairs(words, s, DT)
    q0 = gl.join(gl.join(o0, o1), gl.join(o2, o3))     # [BN, BK/8, h, i%2] of pairs 0, 1
    q1 = gl.join(gl.join(o4, o5), gl.join(o6, o7))     # pairs 2, 3
    a = gl.reshape(gl.join(q0, q1), [BN, 4, WPL, 2, 2, 2])  # [BN, j, v, h, i%2, i//2]
    a = gl.reshape(gl.permute(a, A_PERM.value), [BN, BK])  # [BN, (v, i//2, i%2, j, h)]
    return gl.convert_layout(a, a_layout, assert_trivial=True)  # the same registers: no data moves


@gluon.jit
def _w4a16_wgmma_kernel(w_desc, x_desc, s_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_ym,
                        GROUP: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                        SPLIT_K: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = 16 * num_warps
    DT: gl.constexpr = x_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    wl: gl.constexpr = word_layout(num_warps, BK)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    n_kb = K // BK
    per = gl.cdiv(n_kb, SPLIT_K)
    kb0 = pid_k * per
    n_it = gl.minimum(per, n_kb - kb0)  # >= 1: the launcher's split leaves no split empty

    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK // 8], w_desc.layout)
    x_bufs = gl.allocate_shared_memory(DT, [STAGES, BM, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    BYTES: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    for i in gl.static_range(STAGES - 1):  # the ring's first blocks
        here = i < n_it
        mbarrier.expect(ready.index(i), BYTES, pred=here)
        _tma_load(w_desc, [pid_n * BN, (kb0 + i) * (BK // 8)], ready.index(i), w_bufs.index(i), pred=here)
        _tma_load(x_desc, [0, (kb0 + i) * BK], ready.index(i), x_bufs.index(i), pred=here)

    # each thread's scale per word: the group of the word's 8 K (a lane's words lie in one group: one value)
    rows = pid_n * BN + gl.arange(0, BN, gl.SliceLayout(1, wl))
    word_k = gl.arange(0, BK // 8, gl.SliceLayout(0, wl)) * 8  # K offset of each word in the block
    s_rows = s_ptr + rows.to(gl.int64)[:, None] * (K // GROUP)
    s_mask = (rows < N)[:, None] & (word_k >= 0)[None, :]
    sc = gl.load(s_rows + ((kb0 * BK + word_k) // GROUP)[None, :], mask=s_mask, other=0.0)

    acc = gl.zeros([BN, BM], gl.float32, mma)
    for it in range(n_it):
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a = _dequant(w_bufs.index(slot).load(wl), sc, a_layout, BN, BK, DT)
        nxt_kb = kb0 + gl.minimum(it + 1, n_it - 1)
        sc = gl.load(s_rows + ((nxt_kb * BK + word_k) // GROUP)[None, :], mask=s_mask, other=0.0)  # next block's
        acc = warpgroup_mma(a, x_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
        # the previous block's wgmma is done: its slot takes block it + STAGES - 1
        nxt = it + STAGES - 1
        here = nxt < n_it
        refill = nxt % STAGES
        mbarrier.expect(ready.index(refill), BYTES, pred=here)
        _tma_load(w_desc, [pid_n * BN, (kb0 + nxt) * (BK // 8)], ready.index(refill), w_bufs.index(refill),
                  pred=here)
        _tma_load(x_desc, [0, (kb0 + nxt) * BK], ready.index(refill), x_bufs.index(refill), pred=here)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    # y[m, n] = acc[n, m]
    rn = pid_n * BN + gl.arange(0, BN, gl.SliceLayout(1, mma))
    rm = gl.arange(0, BM, gl.SliceLayout(0, mma))
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    y_ptrs = y_ptr + rm.to(gl.int64)[None, :] * stride_ym + rn[:, None]
    if SPLIT_K == 1:
        gl.store(y_ptrs, acc.to(DT), mask=mask)
    else:  # the last of the row tile's SPLIT_K programs sums the partials in split order (deterministic)
        part = part_ptr + (rm.to(gl.int64)[None, :] * N + rn[:, None])
        gl.store(part + pid_k.to(gl.int64) * M * N, acc, mask=mask)
        _cta_barrier()  # every thread's partial is written before the release below
        arrived = gl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = gl.zeros([BN, BM], gl.float32, mma)
            for sk in range(SPLIT_K):
                total += gl.load(part + sk * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(count_ptr + pid_n, 0)
            gl.store(y_ptrs, total.to(DT), mask=mask)


# (warps, STAGES): 8 warps = 128 weight rows per program, each program's activation tile shared by two warp groups
WGMMA_TILE = (8, 6)
# programs per SM the split aims at
WGMMA_PROGRAMS_PER_SM = 2


def wgmma_plan(m: int, n: int, k: int, sms: int, warps: int = WGMMA_TILE[0],
               per_sm: int = WGMMA_PROGRAMS_PER_SM) -> tuple[int, int]:
    """(BM, split) for m tokens: BM the power of two >= m (at least ``WGMMA_MIN_BM``); the split the largest power
    of two that keeps the programs (row tiles × splits) within ``per_sm`` per SM, every split non-empty."""
    bm = max(WGMMA_MIN_BM, 1 << max(0, m - 1).bit_length())
    tiles, n_kb = cdiv(n, 16 * warps), k // WGMMA_BK
    split = 1
    while split * 2 * tiles <= per_sm * sms and split * 2 <= n_kb:
        split *= 2
    per = cdiv(n_kb, split)
    return bm, cdiv(n_kb, per)  # no empty split


def wgmma_launch(x2, weight_packed, weight_scale, y, group_size, counters, sms, tile=None, split=None,
                 permuted=False):
    """Run the kernel for x2 [M, K] into y [M, N] (contiguous rows). ``tile`` (warps, STAGES) and ``split`` override
    ``WGMMA_TILE`` / ``wgmma_plan`` (sweeps). ``permuted``: x2 is already :func:`permute_x`'s output (contiguous),
    e.g. shared by several projections of the same activations."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .._gemm_utils import split_k_workspace

    (m, k), n = x2.shape, weight_packed.shape[0]
    warps, stages = tile or WGMMA_TILE
    bm, planned = wgmma_plan(m, n, k, sms, warps)
    split = split or planned
    per = cdiv(k // WGMMA_BK, split)
    split = cdiv(k // WGMMA_BK, per)  # no empty split
    bn = 16 * warps
    xp = x2 if permuted else permute_x(x2)
    x_gl = gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float16
    w_desc = TensorDescriptor.from_tensor(weight_packed, [bn, WGMMA_BK // 8],
                                          gl.NVMMASharedLayout.get_default_for([bn, WGMMA_BK // 8], gl.int32))
    x_desc = TensorDescriptor.from_tensor(xp, [bm, WGMMA_BK],
                                          gl.NVMMASharedLayout.get_default_for([bm, WGMMA_BK], x_gl))
    tiles = cdiv(n, bn)
    part, count = split_k_workspace(m, n, split, tiles, x2.device, counters)
    _w4a16_wgmma_kernel[(tiles, split)](
        w_desc, x_desc, weight_scale, y, part, count, m, n, k, y.stride(0),
        GROUP=group_size, BM=bm, BK=WGMMA_BK, STAGES=stages, SPLIT_K=split, num_warps=warps)
    return y
