"""INT4 experts between one-token decode and prefill: the GEMV (``block_m == 1``) against the 16-row tensor-core tile,
and FP8-block experts, at 8-256 Kimi tokens, to place ``choose_block_m``'s switch in one GPU call.

    python -m benchmarks.sweep_moe_rows [--tokens 8,16,24,32,48,64,96,128,192,256] [--rounds 3] [--bf16] [--frag-tiles]
        [--out benchmarks/results/sweep_moe_rows_h200.json] [--label NAME]

Kimi widths (384 experts, hidden 7168, expert 2048, top-8), the bench ``moe``'s random experts and its 8 routings per
CUDA graph. Per token count, in interleaved rounds (``common.interleaved_graph_us``):

- ``int4_gemv``: ``fused_moe(..., block_m=1)`` — one GEMV program per (expert, token) row; above one token the rows
  are aligned by expert (``moe_align``), so the rows of one expert run side by side and share its weights in L2;
- ``int4_gemv_direct``: the same without alignment (``decode_fusion=True``: program m takes assignment m);
- ``int4_tile16``: ``block_m=16`` — the plane tile (``int4_tile="planes"``) on the tensor cores, each expert's
  weights unpacked once per 16 rows;
- ``int4_frag8`` / ``int4_frag16``: ``int4_tile="fragments"`` at ``block_m`` 8 / 16 — each aligned block's rows
  as the token columns of ``mma.sync`` on weight fragments built in registers (``fragments._moe_frag_block_kernel``);
  ``--frag-tiles`` adds ``int4_frag16`` at each tile of ``FRAG_TILES`` (``int4_frag16_bk{BK}w{warps}[_noprefetch]``);
- ``int4_default``: ``fused_moe``'s defaults (``block_m`` from ``choose_block_m``, ``int4_tile="auto"``);
- ``fp8_block``: FP8-block experts at their default ``block_m`` (16 here), the format INT4 must beat;
- ``bf16`` (``--bf16``): BF16 experts at their default.

Each row gives the median µs per MoE call, the rows per active expert, the bytes of the active experts' weights and
their rate against the copy rate of the same run, each setting's time over FP8's, and which ``block_m``
``choose_block_m`` takes now. Every INT4 setting, each fragment tile included, is checked against
``fused_moe_reference`` on the first routing (max error over max |reference|). The MoE autotuners key on the widths,
not the token count: every tile is picked at the first token count of the run.
"""
from __future__ import annotations

import json
import statistics

import torch

from mla_quant.kernels.fused_moe import choose_block_m, fused_moe, fused_moe_reference
from mla_quant.kernels.fused_moe import fragments as frag
from mla_quant.modules.experts import kernel_args

from .bench_moe import E, FORMATS, HIDDEN, SETS, TOP_K, _expert_bytes, _random_experts, _routings
from .common import (interleaved_graph_us, measured_context, meta, module_attrs, rel_err, sweep_args,
                     write_labelled)

TOKENS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
INT4_SETTINGS = {"int4_gemv": {"block_m": 1}, "int4_gemv_direct": {"block_m": 1, "decode_fusion": True},
                 "int4_tile16": {"block_m": 16}, "int4_frag8": {"block_m": 8, "int4_tile": "fragments"},
                 "int4_frag16": {"block_m": 16, "int4_tile": "fragments"}, "int4_default": {}}
# --frag-tiles: (BK, warps, PREFETCH) of both fragment-block launches (fragments.MOE_FRAG_BLOCK_TILES), at 16 rows
FRAG_TILES = ((256, 4, True), (128, 8, True), (128, 4, False), (256, 8, True))


def _extra(ap) -> None:
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also BF16 experts (33.8 GB more on the device)")
    ap.add_argument("--frag-tiles", action="store_true", help="int4_frag16 at each tile of FRAG_TILES too")
    ap.add_argument("--label", default=None, help="write the run under this key of the --out file (others kept)")


def frag_tile_name(tile) -> str:
    bk, warps, prefetch = tile
    return f"int4_frag16_bk{bk}w{warps}" + ("" if prefetch else "_noprefetch")


def frag_tile_setting(fn, tile):
    """``fn`` with both fragment-block launches on ``tile`` (the module's tiles as before once it returns)."""
    def run():
        with module_attrs(frag, {"MOE_FRAG_BLOCK_TILES": {"gate_up": tile, "down": tile}}):
            return fn()
    return run


def token_row(tokens: int, us: dict, active: float, errors: dict, copy_tbps: float) -> dict:
    """One token count's row: median µs per setting (or its error message), each setting's time over FP8's, the
    active experts' weight bytes per second and the fraction of the copy rate."""
    med = {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in us.items()}
    row = {"tokens": tokens, "rows_per_active_expert": round(tokens * TOP_K / active, 3), "active_experts": active,
           "block_m_now": choose_block_m(tokens * TOP_K, E, "int4_group"), "us": med, "rounds": us,
           "err_vs_reference": errors}
    fp8 = med.get("fp8_block")
    timed = {k: v for k, v in med.items() if isinstance(v, float)}
    if isinstance(fp8, float):
        row["time_vs_fp8"] = {k: round(v / fp8, 3) for k, v in timed.items()}
    row["weight_tbps"] = {k: round(active * _expert_bytes("int4_g32" if k.startswith("int4") else k) / v / 1e6, 3)
                          for k, v in timed.items()}
    row["frac_of_copy"] = {k: round(v / copy_tbps, 3) for k, v in row["weight_tbps"].items()}
    return row


def main(argv: list[str] | None = None) -> int:
    args = sweep_args(__doc__, "benchmarks/results/sweep_moe_rows_h200.json", None, argv, _extra)
    if args is None:
        return 1
    ctx = measured_context()
    dev = "cuda"
    names = ["int4_g32", "fp8_block"] + (["bf16"] if args.bf16 else [])
    result = {"meta": meta(ctx), "about": __doc__.splitlines()[0], "rows": []}
    with torch.inference_mode():
        experts = {name: _random_experts(name, dev)[0] for name in names}
        for t in (int(v) for v in args.tokens.split(",")):
            routings = _routings(t, dev)
            xs = [torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]
            active = sum(ids.unique().numel() for _, ids in routings) / SETS

            def routed(name, **form):
                def fn():
                    p = experts[name]
                    return [fused_moe(x, w, ids, p["gate_proj"], p["up_proj"], p["down_proj"],
                                      **kernel_args(FORMATS[name]), **form) for x, (w, ids) in zip(xs, routings)]
                return fn

            fns = {k: routed("int4_g32", **form) for k, form in INT4_SETTINGS.items()}
            for tile in (FRAG_TILES if args.frag_tiles else ()):
                fns[frag_tile_name(tile)] = frag_tile_setting(routed("int4_g32", **INT4_SETTINGS["int4_frag16"]), tile)
            int4 = [k for k in fns if k.startswith("int4")]
            fns.update({name: routed(name) for name in names if name != "int4_g32"})
            rounds = interleaved_graph_us(fns, reps=SETS, rounds=args.rounds)
            # every INT4 setting (its tile included) checked on the first routing: fns[k]() returns one result per
            # routing
            p = experts["int4_g32"]
            ref = fused_moe_reference(xs[0], *routings[0], p["gate_proj"], p["up_proj"], p["down_proj"],
                                      kind="int4_group")
            errors = {k: rel_err(fns[k]()[0], ref) for k in int4}
            row = token_row(t, rounds, active, errors, ctx.copy_tbps)
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    write_labelled(args.out, result, args.label)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
