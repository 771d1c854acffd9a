"""Per-kernel GPU times of a few decode-sized calls, from the torch profiler (CUPTI), to see where a step's time
goes beside what the bench rows say about the whole call.

    python -m benchmarks.profile_kernels [--out profile.json] [--reps 20]

Cases: the fused MoE at one Kimi token (INT4 group 32 and FP8 block experts, 384 experts, top-8), the dense
W4A16 at M = 1 (2048 × 7168), the DSA decode step at one GLM 5.2 request of 64k (8 heads, fp8_ds_mla pages:
indexer + top-k + sparse attention, the ``bench_dsa`` step) and the BF16 MLA decode at 16 heads, batch 64, 4k
(the short-context bandwidth goal's shape; also batch 32, and fp8_e4m3 pages at batch 64). ``--only`` keeps the
cases whose label contains one of the given substrings. Each call runs ``--reps`` times after a warm-up (eager launches:
the gaps between kernels are the host's and not reported; the kernel durations are the device's). Prints, per
case, each kernel's mean µs per call and its share of the summed kernel time, and writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

from mla_quant.kernels.fused_moe import fused_moe
from mla_quant.kernels.int4_quant import int4_quantize
from mla_quant.kernels.w4a16_gemm import w4a16_gemm
from mla_quant.modules.experts import kernel_args

from .bench_moe import FORMATS, _random_experts, _routings


def kernel_times(fn, reps: int) -> list[tuple[str, float, int]]:
    """(kernel name, mean µs per call, launches per call) over ``reps`` calls of ``fn``, longest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    rows = [(name[:90], total[name] / reps, count[name] // reps) for name in total]
    return sorted(rows, key=lambda r: -r[1])


def cases(dev) -> dict:
    out = {}
    for name in ("int4_g32", "fp8_block"):
        projs, _ = _random_experts(name, dev)
        w, ids = _routings(1, dev)[0]
        x = torch.randn(1, 7168, device=dev, dtype=torch.bfloat16)
        out[f"moe {name} 1 token"] = (lambda x=x, w=w, ids=ids, p=projs, a=kernel_args(FORMATS[name]): fused_moe(
            x, w, ids, p["gate_proj"], p["up_proj"], p["down_proj"], **a))
    packed, scale = int4_quantize(torch.randn(2048, 7168, device=dev, dtype=torch.bfloat16) * 0.02, 32)
    x1 = torch.randn(1, 7168, device=dev, dtype=torch.bfloat16)
    out["w4a16 M=1 2048x7168"] = lambda: w4a16_gemm(x1, packed, scale, 32)
    out["dsa_decode fp8_ds_mla 8h batch 1 64k"] = _dsa_step(dev)
    out["mla_decode bf16 16h batch 64 4k"] = _mla_decode(dev)
    out["mla_decode bf16 16h batch 32 4k"] = _mla_decode(dev, batch=32)
    out["mla_decode fp8_e4m3 16h batch 64 4k"] = _mla_decode(dev, kind="fp8_e4m3")
    return out


def _dsa_step(dev):
    from mla_quant.kernels.indexer_scores import indexer_topk
    from mla_quant.kernels.sparse_mla_decode import sparse_mla_decode

    from .bench_dsa import D_LATENT, PAGE, SCALE, TOPK, _fill_pools, decode_queries
    n, heads, kind = 65536, 8, "fp8_ds_mla"
    pool, scales, keys, key_scales = _fill_pools(kind, n // PAGE, dev)
    table = torch.randperm(n // PAGE, device=dev).to(torch.int32)[None]
    seq_lens, req_ids, positions, q_idx, w_idx = decode_queries(1, n, dev)
    q = torch.randn(1, heads, D_LATENT + 64, device=dev, dtype=torch.bfloat16)

    def step():
        idx = indexer_topk(q_idx, w_idx, keys, key_scales, table, req_ids, positions, TOPK, n)
        return sparse_mla_decode(q[..., :D_LATENT], q[..., D_LATENT:], pool, scales, kind, table, seq_lens,
                                 req_ids, idx, SCALE)
    return step


def _mla_decode(dev, batch=64, kind="bf16"):
    from mla_quant.kernels.mla_decode import mla_decode

    from .bench_mla_decode import D_LATENT, PAGE, SCALE, _fill_pool
    n, heads = 4096, 16
    pool, scales = _fill_pool(kind, batch * n // PAGE, dev)
    table = torch.randperm(batch * n // PAGE, device=dev).to(torch.int32).reshape(batch, -1)
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 1, heads, D_LATENT + 64, device=dev, dtype=torch.bfloat16)
    return lambda: mla_decode(q, pool, scales, table, seq_lens, SCALE, kind, D_LATENT, max_seq_len=n,
                              validate=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="profile.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", nargs="*", help="profile only the cases whose label contains one of these")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profiling needs CUDA (run it on the H200)", file=sys.stderr)
        return 2
    result = {}
    with torch.inference_mode():
        for label, fn in cases("cuda").items():
            if args.only and not any(o in label for o in args.only):
                continue
            rows = kernel_times(fn, args.reps)
            total = sum(r[1] for r in rows)
            print(f"\n{label}: {total:.1f} µs of kernels per call", flush=True)
            for name, us, n in rows:
                print(f"  {us:8.2f} µs {100 * us / total:5.1f} %  x{n}  {name}")
            result[label] = {"kernel_us": round(total, 2),
                             "kernels": [{"name": n, "us": round(u, 2), "launches": c} for n, u, c in rows]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
