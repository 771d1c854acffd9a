"""Sweep of the block-scaled FP8 GEMM's variants and configurations at prefill shapes, in one GPU call.

    python -m benchmarks.sweep_fp8_gemm [--out sweep_fp8_gemm.json] [--budget-s 120] [--ms 512,2048,8192]
                                        [--only "PERSISTENT=1,BM=64"] [--rounds 5]

For every shape (M in ``--ms`` × the (N, K) of ``NK``) it times, with ``bench_gemm``'s method (one call per
weight set, enough sets to overflow L2, all captured in one CUDA graph: ``common.graph_us``), the peers
cuBLAS bf16 (``x @ W.T``) and ``torch._scaled_mm`` (per-tensor fp8), then ``fp8_gemm``'s default
(``variant="auto"``), the portable kernel (autotuned) and each ``TMA_CANDIDATES`` / ``WS_CANDIDATES``
configuration of the Hopper variants. Prints µs, TFLOP/s and the ratios to the peers (goal, issue 6: ≥ 0.7×
_scaled_mm and ≥ 1.4× bf16), then the best setting per shape, and writes them as JSON to ``--out``. After
``--budget-s`` the remaining settings are listed as skipped (the shapes go large-M first so the goal shapes come
early).
``--only``: time just the settings whose label contains one of these comma-separated substrings (and "auto").
``--rounds R`` (R > 1): each shape's peers and settings timed in R round-robin passes (``common.interleaved_graph_us``),
medians of the rounds reported. Timed one after another, the settings of a large shape are not alike: on the H200
(session 24, 8192 × 4096 × 7168) "auto", timed first, took 407-413 µs and the same configuration pinned, timed
later, 452-457 µs — the clocks fall under sustained FP8 load.
"""
from __future__ import annotations

import json
import statistics
import time

import torch

from mla_quant.kernels.fp8_gemm import TMA_CANDIDATES, WS_CANDIDATES, fp8_gemm
from mla_quant.kernels.fp8_quant import FP8, act_quant_fp8, block_quant_fp8

from .common import L2_BYTES, Context, graph_us, interleaved_graph_us, meta, sweep_args

NK = ((4096, 7168), (7168, 2048), (24576, 1536), (2048, 7168))  # Kimi/GLM widths: q_b-, o_proj-like, wide q_b, expert
MS = (8192, 2048, 512)


def settings(only: str = "") -> list[tuple[str, dict]]:
    """(label, fp8_gemm keyword arguments) in the order timed; ``only``: comma-separated label substrings to keep
    (with "auto"; empty: all)."""
    rows = [("auto", {}), ("portable", {"variant": "portable"})]
    for variant, candidates in (("tma", TMA_CANDIDATES), ("ws", WS_CANDIDATES)):
        for cfg in candidates:
            label = variant + " " + " ".join(f"{k}={v}" for k, v in cfg.items() if k != "GROUP_M")
            rows.append((label, {"variant": variant, "config": dict(cfg)}))
    keep = [w.strip() for w in only.split(",") if w.strip()]
    return [r for r in rows if not keep or r[0] == "auto" or any(w in r[0] for w in keep)]


def _extra_args(ap) -> None:
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="token counts, comma-separated")
    ap.add_argument("--only", default="", help="label substrings, comma-separated (default: every setting)")
    ap.add_argument("--rounds", type=int, default=1, help="> 1: time each shape's settings in interleaved rounds")


