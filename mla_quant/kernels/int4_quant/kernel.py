"""Triton kernels: fused INT4 group quantize + pack, and fused unpack + dequantize (layout of reference.py)."""
import triton
import triton.language as tl

from .._triton_utils import reciprocal, rint


@triton.jit
def _tile(N, K, BN: tl.constexpr, BK: tl.constexpr, K_FAST: tl.constexpr):
    """(row tile, column tile) of this program in a 1-D grid. K_FAST: consecutive programs walk along K, so the
    programs in flight cover whole rows (contiguous memory) instead of one BK slice of many rows."""
    pid = tl.program_id(0)
    if K_FAST:
        n_kt = tl.cdiv(K, BK)
        return pid // n_kt, pid % n_kt
    else:
        n_nt = tl.cdiv(N, BN)
        return pid % n_nt, pid // n_nt


@triton.jit
def _int4_quant_pack_kernel(w_ptr, packed_ptr, scale_ptr, N, K, stride_wn,
                            N_BUCKET,  # autotuning key only
                            GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_FAST: tl.constexpr):
    # Tile [BN, BK] of w -> [BN, BK/8] words and [BN, BK/GROUP] scales (BK is a multiple of GROUP and 8).
    pid_n, pid_k = _tile(N, K, BN, BK, K_FAST)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    wg = tl.reshape(w, (BN, BK // GROUP, GROUP))
    s = tl.div_rn(tl.max(tl.abs(wg), axis=2), 7.5)
    s = s.to(scale_ptr.dtype.element_ty).to(tl.float32)  # quantize against the stored (rounded) scale
    q = tl.where(s[:, :, None] == 0.0, 0.0, rint(wg * reciprocal(s)[:, :, None]))
    q = tl.minimum(tl.maximum(q, -8.0), 7.0)
    nib = tl.reshape((q + 8.0).to(tl.int32), (BN, BK // 8, 8))
    shifts = tl.arange(0, 8) * 4
    words = tl.sum(nib << shifts[None, None, :], axis=2)  # disjoint bits, so the sum is an OR
    rw = pid_k * (BK // 8) + tl.arange(0, BK // 8)
    tl.store(packed_ptr + rn[:, None].to(tl.int64) * (K // 8) + rw[None, :], words,
             mask=(rn[:, None] < N) & (rw[None, :] < K // 8))
    rg = pid_k * (BK // GROUP) + tl.arange(0, BK // GROUP)
    tl.store(scale_ptr + rn[:, None].to(tl.int64) * (K // GROUP) + rg[None, :],
             s.to(scale_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rg[None, :] < K // GROUP))


@triton.jit
def _int4_dequant_kernel(packed_ptr, scale_ptr, out_ptr, N, K,
                         N_BUCKET,  # autotuning key only
                         GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_FAST: tl.constexpr):
    pid_n, pid_k = _tile(N, K, BN, BK, K_FAST)
    rn = pid_n * BN + tl.arange(0, BN)
    rw = pid_k * (BK // 8) + tl.arange(0, BK // 8)
    words = tl.load(packed_ptr + rn[:, None].to(tl.int64) * (K // 8) + rw[None, :],
                    mask=(rn[:, None] < N) & (rw[None, :] < K // 8), other=0)
    shifts = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8
    rg = pid_k * (BK // GROUP) + tl.arange(0, BK // GROUP)
    s = tl.load(scale_ptr + rn[:, None].to(tl.int64) * (K // GROUP) + rg[None, :],
                mask=(rn[:, None] < N) & (rg[None, :] < K // GROUP), other=0.0).to(tl.float32)
    w = tl.reshape(q.to(tl.float32), (BN, BK // GROUP, GROUP)) * s[:, :, None]
    rk = pid_k * BK + tl.arange(0, BK)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * K + rk[None, :],
             tl.reshape(w, (BN, BK)).to(out_ptr.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))


def _configs(tiles) -> list[triton.Config]:
    return [triton.Config({"BN": bn, "BK": bk, "K_FAST": k_fast}, num_warps=w) for bn, bk, w, k_fast in tiles]


def _prune(configs, named_args, **kwargs):
    """BK must hold whole groups (GROUP ≤ 128 ≤ every BK here; kept general)."""
    kept = [c for c in configs if c.kwargs["BK"] % kwargs["GROUP"] == 0]
    return kept or [triton.Config({"BN": 1, "BK": kwargs["GROUP"], "K_FAST": True}, num_warps=1)]


# (BN, BK, warps, K_FAST): the previous fixed launch first, then the best of the H200 sweeps (.device/4, 5:
# within 2% of each other), in K-major program order, and larger programs with more warps. Per-element math:
# every configuration writes the same bytes.
QUANT_CONFIGS = _configs(((1, 1024, 1, False), (1, 1024, 1, True), (2, 1024, 2, True), (4, 1024, 4, True),
                          (4, 512, 2, True), (8, 512, 4, True), (2, 512, 1, True)))
DEQUANT_CONFIGS = _configs(((8, 1024, 1, False), (8, 1024, 1, True), (16, 512, 1, True), (8, 512, 2, True),
                            (2, 1024, 1, True), (16, 1024, 4, True), (32, 512, 8, True)))
int4_quant_pack_autotuned = triton.autotune(configs=QUANT_CONFIGS, key=["N_BUCKET", "K", "GROUP"],
                                            prune_configs_by={"early_config_prune": _prune})(_int4_quant_pack_kernel)
int4_dequant_autotuned = triton.autotune(configs=DEQUANT_CONFIGS, key=["N_BUCKET", "K", "GROUP"],
                                         prune_configs_by={"early_config_prune": _prune})(_int4_dequant_kernel)
