"""Triton block-scaled FP8 GEMM (W8A8): C = A @ B.T with A e4m3 per-token 1×BK scales and B e4m3 BN_S×BK
block scales.

Two-level accumulation as in DeepGEMM: the tensor cores multiply one BK-wide slice of e4m3 tiles into a
fresh fp32 tile, which is scaled by ``a_scale[m, kb] · b_scale[n // BN_S, kb]`` and added to the main fp32
accumulator on the CUDA cores — so the tensor cores' reduced-precision fp8 accumulation never spans more
than one scale block. BK equals the scale block width (128 for the real checkpoints).

Split-K (``SPLIT_K > 1``, decode-sized M): a 2048-wide output has 16 tiles of 128 columns, 16 programs for 132
SMs streaming 15 MB of weights; the K blocks are then split over ``SPLIT_K`` programs per tile (``split_k``: ~2
programs per SM), each partial is written in fp32 and the last program of a tile sums them in split order
(``_gemm_utils.store_split_k``, the W4A16 GEMM's deterministic scheme).
"""
import triton
import triton.language as tl

from .._gemm_utils import autotune_bench, grouped_tile, m_bucket, split_k_for, store_split_k
from .._host import cdiv


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, part_ptr, count_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, stride_part,
    M_BUCKET, NUM_SMS,  # autotuning key / split-K heuristic input only
    BN_S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    # a [M, K] e4m3, as [M, K/BK] fp32, b [N, K] e4m3, bs [⌈N/BN_S⌉, K/BK] fp32, c [M, N]; K % BK == 0;
    # part [SPLIT_K, M, N] fp32 and count [tiles] int32 (zeros) when SPLIT_K > 1.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rm_ld = rm % M  # edge rows / columns re-read valid data (no masks in the loop); never stored
    rn_ld = rn % N
    n_kb = K // BK
    per_split = tl.cdiv(n_kb, SPLIT_K)
    kb_lo = pid_k * per_split
    kb_hi = tl.minimum(kb_lo + per_split, n_kb)
    a_ptrs = a_ptr + rm_ld[:, None].to(tl.int64) * stride_am + rk[None, :] + kb_lo * BK   # [BM, BK]
    b_ptrs = b_ptr + rn_ld[None, :].to(tl.int64) * stride_bn + rk[:, None] + kb_lo * BK   # [BK, BN] (K-major)
    as_ptrs = as_ptr + rm_ld.to(tl.int64) * n_kb                                           # [BM]
    bs_ptrs = bs_ptr + (rn_ld // BN_S) * n_kb                                              # [BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        a_s = tl.load(as_ptrs + kb)
        b_s = tl.load(bs_ptrs + kb)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BK
        b_ptrs += BK
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    store_split_k(acc, c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :], mask,
                  part_ptr + (rm[:, None].to(tl.int64) * N + rn[None, :]), stride_part, pid_k, count_ptr + pid, SPLIT_K)


def _configs() -> list[triton.Config]:
    """Tiles whose two fp32 tiles (the block product and the accumulator) fit in registers: at most
    64 fp32 values of each per thread (BM·BN / (32·num_warps) <= 64)."""
    c = triton.Config
    return [c({"BM": bm, "BN": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, w, s in ((64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3),
                                 (128, 128, 8, 4), (64, 256, 8, 3))]


def _prune(configs, named_args, **kwargs):
    m = named_args["M_BUCKET"]
    keep = [cfg for cfg in configs if (cfg.kwargs["BM"] <= 64) == (m <= 64)]
    return keep or configs


def split_k(m: int, n: int, k: int, bm: int, bn: int, bk: int, sms: int) -> int:
    """K splits for a BM × BN tiling: while the tiles give fewer than ~2 programs per SM (each split keeps ≥ 2 K
    blocks); 1 at prefill sizes."""
    return split_k_for(cdiv(m, bm) * cdiv(n, bn), k // bk, 2 * sms)


def workspace_bounds(m: int, n: int, k: int, bk: int, sms: int) -> tuple[int, int]:
    """(largest SPLIT_K, most output tiles) over the configs the autotuner may pick for M tokens."""
    cfgs = _prune(_configs(), {"M_BUCKET": m_bucket(m)})
    splits = [split_k(m, n, k, c.kwargs["BM"], c.kwargs["BN"], bk, sms) for c in cfgs]
    tiles = [cdiv(m, c.kwargs["BM"]) * cdiv(n, c.kwargs["BN"]) for c in cfgs]
    return max(splits), max(tiles)


fp8_gemm_autotuned = triton.autotune(configs=_configs(), key=["M_BUCKET", "N", "K"], do_bench=autotune_bench,
                                     prune_configs_by={"early_config_prune": _prune})(
    triton.heuristics({"SPLIT_K": lambda a: split_k(a["M"], a["N"], a["K"], a["BM"], a["BN"], a["BK"],
                                                    a["NUM_SMS"])})(_fp8_gemm_kernel))
