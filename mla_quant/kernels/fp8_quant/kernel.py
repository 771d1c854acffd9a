"""Triton kernels for FP8 (e4m3) quantization. Math and rounding match ``reference.py`` bit for bit."""
import triton
import triton.language as tl

from .._triton_utils import cast_fp8_saturating, finite_abs, fp8_scale, reciprocal


@triton.jit
def _act_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, n_groups,
                          GROUP: tl.constexpr, UE8M0: tl.constexpr, BLOCK_G: tl.constexpr):
    # x viewed as [n_groups, GROUP]; each program quantizes BLOCK_G consecutive groups.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = tl.arange(0, GROUP)
    mask = rows[:, None] < n_groups
    offs = rows[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(finite_abs(x), axis=1), UE8M0)
    q = cast_fp8_saturating(x * reciprocal(s)[:, None])
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(s_ptr + rows, s, mask=rows < n_groups)


@triton.jit
def _block_quant_fp8_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_wn, stride_qn, n_kb,
                            N_BUCKET,  # autotuning key only
                            BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr, K_FAST: tl.constexpr):
    # One program per BN×BK block (1-D grid; K_FAST: consecutive programs walk along K, so the programs in flight
    # read whole rows). ROWS == BN: the block is loaded once and kept in registers; ROWS < BN: two passes over
    # ROWS-row slices (amax, then quantize; the second read hits L2), fewer registers per program.
    pid = tl.program_id(0)
    n_nb = tl.cdiv(N, BN)
    if K_FAST:
        pid_n, pid_k = pid // n_kb, pid % n_kb
    else:
        pid_n, pid_k = pid % n_nb, pid // n_nb
    rk = pid_k * BK + tl.arange(0, BK)
    w_blk = w_ptr + (pid_n * BN).to(tl.int64) * stride_wn
    q_blk = q_ptr + (pid_n * BN).to(tl.int64) * stride_qn
    if ROWS == BN:
        rn = pid_n * BN + tl.arange(0, BN)
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        w = tl.load(w_blk + tl.arange(0, BN)[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0)
        w = w.to(tl.float32)
        s = fp8_scale(tl.max(tl.max(finite_abs(w), axis=1), axis=0), False)
        tl.store(q_blk + tl.arange(0, BN)[:, None] * stride_qn + rk[None, :],
                 cast_fp8_saturating(w * reciprocal(s)), mask=mask)
    else:
        amax = tl.zeros((ROWS, BK), dtype=tl.float32)
        for r0 in range(0, BN, ROWS):
            rr = r0 + tl.arange(0, ROWS)
            mask = (pid_n * BN + rr[:, None] < N) & (rk[None, :] < K)
            w = tl.load(w_blk + rr[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, finite_abs(w))
        s = fp8_scale(tl.max(tl.max(amax, axis=1), axis=0), False)
        r = reciprocal(s)
        for r0 in range(0, BN, ROWS):
            rr = r0 + tl.arange(0, ROWS)
            mask = (pid_n * BN + rr[:, None] < N) & (rk[None, :] < K)
            w = tl.load(w_blk + rr[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(q_blk + rr[:, None] * stride_qn + rk[None, :], cast_fp8_saturating(w * r), mask=mask)
    tl.store(s_ptr + pid_n * n_kb + pid_k, s)


def _block_quant_configs() -> list[triton.Config]:
    """(ROWS, K_FAST, warps): the previous fixed launch first (16 warps, programs walking down N), then K-major
    program order, other warp counts, and two-pass row slices. All write the same bytes."""
    return [triton.Config({"ROWS": rows, "K_FAST": k_fast}, num_warps=w)
            for rows, k_fast, w in ((128, False, 16), (128, True, 16), (128, True, 8), (128, True, 32),
                                    (32, True, 4), (64, True, 8))]


def _prune_block_quant(configs, named_args, **kwargs):
    kept = [c for c in configs if c.kwargs["ROWS"] <= kwargs["BN"]]
    return kept or [triton.Config({"ROWS": kwargs["BN"], "K_FAST": True}, num_warps=4)]


block_quant_fp8_autotuned = triton.autotune(
    configs=_block_quant_configs(), key=["N_BUCKET", "K", "BN", "BK"],
    prune_configs_by={"early_config_prune": _prune_block_quant})(_block_quant_fp8_kernel)


@triton.jit
def _block_dequant_fp8_kernel(q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_on, n_kb,
                              BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    q = tl.load(q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + pid_n * n_kb + pid_k)
    w = q.to(tl.float32) * s
    tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_on + rk[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, T,
                         T_BUCKET,  # autotuning key only
                         PER_TOKEN: tl.constexpr, CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_T_P2: tl.constexpr, SUB: tl.constexpr):
    # BLOCK_T rows of D = N_CHUNKS·CHUNK values are one contiguous run of BLOCK_T·N_CHUNKS chunks, read as one
    # [SUB, CHUNK] tile (SUB ≥ BLOCK_T·N_CHUNKS, a power of two): 576-wide MLA rows are 9 chunks of 64, so 7 rows
    # fill 63 of 64 tile rows. One layout for the whole tile: no padding of 576 to 1024, no head/tail split whose
    # two layouts made the compiler convert the whole tile through shared memory.
    D: tl.constexpr = CHUNK * N_CHUNKS
    row0 = tl.program_id(0) * BLOCK_T
    j = tl.arange(0, SUB)
    row_of_j = j // N_CHUNKS  # the row (within this program) of each tile row
    ok = (row_of_j < BLOCK_T) & (row0 + row_of_j < T)
    offs = (j * CHUNK)[:, None] + tl.arange(0, CHUNK)[None, :]
    base = row0.to(tl.int64) * D
    x = tl.load(x_ptr + base + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    if PER_TOKEN:
        # per-row amax over its N_CHUNKS tile rows: a [BLOCK_T_P2, SUB] selection (small next to the tile)
        rows = tl.arange(0, BLOCK_T_P2)
        sel = rows[:, None] == row_of_j[None, :]
        amax_j = tl.max(finite_abs(x), axis=1)
        s = fp8_scale(tl.max(tl.where(sel, amax_j[None, :], 0.0), axis=1), False)
        tl.store(s_ptr + row0 + rows, s, mask=(rows < BLOCK_T) & (row0 + rows < T))
        r = tl.max(tl.where(sel, reciprocal(s)[:, None], 0.0), axis=0)[:, None]
    else:
        r = reciprocal(tl.load(s_ptr))
    tl.store(q_ptr + base + offs, cast_fp8_saturating(x * r), mask=ok[:, None])


def kv_tile(n_chunks: int, sub: int) -> dict:
    """The rows per program of a [SUB, CHUNK] tile (at least one row: SUB grows to fit N_CHUNKS)."""
    sub = max(sub, triton.next_power_of_2(n_chunks))
    block_t = sub // n_chunks
    return {"SUB": sub, "BLOCK_T": block_t, "BLOCK_T_P2": triton.next_power_of_2(block_t)}


def _kv_configs() -> list[triton.Config]:
    """(tile rows of CHUNK values, warps); for 576-wide rows SUB 64/128/256 hold 7/14/28 rows (4-16K values, the
    tile sizes at which act_quant runs fastest on the H200)."""
    return [triton.Config({"SUB": sub}, num_warps=w)
            for sub, w in ((64, 4), (64, 2), (128, 4), (128, 8), (256, 8), (32, 2))]


def _prune_kv(configs, named_args, **kwargs):
    seen, out = set(), []
    for c in configs:
        kw = kv_tile(kwargs["N_CHUNKS"], c.kwargs["SUB"])
        if (kw["SUB"], c.num_warps) not in seen:
            seen.add((kw["SUB"], c.num_warps))
            out.append(triton.Config(kw, num_warps=c.num_warps))
    return out


kv_quant_fp8_autotuned = triton.autotune(
    configs=_kv_configs(), key=["T_BUCKET", "PER_TOKEN", "CHUNK", "N_CHUNKS"],
    prune_configs_by={"early_config_prune": _prune_kv})(_kv_quant_fp8_kernel)
