"""Sweep of the 2-16-token W4A16 fragment kernel (``w4a16_gemm(..., fragments=True)``, ``fragments.py``) with its
weights loaded plainly and streamed past L1 (``fragments.STREAM_WEIGHTS``), against tinygemm, in interleaved
CUDA-graph rounds.

    python -m benchmarks.sweep_w4a16_frag [--ms 2,4,8,16] [--shapes 4096x7168,...] [--rounds 5] [--label NAME]
        [--out benchmarks/results/sweep_w4a16_frag_h200.json]

For each M and N×K (group 32, bf16 x and scales) one graph per setting holds one call per weight set, over enough
sets to miss L2 (``sweep_w4a16_gemv._sets``), all with the same x: ``tinygemm`` (the peer), ``plain`` and
``stream`` (the kernel with kept split-K counters, as QuantLinear launches it). Each setting is first checked against
``w4a16_gemm_reference`` (max error over max |y| into a NaN-poisoned y). With ``--label`` the runs go under that key
of an existing results file (written after each shape).
"""
from __future__ import annotations

import sys

import torch

from mla_quant.kernels.w4a16_gemm import _frag_launch, w4a16_gemm_reference

from .common import interleaved_graph_us, rel_err, sweep_args
from .sweep_w4a16_gemv import GROUP, NKS, _sets, _shape_list, _write, timing_rows


def _extra(ap) -> None:
    ap.add_argument("--ms", default="2,4,8,16", help="token counts, comma-separated (2-16)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", help="NxK,... (default: %s)" % ",".join(f"{n}x{k}" for n, k in NKS))
    ap.add_argument("--label", help="write the runs under this key of the --out file (kept: the other keys)")


def main(argv=None) -> None:
    args = sweep_args(__doc__, "benchmarks/results/sweep_w4a16_frag_h200.json", None, argv, _extra)
    if args is None:
        sys.exit(1)
    dev, runs = "cuda", []
    for n, k in _shape_list(args.shapes):
        sets = _sets(n, k, dev)
        counters = torch.zeros(n, dtype=torch.int32, device=dev)  # kept: every launch leaves them at zero
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = w4a16_gemm_reference(x, sets[0]["p4"], sets[0]["s4"], GROUP).float()
            fns = {"tinygemm": lambda: [torch.ops.aten._weight_int4pack_mm(x, s["tiny"][0], GROUP, s["tiny"][1])
                                        for s in sets]}
            errors = {}
            for name, stream in (("plain", False), ("stream", True)):
                y.fill_(float("nan"))
                _frag_launch(x, sets[0]["p4"], sets[0]["s4"], y, GROUP, counters, False, stream=stream)
                errors[name] = rel_err(y, ref)
                fns[name] = lambda stream=stream: [_frag_launch(x, s["p4"], s["s4"], y, GROUP, counters, False,
                                                                stream=stream) for s in sets]
            rows = timing_rows(interleaved_graph_us(fns, reps=len(sets), rounds=args.rounds), errors, n, k)
            print(f"{m} x {n} x {k}: " + "  ".join(f"{r['setting']} {r.get('median_us')} µs (x{r.get('vs_tinygemm')}, "
                                                   f"err {r['rel_err']})" for r in rows), flush=True)
            runs.append({"M": m, "N": n, "K": k, "sets": len(sets), "rows": rows})
        del sets
        torch.cuda.empty_cache()
        _write(args, runs, __doc__.splitlines()[0])
    print("wrote", args.out)


if __name__ == "__main__":
    main()
