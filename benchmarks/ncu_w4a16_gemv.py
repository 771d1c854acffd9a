"""Nsight Compute profiles of the one-token W4A16 GEMVs (``w4a16_gemm`` at M = 1), and their summary.

    # on the GPU: one launch per case under ncu (clocks left free: --clock-control none), then the summary
    python -m benchmarks.ncu_w4a16_gemv --run --out ncu_w4a16_gemv.json [--shapes 4096x7168,2048x7168]
    # one case's launches alone (what --run starts under ncu)
    python -m benchmarks.ncu_w4a16_gemv --case FORM N K

Forms (``FORMS``): ``rows`` (gemv.py at the tile ``gemv_tile`` picks: since session 32 one warp, the row in
power-of-two spans; before, 8 rows in one masked 1024-word chunk on 4 warps), ``spans`` (the same spans on 8 rows and
4 warps), ``half2``
(gemv_half2.py at ``half2_tile``, on x already in pair order) and ``tinygemm`` (the peer). Each case launches three
times; ncu profiles the third (``ncu_mla_decode.profile``). The summary per case (``ncu_mla_decode``'s):
duration, DRAM and issue throughput, registers, warps per scheduler, stall reasons per issued instruction, and the
warp-level instructions per 1000 weights by opcode with each opcode's share of the stall samples — whether the GEMV
waits on its loads or on its arithmetic (docs/moe.md "W4A16 at M = 1").
"""
from __future__ import annotations

import argparse
import json
import os

from .ncu_mla_decode import profile, summarize_raw, summarize_source

FORMS = ("rows", "spans", "half2", "tinygemm")
KERNELS = {"rows": "_w4a16_gemv_kernel", "spans": "_w4a16_gemv_kernel", "half2": "_w4a16_gemv_half2_kernel",
           "tinygemm": "tinygemm"}
GROUP = 32


def run_case(form: str, n: int, k: int) -> None:
    """Three launches of one case (ncu profiles the third)."""
    import torch

    from mla_quant.kernels._half2_gemv import pair_order
    from mla_quant.kernels.int4_quant import int4_quantize
    from mla_quant.kernels.w4a16_gemm.gemv import gemv_launch, gemv_tile
    from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_launch, half2_tile

    from .bench_gemm import _tinygemm_pack

    packed, scale = int4_quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, GROUP)
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    pairs, pair_scales = pair_order(x[None])
    tiny = _tinygemm_pack(n, k, "cuda") if form == "tinygemm" else None
    for _ in range(3):
        if form == "rows":
            gemv_launch(x, packed, scale, y, GROUP, gemv_tile(n, k))
        elif form == "spans":
            gemv_launch(x, packed, scale, y, GROUP, (8, 0, 4, False))
        elif form == "half2":
            half2_launch(pairs[0], pair_scales[0], packed, scale, y, GROUP, half2_tile(n, k))
        else:
            torch.ops.aten._weight_int4pack_mm(x[None], tiny[0], GROUP, tiny[1])
    torch.cuda.synchronize()
    print(form, n, k)


def run_all(folder: str, shapes: list[tuple[int, int]], forms: tuple[str, ...]) -> dict:
    os.makedirs(folder, exist_ok=True)
    cases = {}
    for n, k in shapes:
        for form in forms:
            name = f"{form}_{n}x{k}"
            err, page = profile(os.path.join(folder, name), KERNELS[form],
                                ["benchmarks.ncu_w4a16_gemv", "--case", form, str(n), str(k)],
                                ("--clock-control", "none"))
            if page is None:
                cases[name] = {"error": err}
                continue
            # per 1000 weights: summarize_source rounds to 0.1, and a GEMV issues ~0.1-0.2 per weight
            source = summarize_source(page("--page", "source", "--csv", "--print-source", "sass"), n * k / 1000)
            row = {**summarize_raw(page("--page", "raw", "--csv")),
                   "warp_instr_per_1000_weights": source["warp_instr_per_token"],
                   "per_1000_weights_by_opcode": source["per_token_by_opcode"],
                   "stall_sample_share": source["stall_sample_share"]}
            cases[name] = row
            print(name, json.dumps(row)[:600], flush=True)
    return {"cases": cases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs=3, metavar=("FORM", "N", "K"))
    ap.add_argument("--run", action="store_true", help="profile the forms under ncu and summarize")
    ap.add_argument("--shapes", default="4096x7168,2048x7168")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--folder", default="/tmp/ncu_w4a16_gemv", help="where the .ncu-rep reports go")
    ap.add_argument("--out", default="ncu_w4a16_gemv.json")
    args = ap.parse_args(argv)
    if args.case:
        form, n, k = args.case
        run_case(form, int(n), int(k))
        return 0
    if not args.run:
        ap.print_help()
        return 2
    shapes = [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")]
    forms = tuple(f for f in args.forms.split(",") if f)
    unknown = set(forms) - set(FORMS)
    if unknown:
        raise SystemExit(f"--forms: {sorted(unknown)} not in {FORMS}")
    result = run_all(args.folder, shapes, forms)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
