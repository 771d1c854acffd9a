"""Sweep of the whole-row one-token W4A16 GEMV (``w4a16_gemm(..., gemv="rows")``) against tinygemm and the
split-K plane GEMV (``gemv="planes1"``) and ``w4a16_gemm``'s default (``default``; ``default_prefetch``: with
``prefetch_weights=True``), in interleaved CUDA-graph rounds.

    python -m benchmarks.sweep_w4a16_gemv [--rounds 3] [--out benchmarks/results/sweep_w4a16_gemv_h200.json]

For each N×K (group 32, bf16 x and scales) one graph per setting holds one call per weight set, over enough sets
to miss L2 (as ``bench_gemm``), all with the same x. Settings: ``tinygemm`` (the peer), ``planes1`` (the bare
call: its split-K counters zeroed by a fill launch) and ``planes1_ws`` (kept counters), then the rows kernel at
each tile (BN rows per program, BKW words per K chunk, warps, PIPE: the chunks pipelined) launched plainly and
with PDL (``pdl``: each call's weights loaded before it waits for the call before — consecutive GEMVs overlap). Each rows setting is first
checked against ``w4a16_gemm_reference`` (max error over max |y|, bf16 output). Writes every round's µs.
"""
from __future__ import annotations

import itertools
import json
import sys

import torch

from mla_quant.kernels.int4_quant import int4_quantize
from mla_quant.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_reference
from mla_quant.kernels.w4a16_gemm.gemv import gemv_launch

from .bench_gemm import _tinygemm_pack
from .common import L2_BYTES, interleaved_graph_us, meta, Context, sweep_args

GROUP = 32
NKS = ((2048, 7168), (4096, 7168), (7168, 2048))
PDL = {"PDL": 1, "launch_pdl": True}
# (BN, BKW, warps, PIPE); a BKW of 0 stands for the row's words rounded up to a power of two (one chunk)
TILES = (tuple(itertools.product((4, 8, 16, 32), (0,), (2, 4, 8), (False,)))
         + ((8, 128, 4, True), (8, 256, 4, True), (16, 128, 4, True), (16, 256, 4, True), (16, 256, 8, True),
            (8, 128, 2, True), (4, 256, 4, True), (32, 128, 8, True), (8, 512, 4, True), (16, 64, 4, True),
            (32, 64, 4, True)))


def _tiles(k: int) -> list[tuple]:
    """TILES for rows of K: the one-chunk tiles at the row's width, the pipelined ones whose chunks split the row."""
    words = 1 << (k // 8 - 1).bit_length()
    return [(bn, bkw or words, warps, pipe) for bn, bkw, warps, pipe in TILES if not pipe or bkw <= words // 2]


def _sets(n: int, k: int, dev: str) -> list[dict]:
    count = max(2, -(-3 * L2_BYTES // (n * k // 2)))
    out = []
    for _ in range(count):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        p4, s4 = int4_quantize(w, GROUP)
        out.append({"p4": p4, "s4": s4, "tiny": _tinygemm_pack(n, k, dev)})
    return out


def main(argv=None) -> None:
    args = sweep_args(__doc__, "benchmarks/results/sweep_w4a16_gemv_h200.json", None, argv,
                      lambda ap: ap.add_argument("--rounds", type=int, default=3))
    if args is None:
        sys.exit(1)
    dev = "cuda"
    runs = []
    for n, k in NKS:
        sets = _sets(n, k, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        counters = torch.zeros(n, dtype=torch.int32, device=dev)
        ref = w4a16_gemm_reference(x, sets[0]["p4"], sets[0]["s4"], GROUP).float()
        fns = {
            "tinygemm": lambda: [torch.ops.aten._weight_int4pack_mm(x, s["tiny"][0], GROUP, s["tiny"][1])
                                 for s in sets],
            "planes1": lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, gemv="planes1") for s in sets],
            "default": lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y) for s in sets],
            "default_prefetch": lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, prefetch_weights=True)
                                         for s in sets],
            "planes1_ws": lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, counters=counters, gemv="planes1")
                                   for s in sets],
        }
        errors = {}
        for tile in _tiles(k):
            bn, bkw, warps, pipe = tile
            for pdl in (None, PDL):
                name = f"rows BN={bn} BKW={bkw} w={warps}" + (" pipe" if pipe else "") + (" pdl" if pdl else "")
                try:
                    y.fill_(float("nan"))
                    gemv_launch(x[0], sets[0]["p4"], sets[0]["s4"], y[0], GROUP, tile, pdl)
                    torch.cuda.synchronize()
                    errors[name] = float((y.float() - ref).abs().max() / ref.abs().max())
                except Exception as e:  # noqa: BLE001 - a tile that fails to compile is a finding
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
                    continue
                fns[name] = (lambda t, p: lambda: [gemv_launch(x[0], s["p4"], s["s4"], y[0], GROUP, t, p)
                                                   for s in sets])(tile, pdl)
        rounds = interleaved_graph_us(fns, reps=len(sets), rounds=args.rounds)
        rows = []
        tiny = rounds["tinygemm"]
        tiny_us = sorted(tiny)[len(tiny) // 2] if isinstance(tiny, list) else None
        for name, r in rounds.items():
            row = {"setting": name, "rounds_us": r if isinstance(r, list) else None,
                   "error": r if isinstance(r, str) else None, "rel_err": errors.get(name)}
            if isinstance(r, list):
                med = sorted(r)[len(r) // 2]
                row["median_us"] = round(med, 3)
                row["tbps"] = round((n * k // 2 + 2 * n * k // GROUP) / (med * 1e-6) / 1e12, 3)
                if tiny_us:
                    row["vs_tinygemm"] = round(tiny_us / med, 3)
            rows.append(row)
        rows.sort(key=lambda rw: rw.get("median_us", 1e9))
        print(f"\n{n} x {k}: {len(sets)} weight sets")
        for rw in rows[:12] + [rw for rw in rows[12:] if not rw["setting"].startswith("rows")]:
            print(f"  {rw['setting']:<32} {rw.get('median_us')} µs  {rw.get('tbps')} TB/s  "
                  f"x{rw.get('vs_tinygemm')} tinygemm  err {rw.get('rel_err')}")
        runs.append({"N": n, "K": k, "sets": len(sets), "rows": rows})
        del sets
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"about": __doc__.splitlines()[0], "meta": meta(Context()), "runs": runs}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
