"""Where the INT4 GEMV's time goes at decode, measured in one GPU call (docs/moe.md "Where the INT4 GEMV time goes
(measured)").

    python -m benchmarks.probe_int4_gemv moe [--loads-only] [--out probe_moe.json]
    python -m benchmarks.probe_int4_gemv standalone --shape 0|1 [--out probe_gemv.json]

``moe``: ``fused_moe``'s INT4 decode (the plane GEMV with prefetch, the default) at one Kimi token, once with the
autotuner's choice and once per tile of ``MOE_TILES`` (BLOCK_N, BLOCK_K, warps) pinned. ``--loads-only`` swaps the
plane step (``_gemm_utils.int4_plane_gemv_step``) for one that only bitcasts and sums the words and scales them:
the same loads and grid without the unpacking arithmetic, i.e. the memory floor of those tiles (run it as its own
process: it patches the kernel module before the first compile).

``standalone``: one plane GEMV over the bytes the MoE reads at one token — shape 0: gate-up, 8 experts × 4096
rows × 7168; shape 1: down, 8 × 7168 rows × 2048 — with the words read by plain register loads or by TMA
descriptor loads, which Triton pipelines through shared memory (2-4 stages), each with the real arithmetic and
loads only. Both modes time CUDA graphs in interleaved rounds (``common.interleaved_graph_us``) and print µs (and,
standalone, the fraction of the copy bandwidth measured in the same run).
"""
from __future__ import annotations

import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from mla_quant.kernels._gemm_utils import _load_in_place, int4_plane_gemv_step, plane_offsets, plane_order

from .common import Context, interleaved_graph_us, measure_ceilings, meta, sweep_args

MOE_TILES = ((16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 512, 8), (16, 1024, 8), (64, 256, 8), (8, 512, 4),
             (8, 1024, 8), (32, 1024, 8), (64, 512, 8), (16, 512, 8), (8, 256, 2), (16, 256, 2))
SHAPES = ((8 * 4096, 7168), (8 * 7168, 2048))  # Kimi gate-up and down rows of the 8 routed experts, K
STANDALONE_TILES = ((16, 512, 4), (32, 256, 4))


