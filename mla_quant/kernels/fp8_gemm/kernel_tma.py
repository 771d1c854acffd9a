"""Hopper variant of the block-scaled FP8 GEMM: the same two-level accumulation as ``kernel.py`` (each
BK-wide block product scaled in fp32 and added), with the operand tiles brought in by TMA.

What differs from the portable kernel, and why (sm_90):

* A and B tiles come through host-built TMA descriptors (``TensorDescriptor``): one thread issues each
  copy, the pipeliner waits on mbarriers instead of a block-wide ``cp.async`` barrier, and no per-thread
  pointer tensors occupy registers (the portable 128×128 tile uses all 255). Out-of-range rows and columns
  read zeros, so ragged M and N need no index clamping.
* With ``BN <= BN_S`` (the real checkpoints: BN_S = 128) a tile meets one weight scale per K block: one
  scalar load, and the combined scale is a [BM] vector — one FFMA per accumulator element and K block.
* ``PERSISTENT``: one program per SM walks the tiles (grouped order) in a flattened loop, so the loads of
  the next tile start during the current tile's last blocks and epilogue.
* ``STAGES`` (= num_stages) is also given to the K loop itself, so the scale loads are pipelined too.

Tried and left out (Triton 3.6, sm_90, ptxas): ``tl.range(warp_specialize=True)`` leaves the persistent loop and
``num_warps=8`` unchanged; on a non-persistent 128 × 128 tile with ``num_warps=4`` it compiles to DeepGEMM's layout
(a TMA producer and two consumer warp groups of 64 rows, each with its own mbarriers), but on the H200 those
launches never finished (session 10: the GPU tests and the sweep hung there), so it was removed. Two K blocks
per step with the second dot left in flight while the first is scale-added is made async by Triton, but ptxas
then serializes every wgmma (C7514: non-wgmma instructions read accumulator registers inside the wgmma
pipeline stage); issuing block k + 1's dot before block k's product is scale-added (in ``tl``: Triton waits
for every dot whose result is used in its own iteration, ``pendings = 0``; as a Gluon kernel with explicit
``warpgroup_mma_wait(1)``: ptxas C7514 again); a BM × 2·BN tile as two BN halves (accumulator 2·BN + one product
per thread) spills at 255 registers.

The launcher builds the descriptors with the configuration's block shapes, so configurations are chosen
by ``default_config`` (per M bucket) or pinned with ``config=`` — there is no autotuner here.
"""
import triton
import triton.language as tl

from .._gemm_utils import grouped_tile


@triton.jit
def _product(a, b_desc, off_n, kb, BK: tl.constexpr, INTERPRET: tl.constexpr):
    """A-tile · B[off_n:+BN, K block kb].T: one tensor-core block product, fp32, unscaled."""
    b = b_desc.load([off_n, kb * BK])
    if INTERPRET:
        b = b.to(tl.float32)
    return tl.dot(a, b.T)


@triton.jit
def _a_tile(a_desc, off_m, kb, BK: tl.constexpr, INTERPRET: tl.constexpr):
    a = a_desc.load([off_m, kb * BK])
    if INTERPRET:
        a = a.to(tl.float32)
    return a


@triton.jit
def _scale(a_s, bs_ptrs, kb, B_SCALAR: tl.constexpr):
    """a_scale · b_scale of K block kb: [BM, 1] when the tile is inside one weight-scale block (``B_SCALAR``:
    ``bs_ptrs`` is a scalar pointer), else [BM, BN]. ``a_s``: the block's [BM] activation scales."""
    b_s = tl.load(bs_ptrs + kb)
    if B_SCALAR:
        s = (a_s * b_s)[:, None]
    else:
        s = a_s[:, None] * b_s[None, :]
    return s


@triton.jit
def _b_scale_ptrs(bs_ptr, off_n, N, n_kb, BN_S: tl.constexpr, BN: tl.constexpr, B_SCALAR: tl.constexpr):
    """Pointers to K block 0 of the weight scales of columns off_n..off_n+BN (clamped to the last row of
    b_scale: columns past N are never stored)."""
    if B_SCALAR:
        ptrs = bs_ptr + (tl.minimum(off_n, N - 1) // BN_S) * n_kb
    else:
        ptrs = bs_ptr + (tl.minimum(off_n + tl.arange(0, BN), N - 1) // BN_S) * n_kb
    return ptrs


@triton.jit
def _tile(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, M, N, n_kb, stride_cm, tile, grid_m, grid_n,
          BN_S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
          STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    """One BM × BN output tile, K blocks in order: the two-level accumulation of kernel.py."""
    pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN
    rm = off_m + tl.arange(0, BM)
    as_ptrs = as_ptr + tl.minimum(rm, M - 1).to(tl.int64) * n_kb  # [BM]; edge rows re-read row M-1
    B_SCALAR: tl.constexpr = BN <= BN_S
    bs = _b_scale_ptrs(bs_ptr, off_n, N, n_kb, BN_S, BN, B_SCALAR)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(0, n_kb, num_stages=STAGES):
        a = _a_tile(a_desc, off_m, kb, BK, INTERPRET)
        acc += _product(a, b_desc, off_n, kb, BK, INTERPRET) * _scale(tl.load(as_ptrs + kb), bs, kb, B_SCALAR)
    rn = off_n + tl.arange(0, BN)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, as_ptr, b_desc, bs_ptr, c_ptr,
    M, N, K, stride_cm, NUM_PROGRAMS,
    BN_S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr,
):
    # a_desc: e4m3 [M, K] in [BM, BK] tiles; as [M, K/BK] fp32; b_desc: e4m3 [N, K] in [BN, BK] tiles;
    # bs [⌈N/BN_S⌉, K/BK] fp32; c [M, N]; K % BK == 0. PERSISTENT: NUM_PROGRAMS programs walk the tiles in
    # one flattened loop.
    n_kb = K // BK
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_PROGRAMS, flatten=True):
            _tile(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, M, N, n_kb, stride_cm, tile, grid_m, grid_n,
                  BN_S, BM, BN, BK, GROUP_M, STAGES, INTERPRET)
    else:
        _tile(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, M, N, n_kb, stride_cm, tl.program_id(0), grid_m, grid_n,
              BN_S, BM, BN, BK, GROUP_M, STAGES, INTERPRET)