def _weights(n: int, k: int, sets: int) -> list[dict]:
    out = []
    for _ in range(sets):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q8, s8 = block_quant_fp8(w)
        out.append({"w": w, "q8": q8, "s8": s8, "q8t": q8.t()})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sweep_args(__doc__, "sweep_fp8_gemm.json", 120.0, argv, _extra_args)
    if args is None:
        return 2
    start = time.time()
    ctx = Context()
    ms = [int(m) for m in args.ms.split(",") if m]
    one = torch.ones((), device="cuda", dtype=torch.float32)
    rows, best, skipped = [], {}, []
    print(f"{'M':>5s} {'N':>6s} {'K':>6s} {'setting':58s} {'µs':>8s} {'TFLOP/s':>8s} {'x smm':>6s} {'x bf16':>6s}",
          flush=True)
    for n, k in NK:
        # bf16 weights dominate a set's bytes; enough sets that cycling them overflows L2 (as bench_gemm)
        sets = _weights(n, k, max(2, min(8, -(-3 * L2_BYTES // (2 * n * k)))))

        def timed(fn):
            def all_sets():
                for s in sets:
                    fn(s)
            return graph_us(all_sets, len(sets), warmup_ms=10, rep_ms=40)[0]

        for m in ms:
            if time.time() - start > args.budget_s:
                skipped.append({"M": m, "N": n, "K": k, "setting": "all"})
                continue
            shape = {"M": m, "N": n, "K": k}
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = act_quant_fp8(x, 128)
            m16 = -(-m // 16) * 16
            xq16 = torch.zeros(m16, k, device="cuda", dtype=FP8)
            xq16[:m] = xq
            flops = 2 * m * n * k
            peers = {"bf16": lambda s: x @ s["w"].T,
                     "smm": lambda s: torch._scaled_mm(xq16, s["q8t"], scale_a=one, scale_b=one,
                                                       out_dtype=torch.bfloat16)}
            kwargs_of = dict(settings(args.only))
            ours = {label: (lambda s, kw=kw: fp8_gemm(xq, xs, s["q8"], s["s8"], **kw))
                    for label, kw in kwargs_of.items()}
            if args.rounds > 1:  # everything of this shape round-robin; medians of the rounds
                fns = {name: (lambda fn=fn: [fn(s) for s in sets]) for name, fn in {**peers, **ours}.items()}
                got = interleaved_graph_us(fns, len(sets), args.rounds, warmup_ms=10, rep_ms=40)
                times = {name: (v if isinstance(v, str) else statistics.median(v)) for name, v in got.items()}
            else:
                times = {}
                for name, fn in {**peers, **ours}.items():
                    try:
                        times[name] = timed(fn)
                    except Exception as e:  # noqa: BLE001 - one setting that fails to compile or launch is a finding
                        times[name] = f"{type(e).__name__}: {e}"[:500]
            t_bf16, t_smm = times["bf16"], times["smm"]
            rows.append({**shape, "setting": "peers", "cublas_bf16_us": round(t_bf16, 3),
                         "scaled_mm_us": round(t_smm, 3), "rounds": args.rounds})
            print(f"{m:5d} {n:6d} {k:6d} {'cuBLAS bf16 / _scaled_mm':58s} {t_bf16:8.1f} {flops / t_bf16 / 1e6:8.0f} "
                  f"{t_smm:6.1f}µs", flush=True)
            for label in ours:
                t, kwargs = times[label], kwargs_of[label]
                if isinstance(t, str):
                    print(f"{m:5d} {n:6d} {k:6d} {label:58s} failed: {t}"[:300], flush=True)
                    rows.append({**shape, "setting": label, "error": t})
                    continue
                row = {**shape, "setting": label, "kwargs": kwargs, "median_us": round(t, 3),
                       "tflops": round(flops / t / 1e6, 1), "vs_scaled_mm": round(t_smm / t, 3),
                       "vs_bf16": round(t_bf16 / t, 3)}
                row["goal_met"] = row["vs_scaled_mm"] >= 0.7 and row["vs_bf16"] >= 1.4
                rows.append(row)
                print(f"{m:5d} {n:6d} {k:6d} {label:58s} {t:8.1f} {row['tflops']:8.0f} {row['vs_scaled_mm']:6.2f} "
                      f"{row['vs_bf16']:6.2f}", flush=True)
                key = f"{m}x{n}x{k}"
                if key not in best or t < best[key]["median_us"]:
                    best[key] = row
        del sets
        torch.cuda.empty_cache()
    print("\nbest per shape (vs the launcher's default 'auto'):")
    for key, row in best.items():
        auto = next((r for r in rows if f"{r['M']}x{r['N']}x{r['K']}" == key and r["setting"] == "auto"
                     and "median_us" in r), None)
        print(f"  {key:18s} {row['setting']:58s} {row['median_us']:8.1f} µs  x{row['vs_scaled_mm']:.2f} smm  "
              f"x{row['vs_bf16']:.2f} bf16" + (f"  (auto {auto['median_us']:.1f} µs)" if auto else ""))
    if skipped:
        print(f"budget spent: {len(skipped)} settings not timed")
    with open(args.out, "w") as f:
        json.dump({"meta": meta(ctx), "rows": rows, "best": best, "skipped": skipped}, f, indent=1)
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
