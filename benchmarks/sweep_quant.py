"""Sweep of the quantization kernels' launch settings at the ``quant`` bench's shapes, in one GPU call.

    python -m benchmarks.sweep_quant [--out sweep_quant.json] [--ops kv_quant_fp8_token,...] [--budget-s 55]

For every op of ``bench_quant.quant_ops`` it times the launcher's default and each setting of a small grid
(``config=``: rows / groups / block per program, num_warps, program order, and persistent grids with pipelined
loads: ``STAGES``, ``PROGRAMS_PER_SM``) with the bench's timing (``common.graph_us``: one call replayed from a CUDA graph by triton.testing.do_bench,
L2 flushed between replays, the first call — the compile — outside the timing; 10 ms warm-up and 50 ms of runs
instead of 25 / 100), and reports µs and the fraction of the copy bandwidth measured in the same run. Ops go
furthest-from-goal first; after ``--budget-s`` the remaining settings are listed as skipped. Prints a table and
the best setting per op, and writes them as JSON to ``--out``. Mostly Triton compiles (~45 small kernels).
"""
from __future__ import annotations

import json
import time

import torch

from .bench_quant import ROWS, K, quant_ops
from .common import Context, graph_us, measure_ceilings, meta, sweep_args

ACT = [{"BLOCK_G": g, "num_warps": w} for g, w in ((16, 4), (32, 8), (64, 8), (16, 2))]  # 64 with 4 warps spills
BLOCK_QUANT = [{"num_warps": w, "K_FAST": f} for w in (4, 8, 16) for f in (False, True)] + [
    {"num_warps": w, "STAGES": st, "PROGRAMS_PER_SM": p} for w, st, p in ((8, 3, 2), (8, 2, 2), (8, 4, 1), (16, 2, 2))]
BLOCK_DEQUANT = [{"num_warps": 4, "K_FAST": True}, {"num_warps": 8, "K_FAST": False}, {"num_warps": 8, "K_FAST": True}]
INT4_QUANT = [{"BN": bn, "BK": bk, "num_warps": w, "K_FAST": kf} for bn, bk, w, kf in
              ((1, 1024, 1, False), (2, 1024, 2, True), (1, 2048, 2, True), (1, 512, 1, True), (4, 1024, 4, True),
               (2, 1024, 2, False))] + [
    {"BN": bn, "BK": bk, "num_warps": w, "STAGES": st, "PROGRAMS_PER_SM": p} for bn, bk, w, st, p in
    ((1, 1024, 1, 3, 16), (4, 1024, 4, 3, 4), (2, 1024, 2, 3, 8), (4, 1024, 4, 4, 4))]
INT4_DEQUANT = [{"BN": bn, "BK": bk, "num_warps": w, "K_FAST": kf} for bn, bk, w, kf in
                ((8, 1024, 1, False), (4, 1024, 1, True), (8, 1024, 2, True), (16, 1024, 4, True), (4, 2048, 1, True),
                 (2, 4096, 1, True), (8, 512, 2, True))]
KV = [{"BLOCK_T": t, "num_warps": w, "STAGES": 0} for t, w in ((4, 2), (4, 4), (2, 2))] + [
    {"BLOCK_T": t, "num_warps": w, "STAGES": st, "PROGRAMS_PER_SM": p}  # persistent, loads pipelined
    for t, w, st, p in ((8, 4, 3, 4), (4, 2, 3, 16), (4, 2, 4, 8), (2, 2, 3, 16), (16, 8, 3, 2), (4, 2, 2, 8))]
# in the order swept: the ops furthest from 80 % of copy first, so a spent budget skips the others
GRID = {"kv_quant_fp8_token": KV, "int4_quantize_g32": INT4_QUANT, "block_quant_fp8": BLOCK_QUANT,
        "int4_dequantize_g32": INT4_DEQUANT, "block_dequant_fp8": BLOCK_DEQUANT, "act_quant_fp8": ACT,
        "act_quant_fp8_ue8m0": []}


def main(argv: list[str] | None = None) -> int:
    args = sweep_args(__doc__, "sweep_quant.json", 55.0, argv, lambda ap: ap.add_argument(
        "--ops", default="", help=f"comma-separated ops (default: all of {', '.join(GRID)})"))
    if args is None:
        return 2
    start = time.time()
    ctx = Context()
    measure_ceilings(ctx)
    x = torch.randn(ROWS, K, device="cuda", dtype=torch.bfloat16)
    wanted = [o for o in args.ops.split(",") if o] or list(GRID)
    rows, best, skipped = [], {}, []
    print(f"copy {ctx.copy_tbps:.3f} TB/s; x [{ROWS}, {K}] bf16", flush=True)
    print(f"{'op':22s} {'config':48s} {'µs':>8s} {'of copy':>8s}", flush=True)
    ops = {op: (call, bytes_moved) for op, call, bytes_moved in quant_ops(x)}
    for op in (o for o in GRID if o in wanted):
        call, bytes_moved = ops[op]
        for config in [None, *GRID[op]]:
            if time.time() - start > args.budget_s:
                skipped.append({"op": op, "config": config})
                continue
            try:
                t, _ = graph_us(lambda: call(config), warmup_ms=10, rep_ms=50)
            except Exception as e:  # noqa: BLE001 - one setting that fails to compile or launch is a finding
                print(f"{op:22s} {json.dumps(config):48s} failed: {type(e).__name__}: {e}"[:300], flush=True)
                rows.append({"op": op, "config": config, "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            frac = bytes_moved / (t * 1e-6) / 1e12 / ctx.copy_tbps
            rows.append({"op": op, "config": config, "median_us": round(t, 3), "frac_of_copy": round(frac, 3)})
            print(f"{op:22s} {json.dumps(config) if config else 'default':48s} {t:8.1f} {frac:8.3f}", flush=True)
            if op not in best or t < best[op]["median_us"]:
                best[op] = rows[-1]
    print("\nbest per op (config null = the launcher's default):")
    for op, row in best.items():
        default = next(r for r in rows if r["op"] == op and r["config"] is None and "median_us" in r)
        print(f"  {op:22s} {json.dumps(row['config'])}: {row['median_us']:.1f} µs, {row['frac_of_copy']:.3f} of copy "
              f"(default {default['median_us']:.1f} µs, {default['frac_of_copy']:.3f})")
    if skipped:
        print(f"budget spent: {len(skipped)} settings not timed")
    with open(args.out, "w") as f:
        json.dump({"meta": meta(ctx), "bytes_shape": [ROWS, K], "rows": rows, "best": best, "skipped": skipped},
                  f, indent=1)
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
