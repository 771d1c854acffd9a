"""Sweep of the W4A16 fragment kernel (``w4a16_gemm(..., fragments=True)``, ``fragments.py``) at 2-128 tokens, with its
weights loaded plainly and streamed past L1 (``fragments.STREAM_WEIGHTS``) and, past 16 tokens, at other launch tiles
and token chunks, against tinygemm, the tiles that dequantize in their main loop and bf16 cuBLAS, in interleaved
CUDA-graph rounds.

    python -m benchmarks.sweep_w4a16_frag [--ms 2,4,8,16] [--shapes 4096x7168,...] [--rounds 5] [--label NAME]
        [--swap] [--wgmma] [--no-chunks] [--out benchmarks/results/sweep_w4a16_frag_h200.json]

For each M and N×K (group 32, bf16 x and scales) one graph per setting holds one call per weight set, over enough
sets to miss L2 (``sweep_w4a16_gemv._sets``), all with the same x: ``tinygemm`` (the peer), ``bf16`` (cuBLAS on the
same weights in bf16), ``tiles`` (``fragments=False``: what ``"auto"`` ran past 16 tokens until session 41), ``plain``
and ``stream`` (the kernel with kept split-K counters, as QuantLinear launches it) and, past 16 tokens, ``plain`` at
each ``CHUNK_TILES`` setting (``FRAG_CHUNK_TOKENS`` and the launch tile; not with ``--no-chunks``) and, with
``--swap``, the swapped-operand kernel's settings (``swap_settings``: token tiles of 32-128 columns, as
``swap_ab=True`` runs it, with kept counters) and, with ``--wgmma``, the Gluon wgmma kernel's settings
(``wgmma_settings``: ``w4a16_gemm(..., wgmma=True)``, x's permutation included). Each INT4 setting is first checked against ``w4a16_gemm_reference``
(max error over max |y| into a NaN-poisoned y). With ``--label`` the runs go under that key of an existing results
file (written after each shape).
"""
from __future__ import annotations

import sys

import torch

from mla_quant.kernels._gemm_utils import num_sms
from mla_quant.kernels.w4a16_gemm import _frag_launch, _swap_launch, fragments, w4a16_gemm, w4a16_gemm_reference
from mla_quant.kernels.w4a16_gemm.kernel import SWAP_TILE, swap_plan
from mla_quant.kernels.w4a16_gemm.wgmma import WGMMA_TILE, permute_x, wgmma_launch, wgmma_plan

from .common import interleaved_graph_us, module_attrs, rel_err, sweep_args
from .sweep_w4a16_gemv import GROUP, NKS, _sets, _shape_list, _write, timing_rows

# past 16 tokens: (FRAG_CHUNK_TOKENS, launch tile (row tiles per warp, BK, warps, programs per SM)); the first is the
# default
CHUNK_TILES = ((32, (1, 128, 4, 4)), (16, (1, 128, 4, 4)), (32, (1, 256, 4, 8)), (32, (2, 128, 4, 4)),
               (32, (1, 128, 8, 4)))


