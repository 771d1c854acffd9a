"""GPU entry point: ``python -m benchmarks [--only quant,mla_decode] [--quick] [--out PATH]``.

Measures the copy-bandwidth and bf16-matmul ceilings first, then runs every ``bench_*.py`` module (or the
chosen ones) and writes ``benchmarks/results/h200.json`` in the schema of DESIGN.md. With ``--only`` the run merges
into an existing file (``common.write_results``): its cases replace the rows of the same bench and case, the other
rows and the file's notes stay, and each row names its run's commit.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

import torch

from .common import RESULTS, Context, measure_ceilings, write_results


def discover() -> list[str]:
    return sorted(p.stem[len("bench_"):] for p in Path(__file__).parent.glob("bench_*.py"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--only", default="", help="comma-separated bench modules (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks need CUDA (run them on the H200)", file=sys.stderr)
        return 2
    names = [n for n in args.only.split(",") if n] or discover()
    unknown = set(names) - set(discover())
    if unknown:
        ap.error(f"unknown bench modules {sorted(unknown)}; have {discover()}")
    ctx = Context(quick=args.quick)
    measure_ceilings(ctx)
    print(f"ceilings: copy {ctx.copy_tbps:.2f} TB/s, bf16 matmul {ctx.bf16_tflops:.0f} TFLOP/s", flush=True)
    cases, failed = [], []
    for name in names:
        t0 = time.time()
        try:
            mod = importlib.import_module(f"benchmarks.bench_{name}")
            got = mod.run(ctx)
        except Exception:  # one broken bench must not lose the others' results
            traceback.print_exc()
            failed.append(name)
            continue
        cases += got
        print(f"[{name}] {len(got)} cases in {time.time() - t0:.0f} s", flush=True)
        for c in got:
            print("  ", {k: c[k] for k in c if k not in ("bytes", "flops")}, flush=True)
        # Written after every bench, so a run stopped at its time limit keeps what it measured.
        write_results(args.out, ctx, cases, replace_benches={c["bench"] for c in cases} if args.only else None)
    print(f"wrote {len(cases)} cases to {args.out}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
