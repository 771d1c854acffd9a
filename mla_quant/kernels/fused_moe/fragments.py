"""The INT4 experts of decode tokens on MMA fragments built in registers (``fused_moe(..., gemv="fragments")``).

The K loop is the dense fragment kernel's (``w4a16_gemm/fragments.py``, ``frag_accumulate``; docs/moe.md "W4A16 at
2-16 tokens: MMA fragments in registers"): ``mma.sync`` m16n8k16 with an expert's INT4 rows as the A operand, built
and scaled in the registers of the lanes that own them, and the assignment's activation row as the B operand (all 8
token columns of the MMA read that one row, so every accumulator column holds the same sums; lane (r, 0) stores
rows r and r + 8). No shared memory for the operands, ~22 SASS instructions per weight word and thread against the
plane GEMV's ~30.

Two launches per call, program (row tile, K split, assignment m), assignment m = (token m // k, slot m % k) with
expert ``topk_ids.flat[m]`` (ids outside [0, E) are dropped as ``moe_align`` drops them):

* gate-up (``GATED``): each warp holds a 16-row tile of the gate and the same rows of the up projection; the K
  splits' partials meet in a workspace and the last split to arrive (``reduce_arrivals``: split order,
  deterministic) writes ``h[m] = silu(gate) * up`` rounded to x's dtype. Dropped assignments write nothing.
* down: each program's rows times the routing weight are the partial of arrival (slot, split) of its token's tile;
  the last of the token's k · splits arrivals sums them in (slot, split) order, adds ``shared_out`` and rounds once
  into the result — the decode path's combine (``kernel._combine_on_arrival``) on fragment lanes. A dropped
  assignment arrives with zeros.

The arrival counters (one per assignment and gate-up tile, one per token and down tile) are zeroed once per call
and left zero by every launch.

Opt-in: on the H200 at one Kimi token (384 experts, top-8) it took 80.7-81.3 µs against 74.8-75.0 for the plane
GEMV, equal at 4 tokens (session 15; docs/moe.md "The MoE experts on MMA fragments").
"""
import triton
import triton.language as tl

from .._gemm_utils import reduce_arrivals
from .._triton_utils import grid_dependency_sync
from ..w4a16_gemm.fragments import _stacked, frag_accumulate


@triton.jit
def _expert_rows(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, row0, N, stride_we, stride_wn, stride_se, stride_sn,
                 GATED: tl.constexpr):
    """Each lane's pointers to the first word / group scale of its rows r and r + 8 (``row0``, ``row0 + 8``) of expert
    ``e``: the gate's (or the down projection's), then with GATED the up projection's (``frag_accumulate``'s
    ``w_rows`` / ``s_rows``). Rows past N re-read row N - 1 (never stored)."""
    w_rows = ()
    s_rows = ()
    for half in tl.static_range(2):
        row = (tl.minimum(row0 + 8 * half, N - 1)).to(tl.int64)
        w_rows = w_rows + (w1_ptr + e * stride_we + row * stride_wn,)
        s_rows = s_rows + (s1_ptr + e * stride_se + row * stride_sn,)
    if GATED:
        for half in tl.static_range(2):
            row = (tl.minimum(row0 + 8 * half, N - 1)).to(tl.int64)
            w_rows = w_rows + (w3_ptr + e * stride_we + row * stride_wn,)
            s_rows = s_rows + (s3_ptr + e * stride_se + row * stride_sn,)
    return w_rows, s_rows