# --swap past 16 tokens: the swapped-operand kernel (swap_ab=True, kernel.swap_plan's token tile) as
# name -> _swap_launch keywords: the plan, the 2-byte gathers of each parity instead of X_SPLIT, half / twice the
# planned split, 8 warps (two warp groups share the token columns), K blocks of 128
def swap_settings(m: int, n: int, k: int, sms: int = 132) -> dict[str, dict]:
    split = swap_plan(m, n, k, sms)[1]
    bn, bk, _, stages = SWAP_TILE
    return {"swap": {}, "swap_gathers": {"x_split": False}, "swap_half_split": {"split": max(1, split // 2)},
            "swap_twice_split": {"split": min(2 * split, 32)}, "swap_w8": {"tile": (bn, bk, 8, stages)},
            "swap_bk128": {"tile": (bn, 128, 4, stages)}}


# --wgmma: the Gluon wgmma kernel (wgmma=True) as name -> wgmma_launch keywords: the default tile (8 warps = 128
# weight rows, 6 stages) and plan, 4 / 16 warps (64 / 256 rows: the activation tile shared by fewer / more warp
# groups), 4 and 8 stages, half / twice the planned split, and x permuted before the graph (the gather's cost)
def wgmma_settings(m: int, n: int, k: int, sms: int = 132) -> dict[str, dict]:
    warps, stages = WGMMA_TILE
    split = wgmma_plan(m, n, k, sms)[1]
    return {"wgmma": {}, "wgmma_w4": {"tile": (4, stages), "split": wgmma_plan(m, n, k, sms, 4, 4)[1]},
            "wgmma_w16": {"tile": (16, 4), "split": wgmma_plan(m, n, k, sms, 16, 1)[1]},
            "wgmma_s4": {"tile": (warps, 4)}, "wgmma_s8": {"tile": (warps, 8)},
            "wgmma_half_split": {"split": max(1, split // 2)}, "wgmma_twice_split": {"split": 2 * split},
            "wgmma_prepermuted": {"permuted": True}}


def chunk_tile_name(setting) -> str:
    chunk, (mt, bk, w, per_sm) = setting
    return f"c{chunk}_mt{mt}_bk{bk}_w{w}_ps{per_sm}"


def chunk_tile_attrs(setting) -> dict:
    """The fragments module's constants one CHUNK_TILES setting patches (every token count up to 128 on its tile)."""
    chunk, tile = setting
    return {"FRAG_CHUNK_TOKENS": chunk, "FRAG_TILE_BY_TOKENS": ((128, tile),)}


def _extra(ap) -> None:
    ap.add_argument("--ms", default="2,4,8,16", help="token counts, comma-separated (2-128)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", help="NxK,... (default: %s)" % ",".join(f"{n}x{k}" for n, k in NKS))
    ap.add_argument("--label", help="write the runs under this key of the --out file (kept: the other keys)")
    ap.add_argument("--swap", action="store_true", help="past 16 tokens also the swapped-operand kernel's settings")
    ap.add_argument("--wgmma", action="store_true", help="also the Gluon wgmma kernel's settings (wgmma=True)")
    ap.add_argument("--no-chunks", action="store_true", help="past 16 tokens skip the CHUNK_TILES settings")


def main(argv=None) -> None:
    args = sweep_args(__doc__, "benchmarks/results/sweep_w4a16_frag_h200.json", None, argv, _extra)
    if args is None:
        sys.exit(1)
    dev, runs = "cuda", []
    sms = num_sms(torch.device(dev))
    for n, k in _shape_list(args.shapes):
        sets = _sets(n, k, dev, bf16=True)
        counters = torch.zeros(n, dtype=torch.int32, device=dev)  # kept: every launch leaves them at zero
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = w4a16_gemm_reference(x, sets[0]["p4"], sets[0]["s4"], GROUP).float()
            fns = {"tinygemm": lambda: [torch.ops.aten._weight_int4pack_mm(x, s["tiny"][0], GROUP, s["tiny"][1])
                                        for s in sets]}
            errors = {}

            def frag(stream=False, attrs=None, weights=sets):
                def run():
                    with module_attrs(fragments, attrs or {}):
                        return [_frag_launch(x, s["p4"], s["s4"], y, GROUP, counters, False, stream=stream)
                                for s in weights]
                return run

            def swap(weights=sets, **form):
                def run():
                    return [_swap_launch(x, s["p4"], s["s4"], y, GROUP, counters, False, **form) for s in weights]
                return run

            def wgmma(weights=sets, **form):
                xw = permute_x(x) if form.get("permuted") else x

                def run():
                    return [wgmma_launch(xw, s["p4"], s["s4"], y, GROUP, counters, sms, **form) for s in weights]
                return run

            settings = {"plain": (frag, {}), "stream": (frag, {"stream": True})}
            if m > 16 and not args.no_chunks:
                settings.update({chunk_tile_name(c): (frag, {"attrs": chunk_tile_attrs(c)}) for c in CHUNK_TILES[1:]})
            if m > 16 and args.swap:
                settings.update({name: (swap, form) for name, form in swap_settings(m, n, k).items()})
            if args.wgmma:
                settings.update({name: (wgmma, form) for name, form in wgmma_settings(m, n, k, sms).items()})
            for name, (make, form) in settings.items():
                y.fill_(float("nan"))
                make(**form, weights=sets[:1])()  # checked on the first set, the reference's
                errors[name] = rel_err(y, ref)
                fns[name] = make(**form)
            fns["tiles"] = lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, fragments=False) for s in sets]
            errors["tiles"] = rel_err(fns["tiles"]()[0], ref)
            fns["bf16"] = lambda: [x @ s["w"].T for s in sets]
            rows = timing_rows(interleaved_graph_us(fns, reps=len(sets), rounds=args.rounds), errors, n, k)
            bf16_us = next((r.get("median_us") for r in rows if r["setting"] == "bf16"), None)
            for r in rows:
                if bf16_us and r.get("median_us"):
                    r["vs_bf16"] = round(bf16_us / r["median_us"], 3)
            print(f"{m} x {n} x {k}: " + "  ".join(f"{r['setting']} {r.get('median_us')} µs (x{r.get('vs_tinygemm')} "
                                                   f"tinygemm, x{r.get('vs_bf16')} bf16, err {r['rel_err']})"
                                                   for r in rows), flush=True)
            runs.append({"M": m, "N": n, "K": k, "sets": len(sets), "rows": rows})
        del sets
        torch.cuda.empty_cache()
        _write(args, runs, __doc__.splitlines()[0])
    print("wrote", args.out)


if __name__ == "__main__":
    main()