@triton.jit
def _loads_only_step(words, s_ptrs, a_ptrs, k_mask, s_mask, EVEN: tl.constexpr, INTERPRET: tl.constexpr):
    """``int4_plane_gemv_step``'s loads of words and scales, with one bitcast and a sum per word for arithmetic."""
    v = words.to(tl.float32, bitcast=True)
    runs = tl.sum(tl.reshape(v, (words.shape[0] // 4, 4, words.shape[1])), axis=1)
    return runs * _load_in_place(s_ptrs, s_mask, EVEN, INTERPRET)


@triton.jit
def _plane_gemv(w_desc, w_ptr, s_ptr, a_ptr, out_ptr, N, K, stride_sn,
                BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
                LOADS_ONLY: tl.constexpr):
    # out[n] = Σ_k W[n, k] a[k]: w [N, K/8] int32 (or its TMA descriptor, [BN, BK/8] blocks), s [N, K/32] bf16,
    # a: fp32 nibble planes (plane_order); K % BK == 0. The words of a K block as a [BK/8, BN] tile (as fused_moe)
    pid = tl.program_id(0)
    n0 = pid * BN
    rn = n0 + tl.arange(0, BN)
    rw = tl.arange(0, BK // 8)[:, None]
    rr = tl.arange(0, BK // 32)[:, None]
    rows = tl.minimum(rn, N - 1).to(tl.int64)[None, :]
    s_ptrs = s_ptr + rows * stride_sn + rr
    w_ptrs = w_ptr + rows * (K // 8) + rw
    acc = tl.zeros((BK // 32, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        if TMA:
            words = tl.trans(w_desc.load([n0, k0 // 8]))
        else:
            words = tl.load(w_ptrs + k0 // 8)
        a_ptrs = a_ptr + plane_offsets(k0 // 8 + rw)  # K % BK == 0: whole blocks, no masks (EVEN)
        if LOADS_ONLY:  # the same arguments: the step alone differs
            acc += _loads_only_step(words, s_ptrs, a_ptrs, rw < BK, rr < BK, True, False)
        else:
            acc += int4_plane_gemv_step(words, s_ptrs, a_ptrs, rw < BK, rr < BK, True, False)
        s_ptrs += BK // 32
    tl.store(out_ptr + rn, tl.sum(acc, axis=0), mask=rn < N)


def _median(got) -> float | str:
    return got if isinstance(got, str) else statistics.median(got)


def probe_moe(loads_only: bool) -> dict:
    from mla_quant.kernels.fused_moe import fused_moe
    from mla_quant.kernels.fused_moe import kernel as moe_kernel

    from . import bench_moe as bm

    if loads_only:
        moe_kernel.int4_plane_gemv_step = _loads_only_step
    dev = torch.device("cuda")
    projs, _ = bm._random_experts("int4_g32", dev)
    routings = bm._routings(1, dev)
    xs = [torch.randn(1, bm.HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(bm.SETS)]
    tuned = moe_kernel.moe_gemv_prefetch_autotuned
    autotuned = list(tuned.configs)

    def fn_for(tile):
        def fn():
            if tile is None:
                tuned.configs = autotuned
            else:  # one config: Autotuner.run uses it without the cache
                bn, bk, warps = tile
                tuned.configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "PREFETCH": True}, num_warps=warps,
                                               num_stages=1)]
            return [fused_moe(x, w, ids, projs["gate_proj"], projs["up_proj"], projs["down_proj"], kind="int4_group")
                    for x, (w, ids) in zip(xs, routings)]
        return fn

    fns = {"autotuned": fn_for(None), **{str(tile): fn_for(tile) for tile in MOE_TILES}}
    times = interleaved_graph_us(fns, reps=bm.SETS, rounds=3)
    rows = [{"tile": name, "median_us": _median(got)} for name, got in times.items()]
    for r in rows:
        print(f"{'loads only' if loads_only else 'real':10s} {r['tile']:16s} {r['median_us']}", flush=True)
    return {"mode": "moe", "loads_only": loads_only, "rows": rows}


def probe_standalone(shape: int, ctx: Context) -> dict:
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, k = SHAPES[shape]
    sets = 2  # 2 × 132 MB (gate-up) or 66 MB: past the 50 MB L2
    ws = [torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32) for _ in range(sets)]
    ss = [torch.rand(n, k // 32, device="cuda").mul_(1e-3).to(torch.bfloat16) for _ in range(sets)]
    planes = plane_order(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
    out = torch.empty(n, device="cuda")
    nbytes = n * k // 2 + n * k // 32 * 2
    fns = {}
    for bn, bk, warps in STANDALONE_TILES:
        descs = [TensorDescriptor.from_tensor(w, [bn, bk // 8]) for w in ws]
        for tma, stages in ((False, 1), (True, 2), (True, 3), (True, 4)):
            for loads_only in ((False, True) if stages in (1, 3) else (False,)):
                def fn(bn=bn, bk=bk, warps=warps, tma=tma, stages=stages, loads_only=loads_only, descs=descs):
                    for w, s, d in zip(ws, ss, descs):
                        _plane_gemv[(triton.cdiv(n, bn),)](d, w, s, planes, out, n, k, s.stride(0), BN=bn, BK=bk,
                                                           STAGES=stages, TMA=tma, LOADS_ONLY=loads_only,
                                                           num_warps=warps, num_stages=stages)
                name = (f"{n}x{k} bn{bn} bk{bk} w{warps} {f'tma s{stages}' if tma else 'regs'}"
                        f"{' loads-only' if loads_only else ''}")
                fns[name] = fn
    rows = []
    for name, got in interleaved_graph_us(fns, reps=sets, rounds=3).items():
        t = _median(got)
        frac = None if isinstance(t, str) else round(nbytes / (t * 1e-6) / 1e12 / ctx.copy_tbps, 4)
        rows.append({"setting": name, "median_us": t, "frac_of_copy": frac})
        print(f"{name:60s} {t} µs {frac} of copy", flush=True)
    return {"mode": "standalone", "shape": [n, k], "bytes": nbytes, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    def extra(ap):
        ap.add_argument("mode", choices=("moe", "standalone"))
        ap.add_argument("--loads-only", action="store_true", help="moe: the loads without the arithmetic")
        ap.add_argument("--shape", type=int, default=0, choices=(0, 1), help="standalone: 0 gate-up, 1 down")

    args = sweep_args(__doc__, "probe_int4_gemv.json", None, argv, extra)
    if args is None:
        return 2
    ctx = Context()
    measure_ceilings(ctx)
    res = probe_moe(args.loads_only) if args.mode == "moe" else probe_standalone(args.shape, ctx)
    with open(args.out, "w") as f:
        json.dump({"meta": meta(ctx), **res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
