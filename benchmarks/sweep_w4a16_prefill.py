"""W4A16 past decode: the tiles that dequantize in their main loop against dequantizing the whole weight first
(``int4_dequantize``, then cuBLAS), beside bf16 and FP8-block weights, to place ``DEQUANT_GEMM_MIN_M`` in one GPU call.

    python -m benchmarks.sweep_w4a16_prefill [--tokens 32,64,96,128,192,256,512,2048] [--rounds 3] [--per-layer]
        [--out benchmarks/results/sweep_w4a16_prefill_h200.json] [--label NAME]

The stack of bench ``prefill`` (one Kimi K2.6 dense layer's eight projections, 497 M weights, each fed its own bf16
activations) as ``QuantLinear`` layers. Per token count, in interleaved rounds (``common.interleaved_graph_us``), the
whole stack per setting:

- ``int4_tiles``: ``Int4Group(32)`` with ``dequant_gemm=False`` — the autotuned tiles that dequantize in registers;
- ``int4_dequant``: ``dequant_gemm=True`` — ``int4_dequantize`` to bf16, then ``torch.mm``;
- ``int4_default``: ``w4a16_gemm``'s defaults (``dequant_gemm="auto"``);
- ``dequant_only``: the eight ``int4_dequantize`` calls alone (what ``int4_dequant`` adds to cuBLAS);
- ``bf16``: the same weights in bf16, cuBLAS;
- ``fp8_block``: W8A8 FP8 block weights (the prefill recipe's format).

Each row gives the median µs per stack, each setting's time over bf16's and over fp8_block's, TFLOP/s, and the
dequantization's rate against the copy rate of the same run. ``--per-layer`` adds the three INT4 settings and bf16
per projection (its own graphs), where the crossover may differ with the shape. Every INT4 setting is checked
against ``w4a16_gemm_reference`` on each projection (max error over max |reference|).
"""
from __future__ import annotations

import json
import statistics

import torch

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.kernels.int4_quant import int4_dequantize
from mla_quant.kernels.w4a16_gemm import DEQUANT_GEMM_MIN_M, w4a16_gemm, w4a16_gemm_reference

from .bench_prefill import KIMI_DENSE_LAYER, _stack
from .common import interleaved_graph_us, measured_context, meta, rel_err, sweep_args, write_labelled

TOKENS = (32, 64, 96, 128, 192, 256, 512, 2048)
INT4_SETTINGS = {"int4_tiles": {"dequant_gemm": False}, "int4_dequant": {"dequant_gemm": True}, "int4_default": {}}
N_WEIGHTS = sum(k * n for _, k, n in KIMI_DENSE_LAYER)


def _extra(ap) -> None:
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-layer", action="store_true", help="also each projection on its own")
    ap.add_argument("--label", default=None, help="write the run under this key of the --out file (others kept)")


def _weight(lin) -> tuple:
    """An ``Int4Group`` layer's (weight_packed, weight_scale, group_size)."""
    return lin.tensors["weight_packed"], lin.tensors["weight_scale"], lin.fmt.group_size


def _int4(lin, x, **form):
    return w4a16_gemm(x, *_weight(lin), **form)


def _row(tokens: int, us: dict, nweights: int, copy_tbps: float) -> dict:
    med = {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in us.items()}
    timed = {k: v for k, v in med.items() if isinstance(v, float)}
    row = {"tokens": tokens, "us": med, "rounds": us}
    for peer in ("bf16", "fp8_block"):
        if isinstance(med.get(peer), float):
            row[f"time_vs_{peer}"] = {k: round(v / med[peer], 3) for k, v in timed.items()}
    row["tflops"] = {k: round(2 * tokens * nweights / v / 1e6, 1) for k, v in timed.items() if k != "dequant_only"}
    if "dequant_only" in timed:  # codes and scales read, the bf16 weight written
        tbps = nweights * (0.5 + 2 / 32 + 2) / timed["dequant_only"] / 1e6
        row["dequant_tbps"], row["dequant_frac_of_copy"] = round(tbps, 3), round(tbps / copy_tbps, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    args = sweep_args(__doc__, "benchmarks/results/sweep_w4a16_prefill_h200.json", None, argv, _extra)
    if args is None:
        return 1
    ctx = measured_context()
    dev = "cuda"
    result = {"meta": meta(ctx), "about": __doc__.splitlines()[0], "dequant_gemm_min_m": DEQUANT_GEMM_MIN_M,
              "rows": [], "per_layer": []}
    with torch.inference_mode():
        stacks = {"int4": _stack(Int4Group(32), dev), "bf16": _stack(BF16(), dev), "fp8_block": _stack(FP8Block(), dev)}
        for t in (int(v) for v in args.tokens.split(",")):
            xs = [torch.randn(t, k, device=dev, dtype=torch.bfloat16) for _, k, _ in KIMI_DENSE_LAYER]

            def int4_stack(**form):
                return lambda: [_int4(lin, x, **form) for lin, x in zip(stacks["int4"], xs)]

            fns = {name: int4_stack(**form) for name, form in INT4_SETTINGS.items()}
            fns["dequant_only"] = lambda: [int4_dequantize(*_weight(lin), torch.bfloat16) for lin in stacks["int4"]]
            for name in ("bf16", "fp8_block"):
                fns[name] = (lambda layers: lambda: [lin(x) for lin, x in zip(layers, xs)])(stacks[name])
            row = _row(t, interleaved_graph_us(fns, rounds=args.rounds), N_WEIGHTS, ctx.copy_tbps)
            row["err_vs_reference"] = {}
            for name in INT4_SETTINGS:
                ys = fns[name]()
                row["err_vs_reference"][name] = max(rel_err(y, w4a16_gemm_reference(x, *_weight(lin)))
                                                    for y, x, lin in zip(ys, xs, stacks["int4"]))
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
            if args.per_layer:
                for (name, k, n), x, q, b in zip(KIMI_DENSE_LAYER, xs, stacks["int4"], stacks["bf16"]):
                    fns = {s: (lambda form: lambda: _int4(q, x, **form))(form) for s, form in INT4_SETTINGS.items()}
                    fns["bf16"] = lambda: b(x)
                    prow = _row(t, interleaved_graph_us(fns, rounds=args.rounds), k * n, ctx.copy_tbps)
                    prow.update(layer=name, in_features=k, out_features=n)
                    result["per_layer"].append(prow)
                    print(json.dumps({kk: v for kk, v in prow.items() if kk != "rounds"}), flush=True)
            write_labelled(args.out, result, args.label)  # after every token count: a stopped run keeps its rows
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
