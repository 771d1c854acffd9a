"""Warp-specialized Hopper variant of the block-scaled FP8 GEMM (Gluon): DeepGEMM's layout, written out by hand.

One persistent program per SM walks the output tiles (grouped order). Its warps split into three partitions:

* **producer** (one warp, few registers): TMA copies of the A tile [BM, BK] and the B tile [BN, BK] (BN = 256:
  two boxes of [128, BK]) of each K block into a ring of ``STAGES`` shared-memory slots. ``ready[s]`` completes
  when slot s holds its bytes; the producer waits on ``empty[s]`` before refilling s. It runs ahead across tile
  boundaries.
* **two consumer warp groups** (four warps each; rows [0, BM/2) and [BM/2, BM) of the tile): per K block one
  async wgmma of their A half against the B tile into a fresh fp32 product, wait, arrive on ``empty[s]``
  (each group arrives once: ``empty`` counts two), then *promote*: ``acc += product · a_scale[row] ·
  b_scale``. The other group's wgmma runs on the tensor cores meanwhile, so the promotion's FFMAs (which
  make ptxas serialize the wgmma chain of a single group, kernel_tma.py) overlap the other group's MMA.
  With BN = 256 (``_consumer_wide``) a K block is two half-steps of 128 columns, each with its own weight scale.
  With ``AHEAD`` (the default) each group takes its K blocks in pairs (``_k_blocks``): both wgmmas issued, then
  ``wait(1)`` and the first block's promotion while the second's wgmma runs, then ``wait(0)`` and the second's, so
  a group's own promotion no longer leaves the tensor cores to the other group alone. A group then holds two slots
  at once: ``ws_config`` refuses smaller rings, which would deadlock. With ``PAIR_SLOTS`` (the default since
  session 24) one ring slot holds the pair (``_k_blocks``): one ``ready`` wait and one ``empty`` release per pair
  instead of two each (each comes with a 128-thread ``bar.sync`` from Gluon), ``STAGES`` counting pair slots.

Registers: Triton gives the 12-warp kernel ``.maxnreg 168``, but ptxas allocates each partition's code within
its ``setmaxnreg`` budget (232 for the consumers): the 128 × 256 form holds two accumulators [64, 128] and one
product (64 + 128 fp32 per thread) with no spills. Written as two wgmmas in one loop iteration it spilled
(736 B): ptxas issued the second half's wgmma before the first half's product was promoted, so two products were
live; as two iterations of one loop, one per half, with a branch on the half, it cannot.

Phases: slot s is used for the k-th time (k = 0, 1, ...) at ring position ``it = k·STAGES + s`` (``it``
counts units — K blocks, or pairs with PAIR_SLOTS — over all of a program's tiles; ``_ring_slot``); ``ready`` flips
to parity ``k & 1`` when filled, ``empty`` to ``k & 1`` when both groups have released it. A fresh barrier counts as
having completed parity 1, so the producer's first pass (waiting for parity ``(k & 1) ^ 1`` = 1) does not block.
The same reading makes a wait on use k pass early while use k - 1 has not completed, so every consumer waits for each
use of its slots in order: both groups wait on every unit, and under ``KSPLIT`` (the groups on alternate units) each
group has its own half of the ring (session 24; in one shared ring of odd size a group waited on a slot whose
previous use, the other group's, could still be in flight).

a: e4m3 [M, K] in [BM, BK] TMA tiles; a_scale fp32 [M, K/BK]; b: e4m3 [N, K] in [BN, BK] tiles; b_scale fp32
[⌈N/BN_S⌉, K/BK] with BN <= BN_S, or BN = 256 and 128 | BN_S (one weight scale per 128 columns or fewer and K
block); c [M, N] (row stride ``stride_cm``);
K % BK == 0. Rows and columns past M and N read zeros (TMA) and are not stored. The Triton interpreter does not run
Gluon: the GPU tests (tests/kernels/test_fp8_gemm.py, "ws") check it against the reference, with Triton 3.6 (the
H200's); ``benchmarks.compile_check fp8_gemm`` compiles it for sm_90 with 3.6 and 3.9.

Measured (H200, results/sweep_fp8_gemm_ws_h200.json): loading each K block's scales one block ahead and storing
the output through shared memory by TMA (``TMA_STORE``; each group's store drains while its next tile's MMAs
run) took the kernel's best setting per shape from 0.94-1.31x the bf16 cuBLAS speed to 1.15-1.41x (0.77-0.94x
``torch._scaled_mm``); 128 x 64 tiles were 1.2-1.5x slower. 128 × 256 tiles (session 21): 0.94-1.03x the time
of 128 × 128 (median 0.965) where they add no wave (``ws_default_config``'s rule), 1.07-1.8x where they do.
Nsight Compute (session 21, 8192 × 2048 × 7168, clocks locked at 1.3 GHz): the tensor pipe busy 63 % of the
cycles with either tile, the L2 64 % (128 × 128) and 42 % (128 × 256) of its peak — so the L2 does not bound it.
Half of the sampled warp stalls are at CTA barriers: the idle warps of the producer's padded group, and the
``bar.sync`` of 128 threads that Gluon emits before each ``mbarrier.wait`` and each single-thread
``mbarrier.arrive`` (two per K block and group; DeepGEMM has each consumer warp arrive on its own, without a
barrier — Gluon 3.6 has no per-warp arrive).
``KSPLIT`` (``_consumer_ksplit``, for shapes whose 128-row tiles leave SMs idle): [64, BN] tiles, both groups on
every tile, group g on the K blocks kb ≡ g (mod 2), group 1's fp32 sum handed to group 0 through shared memory at
the tile's end: twice the programs of the same per-SM structure (two wgmma chains overlapping the other's
promotion), one product per group, no partials in global memory. H200 (session 23, same file): 512 × 2048 × 7168
19.5-19.6 µs with 7 stages against 25.0 for the tma kernel and 29.0 for 128 × 128 tiles (64 tiles); where 128-row
tiles already fill the SMs it took 1.1-1.5x the time (the A tile is read once per 64 rows instead of 128).
``AHEAD`` (session 23): with one product in flight per group the tensor pipe was busy 63 % of the cycles (ncu,
session 21): each group's turnaround (wait, release, 64 FFMAs of promotion, the next slot's wait) outlasted the
other group's wgmma. Issuing the pair's second wgmma before the first promotion took the best setting at 11 of 12
prefill shapes, 0.88-0.98x the time of the previous default (results/sweep_fp8_gemm_ws_h200.json, fdc5f24), without
spills (accumulator and two products: 192 of the consumers' 232 registers). Written with the next block's wgmma
carried across the loop iteration instead, ptxas copied the in-flight product at the loop's phi and serialized
every wgmma (C7514: ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` after each); the pair form keeps ``0x1``.
Session 24 (results/sweep_fp8_gemm_ws_h200.json, interleaved rounds): PAIR_SLOTS with 3 slots took 0.97-1.04x
(median 0.985; 0.975 in a second call) the time of AHEAD with 4 stages at the 11 shapes of 128-row tiles; KSPLIT
with 4 pair slots 19.2-19.5 µs at 512 × 2048 × 7168 against 20.5-21.4 with 6 single slots on the split ring. Timed
in rounds, a setting reads up to 8 % faster right after a slow one (the clocks recover under less FP8 load), so
compare settings after their own kind.
Tried and left out:

* (session 24) ``STAGGER``: group 1 started one or two pairs behind group 0, so that each group's epilogue would
  run beside the other's wgmmas; right after the same kernel without it, 0.99-1.02x its time at the 12 shapes;
* two wgmmas in flight per warp group (block kb + 1 issued before block kb is promoted): the kernel has 12 warps
  (the producer's warp group is padded to four), so ptxas caps every thread at 168 registers — the accumulator
  and two products (192) spill, and ptxas serializes the wgmmas (C7514), also with the K loop unrolled by two;
* (session 17) 128 x 256 tiles with one [64, 256] product per group and the producer's work folded into the
  first consumer group, so that 8 warps get 255 registers: correct, but 720 B of spills in the K loop and 2-4x
  the time of this kernel at all 9 sweep shapes (the half-step form above replaced it);
* split-K (a tile's K splits side by side, fp32 partials summed in split order by the last arriving group, for
  shapes whose tiles leave SMs idle): correct, but at 512 x 2048 x 7168 (64 tiles) 2 splits took 26.6 µs against
  25.0 for kernel_tma.py's smaller tiles, and 2-4 splits were 1.4-4x slower elsewhere (the partials' round trip).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from .._gemm_utils import grouped_tile  # a @triton.jit helper: Gluon kernels may call it

# registers per thread after setmaxnreg: the TMA warp's (padded) warp group, each consumer warp group
PRODUCER_REGS = gl.constexpr(40)
CONSUMER_REGS = gl.constexpr(232)

# Gluon renamed the TMA copies after Triton 3.6 (async_copy_global_to_shared -> async_load, async_copy_shared_to_global
# -> async_store; the old names raise in 3.9): the same builtins under either name
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _ring_slot(pos, base, RING: gl.constexpr):
    """Shared-memory slot and wait parity of ring position ``pos`` in a ring of ``RING`` slots from slot ``base``:
    the slot's use k = pos // RING completes parity k & 1."""
    return base + pos % RING, (pos // RING) & 1


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, SLOT_KB: gl.constexpr, KSPLIT: gl.constexpr):
    SN: gl.constexpr = b_desc.block_type.shape[0]  # B box rows: BN, or 128 when BN = 256 (two boxes per K block)
    NB: gl.constexpr = BN // SN
    BLOCK_BYTES: gl.constexpr = a_desc.block_type.nbytes + NB * b_desc.block_type.nbytes
    RING: gl.constexpr = STAGES // 2 if KSPLIT else STAGES  # KSPLIT: each group's own half of the slots
    n_kb = K // BK
    n_units = gl.cdiv(n_kb, SLOT_KB)  # a tile's ring units (PAIR_SLOTS: the last holds one block if n_kb is odd)
    grid_m = gl.cdiv(M, BM)
    grid_n = gl.cdiv(N, BN)
    it0 = 0  # ring positions filled so far (KSPLIT: for group 0; it1 for group 1)
    it1 = 0
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        for j in range(n_units):
            g = j % 2 if KSPLIT else 0  # the consumer group of unit j
            pos = it0 + (it1 - it0) * g
            s, phase = _ring_slot(pos, g * RING, RING)
            mbarrier.wait(empty.index(s), phase ^ 1)
            kb = j * SLOT_KB
            if SLOT_KB == 1:
                mbarrier.expect(ready.index(s), BLOCK_BYTES)
            else:  # (one arrive.expect_tx per slot: a byte count known at compile time, picked by predicate)
                mbarrier.expect(ready.index(s), 2 * BLOCK_BYTES, pred=kb + 1 < n_kb)
                mbarrier.expect(ready.index(s), BLOCK_BYTES, pred=kb + 1 >= n_kb)
            for q in gl.static_range(SLOT_KB):
                here = kb + q < n_kb  # (PAIR_SLOTS: a tile's odd last block leaves the slot's second half empty)
                _tma_load(a_desc, [pid_m * BM, (kb + q) * BK], ready.index(s), a_bufs.index(s * SLOT_KB + q),
                          pred=here)
                for h in gl.static_range(NB):
                    _tma_load(b_desc, [pid_n * BN + h * SN, (kb + q) * BK], ready.index(s),
                              b_bufs.index((s * SLOT_KB + q) * NB + h), pred=here)
            it0 += 1 - g
            it1 += g


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c_smem, M, N, K, stride_cm,
              HALF: gl.constexpr, BN_S: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr, AHEAD: gl.constexpr,
              PAIR_SLOTS: gl.constexpr):
    """Rows [HALF·BM/2, (HALF+1)·BM/2) of every tile of this program (one warp group)."""
    HM: gl.constexpr = BM // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    n_kb = K // BK
    n_units = gl.cdiv(n_kb, 2) if PAIR_SLOTS else n_kb
    grid_m = gl.cdiv(M, BM)
    grid_n = gl.cdiv(N, BN)
    zero = gl.zeros([HM, BN], gl.float32, mma)
    it = 0  # ring position of the tile's first unit
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        rm = pid_m * BM + HALF * HM + gl.arange(0, HM, rows_l)
        a_s_ptrs = as_ptr + gl.minimum(rm, M - 1).to(gl.int64) * n_kb  # edge rows re-read row M-1
        b_s_ptr = bs_ptr + ((pid_n * BN) // BN_S) * n_kb
        acc = _k_blocks(a_bufs, b_bufs, ready, empty, it, 0, STAGES, 0, 1, n_units, a_s_ptrs, b_s_ptr, n_kb,
                        HALF * HM, HM, zero, AHEAD, PAIR_SLOTS)
        it += n_units
        _store_block(acc, c_ptr, c_desc, c_smem, rm, pid_m * BM + HALF * HM, pid_n * BN, M, N, stride_cm, mma, BN,
                     TMA_STORE)
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _issue_block(a_bufs, b_bufs, ready, pos, base, RING: gl.constexpr, Q: gl.constexpr, SLOT_KB: gl.constexpr,
                 ROW0: gl.constexpr, HM: gl.constexpr, zero):
    """Wait until ring position ``pos`` (``_ring_slot``) holds its K block(s), then issue this group's async wgmma
    on A rows [ROW0, ROW0 + HM) of the slot's block ``Q`` (a fresh product)."""
    s, phase = _ring_slot(pos, base, RING)
    if Q == 0:
        mbarrier.wait(ready.index(s), phase)
    return warpgroup_mma(a_bufs.index(s * SLOT_KB + Q).slice(ROW0, HM, dim=0),
                         b_bufs.index(s * SLOT_KB + Q).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _release(empty, pos, base, RING: gl.constexpr):
    """This group is done reading ring position ``pos``'s slot."""
    s, _ = _ring_slot(pos, base, RING)
    mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _pair_scales(a_s_ptrs, b_s_ptr, kb0, kb1, last):
    """The scales of K blocks kb0 and kb1 (clamped to ``last``): a_scale rows and the b_scale of each."""
    return (gl.load(a_s_ptrs + gl.minimum(kb0, last)), gl.load(b_s_ptr + gl.minimum(kb0, last)),
            gl.load(a_s_ptrs + gl.minimum(kb1, last)), gl.load(b_s_ptr + gl.minimum(kb1, last)))


@gluon.jit
def _k_blocks(a_bufs, b_bufs, ready, empty, pos, base, RING: gl.constexpr, first, step, count, a_s_ptrs, b_s_ptr,
              n_kb, ROW0: gl.constexpr, HM: gl.constexpr, zero, AHEAD: gl.constexpr, PAIR_SLOTS: gl.constexpr):
    """One group's sum over ``count`` units u = first, first + step, ... of a tile: K block kb = u (a pair of K
    blocks 2u and 2u + 1 with ``PAIR_SLOTS``), taken at ring positions pos, pos + 1, ... (``_ring_slot`` in the
    ``RING`` slots from ``base``). Per block an async wgmma into a fresh product, then the promotion ``acc +=
    product · a_scale[row, kb] · b_scale[kb]`` (the scales loaded ahead: an L2 round trip outlasts one block's MMA),
    and the block's slot released. ``AHEAD``: the blocks in pairs — both wgmmas issued, ``wait(1)`` and the first
    block's promotion while the second's wgmma runs, then ``wait(0)`` and the second's. No wgmma stays in flight
    across a loop iteration: a loop-carried in-flight product is copied at the loop's phi, and ptxas then serializes
    every wgmma (C7514).

    ``PAIR_SLOTS`` (with AHEAD): a ring slot holds the pair (shared-memory buffers 2s and 2s + 1 of slot s) behind
    one ``ready`` and one ``empty`` barrier, so a pair costs one wait and one release instead of two each; the slot
    is released after ``wait(0)``. With n_kb odd a tile's last slot holds one block, which the group whose last unit
    it is takes after the loop."""
    acc = zero
    last = n_kb - 1
    if AHEAD:
        SLOT_KB: gl.constexpr = 2 if PAIR_SLOTS else 1
        if PAIR_SLOTS:  # the pair is blocks 2u, 2u + 1 of one ring position
            kb = 2 * first
            dk = 1
            tail = (n_kb % 2 == 1) & (count > 0) & (((n_kb + 1) // 2 - 1 - first) % step == 0)
            pairs = count - tail.to(gl.int32)
        else:  # the pair is units u, u + step at two ring positions
            kb = first
            dk = step
            tail = count % 2 == 1
            pairs = count // 2
        a0, b0, a1, b1 = _pair_scales(a_s_ptrs, b_s_ptr, kb, kb + dk, last)
        for _ in range(pairs):
            s0 = a0 * b0
            s1 = a1 * b1
            kb += 2 * step
            a0, b0, a1, b1 = _pair_scales(a_s_ptrs, b_s_ptr, kb, kb + dk, last)  # the next pair's
            p0 = _issue_block(a_bufs, b_bufs, ready, pos, base, RING, 0, SLOT_KB, ROW0, HM, zero)
            # the second block: the slot's other half (PAIR_SLOTS, no second wait), else the next ring position
            p1 = _issue_block(a_bufs, b_bufs, ready, pos + 2 - SLOT_KB, base, RING, SLOT_KB - 1, SLOT_KB, ROW0, HM,
                              zero)
            d0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
            if not PAIR_SLOTS:
                _release(empty, pos, base, RING)
            acc += d0 * s0[:, None]
            d1 = warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
            _release(empty, pos + 2 - SLOT_KB, base, RING)
            acc += d1 * s1[:, None]
            pos += 3 - SLOT_KB
        if tail:  # the last block alone
            p0 = _issue_block(a_bufs, b_bufs, ready, pos, base, RING, 0, SLOT_KB, ROW0, HM, zero)
            d0 = warpgroup_mma_wait(num_outstanding=0, deps=(p0,))
            _release(empty, pos, base, RING)
            acc += d0 * (a0 * b0)[:, None]
    else:
        a_s_next = gl.load(a_s_ptrs + gl.minimum(first, last))
        b_s_next = gl.load(b_s_ptr + gl.minimum(first, last))
        for j in range(count):
            kb = first + j * step
            scale = a_s_next * b_s_next
            a_s_next = gl.load(a_s_ptrs + gl.minimum(kb + step, last))
            b_s_next = gl.load(b_s_ptr + gl.minimum(kb + step, last))
            prod = _issue_block(a_bufs, b_bufs, ready, pos + j, base, RING, 0, 1, ROW0, HM, zero)
            d = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
            _release(empty, pos + j, base, RING)
            acc += d * scale[:, None]
    return acc


@gluon.jit
def _consumer_wide(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c_smem, M, N, K, stride_cm,
                   HALF: gl.constexpr, BN_S: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                   GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr):
    """``_consumer`` for BN = 256: each K block runs as two half-steps of 128 columns (one wgmma, one weight
    scale each), so one product [BM/2, 128] is live beside the two accumulators (64 + 128 registers). The
    half-steps are iterations of one loop with a branch per half: written as two wgmmas in one iteration,
    ptxas issues the second before the first is promoted, two products are live and the group spills."""
    HM: gl.constexpr = BM // 2
    SN: gl.constexpr = BN // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SN, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    n_kb = K // BK
    grid_m = gl.cdiv(M, BM)
    grid_n = gl.cdiv(N, BN)
    last_bs = gl.cdiv(N, BN_S) - 1
    zero = gl.zeros([HM, SN], gl.float32, mma)
    it = 0
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        rm = pid_m * BM + HALF * HM + gl.arange(0, HM, rows_l)
        a_s_ptrs = as_ptr + gl.minimum(rm, M - 1).to(gl.int64) * n_kb  # edge rows re-read row M-1
        b_s_ptr0 = bs_ptr + ((pid_n * BN) // BN_S) * n_kb
        b_s_ptr1 = bs_ptr + gl.minimum((pid_n * BN + SN) // BN_S, last_bs) * n_kb  # may lie past N: clamped
        # each half-step's scales are loaded during the half-step before it
        a_s_next = gl.load(a_s_ptrs)
        b_s_next = gl.load(b_s_ptr0)
        acc0 = zero
        acc1 = zero
        for j in range(2 * n_kb):
            h = j % 2
            scale = a_s_next * b_s_next
            jn = gl.minimum(j + 1, 2 * n_kb - 1)
            a_s_next = gl.load(a_s_ptrs + jn // 2)
            b_s_next = gl.load(gl.where(jn % 2 == 0, b_s_ptr0, b_s_ptr1) + jn // 2)
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(s).slice(HALF * HM, HM, dim=0)
            b = b_bufs.index(s * 2 + h).permute((1, 0))  # [BK, SN], K-major as fp8 wgmma needs
            prod = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
            prod, a, b = warpgroup_mma_wait(num_outstanding=0, deps=(prod, a, b))
            if h == 0:
                acc0 += prod * scale[:, None]
            else:
                mbarrier.arrive(empty.index(s), count=1)
                acc1 += prod * scale[:, None]
                it += 1
        _store_block(acc0, c_ptr, c_desc, c_smem, rm, pid_m * BM + HALF * HM, pid_n * BN, M, N, stride_cm, mma,
                     SN, TMA_STORE)
        _store_block(acc1, c_ptr, c_desc, c_smem, rm, pid_m * BM + HALF * HM, pid_n * BN + SN, M, N, stride_cm,
                     mma, SN, TMA_STORE)
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _consumer_ksplit(a_bufs, b_bufs, ready, empty, red_smem, red_full, red_empty, as_ptr, bs_ptr, c_ptr, c_desc,
                     c_smem, M, N, K, stride_cm, HALF: gl.constexpr, BN_S: gl.constexpr, BM: gl.constexpr,
                     BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                     TMA_STORE: gl.constexpr, AHEAD: gl.constexpr, PAIR_SLOTS: gl.constexpr):
    """``KSPLIT``: both warp groups on the same [BM = 64, BN] tile, group HALF on the tile's units u ≡ HALF (mod 2)
    (K blocks; pairs of them with ``PAIR_SLOTS``). Each group has its own ring, half of the ``STAGES`` slots (the
    producer fills unit u of a tile into group u % 2's ring), so a group waits for every use of its slots in order:
    in one shared ring a group would wait for a slot's use k while use k - 1, the other group's, might still be in
    flight, and a barrier that has not completed use k - 1 reads as having completed the parity of use k. At the
    tile's end group 1 hands its fp32 sum to group 0 through ``red_smem`` (``red_full`` / ``red_empty``, one
    completion per tile), and group 0 adds it and stores the tile."""
    RING: gl.constexpr = STAGES // 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    n_kb = K // BK
    n_units = gl.cdiv(n_kb, 2) if PAIR_SLOTS else n_kb
    mine = (n_units - HALF + 1) // 2  # this group's units per tile
    grid_m = gl.cdiv(M, BM)
    grid_n = gl.cdiv(N, BN)
    zero = gl.zeros([BM, BN], gl.float32, mma)
    it = 0  # position in this group's ring of the tile's first unit
    t = 0  # tiles done by this program
    for tile in range(gl.program_id(0), grid_m * grid_n, gl.num_programs(0)):
        pid_m, pid_n = grouped_tile(tile, grid_m, grid_n, GROUP_M)
        rm = pid_m * BM + gl.arange(0, BM, rows_l)
        a_s_ptrs = as_ptr + gl.minimum(rm, M - 1).to(gl.int64) * n_kb  # edge rows re-read row M-1
        b_s_ptr = bs_ptr + ((pid_n * BN) // BN_S) * n_kb
        acc = _k_blocks(a_bufs, b_bufs, ready, empty, it, HALF * RING, RING, HALF, 2, mine, a_s_ptrs, b_s_ptr, n_kb,
                        0, BM, zero, AHEAD, PAIR_SLOTS)
        if HALF == 1:
            mbarrier.wait(red_empty.index(0), (t & 1) ^ 1)  # group 0 has read the previous tile's sum
            red_smem.store(acc)
            mbarrier.arrive(red_full.index(0), count=1)
        else:
            mbarrier.wait(red_full.index(0), t & 1)
            acc += red_smem.load(mma)
            mbarrier.arrive(red_empty.index(0), count=1)
            _store_block(acc, c_ptr, c_desc, c_smem, rm, pid_m * BM, pid_n * BN, M, N, stride_cm, mma, BN, TMA_STORE)
        it += mine
        t += 1
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _store_block(acc, c_ptr, c_desc, c_smem, rm, row0, col0, M, N, stride_cm, mma: gl.constexpr, SN: gl.constexpr,
                 TMA_STORE: gl.constexpr):
    """One consumer group's [BM/2, SN] output block at (row0, col0); rows ``rm``."""
    if TMA_STORE:
        # the previous block's store has read c_smem; this one drains while the next MMAs run
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [row0, col0], c_smem)
    else:
        rn = col0 + gl.arange(0, SN, gl.SliceLayout(0, mma))
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        gl.store(c_ptr + rm[:, None].to(gl.int64) * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=mask)


@gluon.jit
def _fp8_gemm_ws_kernel(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, c_desc, M, N, K, stride_cm,
                        BN_S: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                        GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
                        KSPLIT: gl.constexpr = False, AHEAD: gl.constexpr = False,
                        PAIR_SLOTS: gl.constexpr = False):
    SN: gl.constexpr = b_desc.block_type.shape[0]
    SLOT_KB: gl.constexpr = 2 if PAIR_SLOTS else 1  # K blocks per ring slot
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * SLOT_KB, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES * SLOT_KB * (BN // SN), SN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1 if KSPLIT else 2)  # one arrival per consumer warp group using it
    if TMA_STORE and KSPLIT:  # (group 0 stores every tile)
        c_smem0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        c_smem1 = c_smem0
    elif TMA_STORE:  # one output staging buffer per consumer warp group
        c_smem0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        c_smem1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    else:
        c_smem0 = a_bufs
        c_smem1 = a_bufs
    # (a constexpr choice of the consumer function is not expressible: one warp_specialize per form)
    if KSPLIT:  # [64, BN] tiles, the groups on alternate K blocks; group 1's sum handed over through shared memory
        red_smem = gl.allocate_shared_memory(gl.float32, [BM, BN], gl.SwizzledSharedLayout(2, 1, 8, [1, 0]))
        red_full = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        red_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(red_full.index(0), count=1)
        mbarrier.init(red_empty.index(0), count=1)
        gl.warp_specialize([
            (_consumer_ksplit, (a_bufs, b_bufs, ready, empty, red_smem, red_full, red_empty, as_ptr, bs_ptr, c_ptr,
                                c_desc, c_smem0, M, N, K, stride_cm, 0, BN_S, BM, BN, BK, GROUP_M, STAGES, TMA_STORE,
                                AHEAD, PAIR_SLOTS)),
            (_consumer_ksplit, (a_bufs, b_bufs, ready, empty, red_smem, red_full, red_empty, as_ptr, bs_ptr, c_ptr,
                                c_desc, c_smem0, M, N, K, stride_cm, 1, BN_S, BM, BN, BK, GROUP_M, STAGES, TMA_STORE,
                                AHEAD, PAIR_SLOTS)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BM, BN, BK, GROUP_M, STAGES, SLOT_KB,
                         KSPLIT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
        mbarrier.invalidate(red_full.index(0))
        mbarrier.invalidate(red_empty.index(0))
    elif BN > SN:
        gl.warp_specialize([
            (_consumer_wide, (a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c_smem0, M, N, K,
                              stride_cm, 0, BN_S, BM, BN, BK, GROUP_M, STAGES, TMA_STORE)),
            (_consumer_wide, (a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c_smem1, M, N, K,
                              stride_cm, 1, BN_S, BM, BN, BK, GROUP_M, STAGES, TMA_STORE)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BM, BN, BK, GROUP_M, STAGES, SLOT_KB,
                         KSPLIT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c_smem0, M, N, K, stride_cm,
                         0, BN_S, BM, BN, BK, GROUP_M, STAGES, TMA_STORE, AHEAD, PAIR_SLOTS)),
            (_consumer, (a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, c_ptr, c_desc, c_smem1, M, N, K, stride_cm,
                         1, BN_S, BM, BN, BK, GROUP_M, STAGES, TMA_STORE, AHEAD, PAIR_SLOTS)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, BM, BN, BK, GROUP_M, STAGES, SLOT_KB,
                         KSPLIT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