@triton.jit
def _moe_frag_kernel(
    x_ptr, ids_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, out_ptr, part_ptr, count_ptr, topk_w_ptr, shared_ptr,
    N, K, E, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_out, stride_st, stride_part,
    GATED: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    X_VEC: tl.constexpr, INTERPRET: tl.constexpr, W: tl.constexpr, TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr = False, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """GATED: x [T, K] (token rows), w1 / w3 the gate / up words [E, N, K/8] (scales [E, N, K/GROUP] in x's dtype),
    out = h [A, N] in x's dtype; part fp32 [SPLIT_K, A, 2, N]; counters [A, row tiles].
    Not GATED: x = h [A, K], w1 the down words [E, N, K/8], out = the result [T, N] (x's dtype), shared_ptr
    [T, N] added when HAS_SHARED; part fp32 [TOP_K · SPLIT_K, T, N]; counters [T, row tiles]."""
    grid_dependency_sync(PDL)
    T_: tl.constexpr = 32 * W
    DT: tl.constexpr = x_ptr.dtype.element_ty
    BN: tl.constexpr = 16 * W
    tl.static_assert(BK % 128 == 0, "the fragment kernel takes K blocks of 128")
    pid_n, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles = tl.num_programs(0)
    t = m // TOP_K
    lane = tl.arange(0, T_) % 32
    r = lane // 4
    row0 = pid_n * BN + (tl.arange(0, T_) // 32) * 16 + r       # row r of the warp's tile
    top, bot = row0, row0 + 8
    store_ok = lane % 4 == 0                                      # lane (r, 0): rows r and r + 8 of token column 0
    e = tl.load(ids_ptr + m).to(tl.int64)
    dropped = (e < 0) | (e >= E)
    if GATED:
        if dropped:
            return
    e = tl.where(dropped, 0, e)   # a dropped down slot reads expert 0 (valid addresses) and arrives with zeros

    w_rows, s_rows = _expert_rows(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, row0, N, stride_we, stride_wn, stride_se,
                                  stride_sn, GATED)
    x_row = x_ptr + (t if GATED else m).to(tl.int64) * stride_x
    k_iters = tl.cdiv(K, BK)
    per_split = tl.cdiv(k_iters, SPLIT_K)
    it_lo = pid_k * per_split
    it_hi = tl.minimum(it_lo + per_split, k_iters)
    TILES: tl.constexpr = 2 if GATED else 1
    accs = frag_accumulate((x_row,), w_rows, s_rows, it_lo, it_hi, K, GROUP, 1, TILES, BK, EVEN_K, X_VEC, INTERPRET,
                           DT, W, PREFETCH)

    if GATED:  # (gate r, gate r + 8, up r, up r + 8), summed over the splits, then silu(gate) · up
        vals = _stacked((accs[0], accs[2], accs[4], accs[6]), 4)
        rows = _stacked((top, bot, top, bot), 4)
        offs = _stacked((m * 2 * N + top, m * 2 * N + bot, (m * 2 + 1) * N + top, (m * 2 + 1) * N + bot), 4)
        ok = _stacked((store_ok, store_ok, store_ok, store_ok), 4) & (rows < N)
        if SPLIT_K == 1:
            total = vals
            last = True
        else:
            last, total = reduce_arrivals(vals, part_ptr + offs, stride_part, pid_k, ok,
                                          count_ptr + m * tiles + pid_n, SPLIT_K)
        if last:
            gate, up = tl.split(total)                          # [T, 2]: rows (r, r + 8)
            rows2, _ = tl.split(rows)
            ok2, _ = tl.split(ok)
            h = gate * tl.sigmoid(gate) * up
            tl.store(out_ptr + m.to(tl.int64) * stride_out + rows2, h.to(DT), mask=ok2)
    else:  # this slot's rows times its routing weight: arrival (slot, split) of the token's tile
        weight = tl.load(topk_w_ptr + m).to(tl.float32)
        vals = tl.where(dropped, 0.0, _stacked((accs[0] * weight, accs[2] * weight), 2))   # h[m] unwritten if dropped
        rows = _stacked((top, bot), 2)
        ok = _stacked((store_ok, store_ok), 2) & (rows < N)
        last, total = reduce_arrivals(vals, part_ptr + t.to(tl.int64) * N + rows, stride_part,
                                      (m % TOP_K) * SPLIT_K + pid_k, ok, count_ptr + t * tiles + pid_n,
                                      TOP_K * SPLIT_K)
        if last:
            if HAS_SHARED:
                total += tl.load(shared_ptr + t.to(tl.int64) * stride_st + rows, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + t.to(tl.int64) * stride_out + rows, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_frag_block_kernel(
    x_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, out_ptr, topk_w_ptr,
    A, N, K, a_div, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    GATED: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr, NT: tl.constexpr, EVEN_K: tl.constexpr,
    X_VEC: tl.constexpr, INTERPRET: tl.constexpr, W: tl.constexpr, PREFETCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """The aligned blocks of ``moe_align`` (``fused_moe(..., int4_tile="fragments")``): program (b, n) takes block b
    — up to BM = 8 · NT assignments of one expert, padding slots (sorted id A) masked — and rows n · 16W.. of the
    expert's weights; the block's assignments are the MMA's token columns, so each weight is unpacked once for all of
    them. x [*, K] in DT, row of assignment s: s // a_div (tokens for the gate-up, assignments for the down); w1 / w3
    [E, N, K/8] words, scales [E, N, K/GROUP] in DT.
    GATED: out = h [A, N] (DT), h = silu(gate) · up of tiles 0 (gate) and 1 (up) of the same rows. Not GATED:
    out = y [A, N] fp32, each row times its routing weight (summed per token by the combine launch)."""
    grid_dependency_sync(PDL)
    T_: tl.constexpr = 32 * W
    DT: tl.constexpr = x_ptr.dtype.element_ty
    BN: tl.constexpr = 16 * W
    BM: tl.constexpr = 8 * NT
    tl.static_assert(BK % 128 == 0, "the fragment kernel takes K blocks of 128")
    pid_b, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_b * BM >= tl.load(num_padded_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_b).to(tl.int64)
    lane = tl.arange(0, T_) % 32
    r = lane // 4
    c = lane % 4
    row0 = pid_n * BN + (tl.arange(0, T_) // 32) * 16 + r       # row r of the warp's tile
    # token column 8n + r of the block; a padding slot reads the block's first row (written, finite; never stored)
    first = tl.load(sorted_ptr + pid_b * BM)
    x_rows = ()
    for n in tl.static_range(NT):
        s = tl.load(sorted_ptr + pid_b * BM + 8 * n + r)
        x_rows = x_rows + (x_ptr + (tl.where(s < A, s, first) // a_div).to(tl.int64) * stride_x,)
    w_rows, s_rows = _expert_rows(w1_ptr, s1_ptr, w3_ptr, s3_ptr, e, row0, N, stride_we, stride_wn, stride_se,
                                  stride_sn, GATED)
    TILES: tl.constexpr = 2 if GATED else 1
    accs = frag_accumulate(x_rows, w_rows, s_rows, 0, tl.cdiv(K, BK), K, GROUP, NT, TILES, BK, EVEN_K, X_VEC,
                           INTERPRET, DT, W, PREFETCH)
    # lane (r, c) of token tile n holds rows (r, r, r + 8, r + 8) x columns 8n + (2c, 2c + 1, 2c, 2c + 1)
    for n in tl.static_range(NT):
        for q in tl.static_range(4):
            s = tl.load(sorted_ptr + pid_b * BM + 8 * n + 2 * c + q % 2)
            row = row0 + 8 * (q // 2)
            ok = (s < A) & (row < N)
            dst = out_ptr + tl.where(s < A, s, 0).to(tl.int64) * stride_out + row
            if GATED:
                gate = accs[4 * n + q]
                up = accs[4 * (NT + n) + q]
                tl.store(dst, (gate * tl.sigmoid(gate) * up).to(DT), mask=ok)
            else:
                weight = tl.load(topk_w_ptr + s, mask=s < A, other=0.0).to(tl.float32)
                tl.store(dst, accs[4 * n + q] * weight, mask=ok)


# (BK, warps, PREFETCH) of the aligned fragment blocks' launches (_moe_frag_block_kernel). H100, Kimi experts, 16-row
# blocks, sweep_moe_rows --frag-tiles (session 40, runs session40_call4 / call5, interleaved rounds), µs at 128 / 256
# tokens: BK 256 on 4 warps 4163 / 4634-4716, on 2 warps - / 4701, on 8 warps 4256 / 4724, BK 128 (the first
# tile) 4849 / 5376-5387, BK 128 on 8 warps 5158 / 5703, BK 512 5176 (5291 without the register double buffer),
# BK 256 without it 5288; the plane tile 4757 / 5170-5321. Per 128 K a quad of lanes reads 64 B of each weight
# row; with BK 256 two such reads of one 128-byte line are in flight together.
MOE_FRAG_BLOCK_TILES = {"gate_up": (256, 4, True), "down": (256, 4, True)}
MOE_FRAG_BLOCK_INTERPRETER = (128, 2, False)

# (BK, programs per SM, warps, PREFETCH) of each launch: the best of 20 pairs at one Kimi token on the H200 (session
# 15, results/sweep_moe_frag_h200.json): 81.3 µs against 81.9-95.5 for the others — and 75.0 µs for the plane GEMV
# (gemv="prefetch") in the same run, so this form is not the default
MOE_FRAG_TILES = {"gate_up": (256, 8, 4, True), "down": (256, 16, 4, True)}
MOE_FRAG_INTERPRETER = (128, 4, 2, False)   # small, two warps
