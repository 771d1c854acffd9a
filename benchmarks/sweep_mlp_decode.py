"""One token through a SwiGLU MLP with INT4 weights (``MLP`` of ``Int4Group`` projections), against the same MLP on
tinygemm and in BF16, in interleaved CUDA-graph rounds; and its down projection alone.

    python -m benchmarks.sweep_mlp_decode [--rounds 5] [--shapes 7168x2048,7168x18432,6144x12288]
        [--out benchmarks/results/sweep_mlp_decode_h200.json] [--label NAME]

Shapes are hidden x intermediate: Kimi K2.6's shared expert (7168 x 2048) and dense MLP (7168 x 18432), GLM 5.2's
dense MLP (6144 x 12288). Group 32, bf16. Each graph holds one call per weight set, over enough sets to miss L2.
Settings:

- ``int4_mlp``: ``MLP.forward`` as a model calls it — gate and up in one launch (``w4a16_swiglu_gemv``: both GEMVs
  and h = silu(gate) · up), then the down GEMV on h; weights read before each GEMV's PDL wait (``prefetch_weights``,
  from a layer's second call).
- ``int4_mlp_pairs``: the same module with ``mlp.GATE_UP_IN_ONE_LAUNCH`` off — gate and up GEMVs, h put in pair
  order by ``swiglu_pair_order``, the down GEMV on those pairs (``QuantLinear`` on ``PairedActivations``).
- ``int4_mlp_eager_swiglu``: both off (``F.silu(gate) * up`` in two eager launches, the down GEMV putting h in pair
  order itself), the path before session 39.
- ``tinygemm_mlp``: ``torch._weight_int4pack_mm`` for the three projections with the eager SwiGLU (the peer).
- ``bf16_mlp``: three cuBLAS ``F.linear`` with the eager SwiGLU.
- ``gate_up_one_launch`` / ``gate_up_two`` / ``gate_up_tinygemm``: gate, up and the SwiGLU alone — in one launch, as
  two ``w4a16_gemm`` calls and ``swiglu_pair_order`` (the pairs path's first three launches), and on tinygemm with
  the eager SwiGLU.
- ``down_pairs`` / ``down_x`` / ``down_tinygemm``: the down projection alone — on pairs made once
  (``w4a16_gemv_pairs``), on h (``w4a16_gemm``, both with ``prefetch_weights``), and tinygemm; ``swiglu_pairs`` /
  ``swiglu_eager``: the SwiGLU alone, into pairs or in two eager launches.

Each setting is checked first against the BF16-exact reference of its own weights (max error over max |y|). Rows
give the median µs, the INT4 weights' bytes per second and its fraction of the copy rate measured in the same run
(MLP rows: all three projections; down rows: the down projection), and the ratio to the same-round peer
(``tinygemm_mlp`` or ``down_tinygemm``).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from mla_quant.formats import Int4Group
from mla_quant.kernels.w4a16_gemm import swiglu_pair_order, w4a16_gemm, w4a16_gemv_pairs, w4a16_swiglu_gemv
from mla_quant.modules import mlp as mlp_module
from mla_quant.modules.mlp import MLP

from .bench_gemm import _tinygemm_pack
from .common import L2_BYTES, interleaved_graph_us, measured_context, module_attrs, rel_err, sweep_args
from .sweep_w4a16_gemv import _write

GROUP = 32
SHAPES = ((7168, 2048), (7168, 18432), (6144, 12288))


def _extra(ap) -> None:
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=None, help="HIDDENxINTERMEDIATE,... (default: %s)"
                    % ",".join(f"{h}x{i}" for h, i in SHAPES))
    ap.add_argument("--label", default=None, help="write the runs under this key of the --out file (others kept)")


def _int4_bytes(n: int, k: int) -> int:
    return n * k // 2 + 2 * n * k // GROUP


def _sets(hidden: int, inter: int, dev: str) -> list[dict]:
    """Weight sets, each an INT4 MLP (random weights, std 0.02), its tinygemm operands and BF16 weights."""
    count = max(2, -(-3 * L2_BYTES // (3 * _int4_bytes(hidden, inter))))
    out = []
    for _ in range(count):
        mlp = MLP(hidden, inter, fmt=Int4Group(group_size=GROUP), device=dev)
        for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            proj.set_weight(torch.randn(proj.out_features, proj.in_features, device=dev) * 0.02)
        bf16 = {name: getattr(mlp, name).weight_dequantized(torch.bfloat16) for name in ("gate_proj", "up_proj",
                                                                                            "down_proj")}
        tiny = {"gate_proj": _tinygemm_pack(inter, hidden, dev), "up_proj": _tinygemm_pack(inter, hidden, dev),
                "down_proj": _tinygemm_pack(hidden, inter, dev)}
        out.append({"mlp": mlp, "bf16": bf16, "tiny": tiny})
    return out


def _tiny(x, packed):
    return torch.ops.aten._weight_int4pack_mm(x, packed[0], GROUP, packed[1])


def main(argv=None) -> None:
    args = sweep_args(__doc__, "benchmarks/results/sweep_mlp_decode_h200.json", None, argv, _extra)
    if args is None:
        sys.exit(1)
    dev = "cuda"
    ctx = measured_context()
    shapes = SHAPES if not args.shapes else tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    runs = []
    for hidden, inter in shapes:
        sets = _sets(hidden, inter, dev)
        x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
        g0 = torch.randn(1, inter, device=dev, dtype=torch.bfloat16) * 2
        u0 = torch.randn(1, inter, device=dev, dtype=torch.bfloat16)
        pairs = swiglu_pair_order(g0, u0)
        h0 = F.silu(g0) * u0
        y = torch.empty(1, hidden, device=dev, dtype=torch.bfloat16)

        def paths(s, **flags):
            with module_attrs(mlp_module, flags):
                return s["mlp"](x)

        def tiny_mlp(s):
            t = s["tiny"]
            return _tiny(F.silu(_tiny(x, t["gate_proj"])) * _tiny(x, t["up_proj"]), t["down_proj"])

        def bf16_mlp(s):
            w = s["bf16"]
            return F.linear(F.silu(F.linear(x, w["gate_proj"])) * F.linear(x, w["up_proj"]), w["down_proj"])

        def t(s, proj):
            return s["mlp"].get_submodule(proj).tensors

        def gate_up_two(s):
            g, u = (w4a16_gemm(x, t(s, p)["weight_packed"], t(s, p)["weight_scale"], GROUP, prefetch_weights=True)
                    for p in ("gate_proj", "up_proj"))
            return swiglu_pair_order(g, u)

        launches = {
            "int4_mlp": lambda s: s["mlp"](x),
            "int4_mlp_pairs": lambda s: paths(s, GATE_UP_IN_ONE_LAUNCH=False),
            "int4_mlp_eager_swiglu": lambda s: paths(s, GATE_UP_IN_ONE_LAUNCH=False, SWIGLU_PAIRS=False),
            "tinygemm_mlp": tiny_mlp,
            "bf16_mlp": bf16_mlp,
            "gate_up_one_launch": lambda s: w4a16_swiglu_gemv(
                x, t(s, "gate_proj")["weight_packed"], t(s, "gate_proj")["weight_scale"],
                t(s, "up_proj")["weight_packed"], t(s, "up_proj")["weight_scale"], GROUP, prefetch_weights=True),
            "gate_up_two": gate_up_two,
            "gate_up_tinygemm": lambda s: F.silu(_tiny(x, s["tiny"]["gate_proj"])) * _tiny(x, s["tiny"]["up_proj"]),
            "down_pairs": lambda s: w4a16_gemv_pairs(*pairs, t(s, "down_proj")["weight_packed"],
                                                     t(s, "down_proj")["weight_scale"], GROUP, out=y,
                                                     prefetch_weights=True),
            "down_x": lambda s: w4a16_gemm(h0, t(s, "down_proj")["weight_packed"], t(s, "down_proj")["weight_scale"],
                                           GROUP, out=y, prefetch_weights=True),
            "down_tinygemm": lambda s: _tiny(h0, s["tiny"]["down_proj"]),
            "swiglu_pairs": lambda s: swiglu_pair_order(g0, u0),
            "swiglu_eager": lambda s: F.silu(g0) * u0,
        }
        # checks: the INT4 forms against the BF16 math of the same (dequantized) weights; a form that raises is a
        # finding, recorded as its error (interleaved_graph_us records its error too)
        s0, errors = sets[0], {}
        w = s0["bf16"]
        ref_h = F.silu(F.linear(x.float(), w["gate_proj"].float())) * F.linear(x.float(), w["up_proj"].float())
        ref_mlp = F.linear(ref_h.bfloat16().float(), w["down_proj"].float())
        ref_down = F.linear(h0.float(), w["down_proj"].float())
        for name, want in (("int4_mlp", ref_mlp), ("int4_mlp_pairs", ref_mlp), ("int4_mlp_eager_swiglu", ref_mlp),
                           ("bf16_mlp", ref_mlp), ("gate_up_one_launch", ref_h), ("down_pairs", ref_down),
                           ("down_x", ref_down)):
            try:
                y.fill_(float("nan"))
                got = launches[name](s0)
                errors[name] = rel_err(y if name.startswith("down") else got, want)
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {e}"[:300]
        fns = {name: (lambda f=f: [f(s) for s in sets]) for name, f in launches.items()}
        rounds = interleaved_graph_us(fns, reps=len(sets), rounds=args.rounds)
        rows = _rows(rounds, errors, hidden, inter, ctx.copy_tbps)
        print(f"\n{hidden} x {inter}: {len(sets)} weight sets")
        for rw in rows:
            print(f"  {rw['setting']:<24} {rw.get('median_us')} µs  {rw.get('tbps')} TB/s "
                  f"({rw.get('frac_of_copy')} of copy)  x{rw.get('vs_peer')} peer  err {rw.get('rel_err')}")
        runs.append({"hidden": hidden, "intermediate": inter, "sets": len(sets), "rows": rows})
        del sets
        torch.cuda.empty_cache()
        _write(args, runs, __doc__.splitlines()[0], ctx)
    print("wrote", args.out)


def _rows(rounds: dict, errors: dict, hidden: int, inter: int, copy_tbps: float) -> list[dict]:
    """One row per setting: its rounds or error, check, median µs, INT4 weight bytes per second (and fraction of
    copy) where it reads INT4 weights, and the ratio to its same-round peer."""
    med = {n: sorted(r)[len(r) // 2] for n, r in rounds.items() if isinstance(r, list)}
    rows = []
    for name, r in rounds.items():
        row = {"setting": name, "rounds_us": r if isinstance(r, list) else None,
               "error": r if isinstance(r, str) else None, "rel_err": errors.get(name)}
        if name in med:
            row["median_us"] = round(med[name], 3)
            mlp = name.startswith(("int4_mlp", "tinygemm_mlp", "bf16_mlp"))
            peer = ("tinygemm_mlp" if mlp else "down_tinygemm" if name.startswith("down")
                    else "gate_up_tinygemm" if name.startswith("gate_up") else None)
            if name.startswith(("int4", "down_pairs", "down_x", "gate_up_one", "gate_up_two")):
                nbytes = (3 if mlp else 2 if name.startswith("gate_up") else 1) * _int4_bytes(hidden, inter)
                row["tbps"] = round(nbytes / (med[name] * 1e-6) / 1e12, 3)
                if copy_tbps:
                    row["frac_of_copy"] = round(row["tbps"] / copy_tbps, 3)
            if peer in med:
                row["vs_peer"] = round(med[peer] / med[name], 3)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
