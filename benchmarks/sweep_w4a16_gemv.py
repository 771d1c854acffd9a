"""Sweep of the whole-row one-token W4A16 GEMV (``w4a16_gemm(..., gemv="rows")``) against tinygemm and the
split-K plane GEMV (``gemv="planes1"``) and ``w4a16_gemm``'s default (``default``; ``default_prefetch``: with
``prefetch_weights=True``), in interleaved CUDA-graph rounds.

    python -m benchmarks.sweep_w4a16_gemv [--rounds 3] [--out benchmarks/results/sweep_w4a16_gemv_h200.json]
        [--shapes 4096x7168,7168x18432] [--forms rows,half2] [--pdl-only] [--label NAME]

For each N×K (group 32, bf16 x and scales) one graph per setting holds one call per weight set, over enough sets
to miss L2 (as ``bench_gemm``), all with the same x. Settings: ``tinygemm`` (the peer), ``planes1`` (the bare
call: its split-K counters zeroed by a fill launch) and ``planes1_ws`` (kept counters), then the rows kernel at
each tile (BN rows per program, BKW words per K chunk, warps, PIPE: the chunks pipelined) launched plainly and
with PDL (``pdl``: each call's weights loaded before it waits for the call before — consecutive GEMVs overlap).
Each setting is first checked against ``w4a16_gemm_reference`` (max error over max |y|, bf16 output). ``half2`` settings time the
fp16x2 rows GEMV (``gemv="rows_half2"``, ``gemv_half2.py``) at each of ``HALF2_TILES`` together with its pair-order
launch, both with PDL as ``prefetch_weights`` launches them (``half2 ... gemv only``: the GEMV on pairs made once,
what a producer that wrote pair order would leave). ``spans`` settings time the rows kernel with each row in
power-of-two spans (``gemv.row_spans``) at each of ``SPAN_TILES``, with PDL; ``half2spans`` the half2 GEMV so
(``HALF2_SPAN_TILES``, with and without the pair-order launch); ``stream`` both GEMVs' rule tiles with plain and with
streamed weight loads (``stream=``: past L1), with PDL (the half2 tile also as ``gemv only`` and ``inline``), and
``w4a16_gemm`` with each GEMV form pinned, plainly and with ``prefetch_weights`` (the half2 form also with its
pair_order launch; session 33's ``hints`` / ``half2hints`` runs timed more variants: commit 900e38f). Since session 37
each half2 tile is also timed ``inline`` (the GEMV on x itself, which it puts in pair order: ``half2_launch_x``, what
``w4a16_gemm`` launches for an aligned x) with PDL and, unless ``--pdl-only``, plainly. A ``--forms`` naming none of
these times only tinygemm and ``default_prefetch`` (with ``--pdl-only``). Writes every round's µs, the weights' bytes
per second and (since session 38) their fraction of the copy rate measured at the start of the run; with ``--label``
the shapes' runs go under that key of an existing results file (written after each shape).
"""
from __future__ import annotations

import itertools
import sys

import torch

from mla_quant.kernels._half2_gemv import pair_order
from mla_quant.kernels.int4_quant import int4_quantize
from mla_quant.kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_reference
from mla_quant.kernels.w4a16_gemm.gemv import gemv_launch, gemv_tile
from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_launch, half2_launch_x
from mla_quant.kernels import w4a16_gemm as W

from .bench_gemm import _tinygemm_pack
from .common import (L2_BYTES, Context, interleaved_graph_us, measured_context, meta, module_attrs, rel_err, sweep_args,
                     write_labelled)

GROUP = 32
NKS = ((2048, 7168), (4096, 7168), (7168, 2048))
PDL = {"PDL": 1, "launch_pdl": True}
# (BN, BKW, warps, PIPE); a BKW of 0 stands for the row's words rounded up to a power of two (one chunk)
TILES = (tuple(itertools.product((4, 8, 16, 32), (0,), (2, 4, 8), (False,)))
         + ((2, 0, 1, False), (4, 0, 1, False), (8, 0, 1, False))
         + ((8, 128, 4, True), (8, 256, 4, True), (16, 128, 4, True), (16, 256, 4, True), (16, 256, 8, True),
            (8, 128, 2, True), (4, 256, 4, True), (32, 128, 8, True), (8, 512, 4, True), (16, 64, 4, True),
            (32, 64, 4, True)))
# rows of more than 1024 words (K = 12288, 18432): pipelined chunks only (one chunk would spill)
LONG_TILES = ((4, 512, 4, True), (8, 256, 4, True), (8, 256, 8, True), (8, 512, 4, True), (8, 512, 8, True),
              (16, 256, 8, True), (16, 512, 8, True), (8, 1024, 8, True), (4, 1024, 4, True), (32, 128, 8, True))
# (BN, warps) of the rows kernel with the row in power-of-two spans (gemv.row_spans: 896 words = 512 + 256 + 128,
# all loaded first; --forms spans), where a one-chunk tile carries 128 masked words of 1024
SPAN_TILES = ((8, 4), (4, 2), (4, 4), (8, 2), (8, 8), (16, 4), (16, 8), (2, 1), (4, 1), (2, 2), (8, 1), (1, 1))
# (BN, warps) of the half2 GEMV with the row's runs in power-of-two spans (224 runs = 128 + 64 + 32; --forms
# half2spans; sm_90 static: 0.073-0.088 warp-instructions per weight on one or two warps, no spills)
HALF2_SPAN_TILES = ((2, 1), (4, 1), (1, 1), (4, 2), (8, 1))
# (BN, BR runs, warps, PIPE) of the half2 GEMV; a BR of 0: the row's runs rounded up to a power of two (one chunk)
HALF2_TILES = ((4, 0, 2, False), (4, 0, 4, False), (8, 0, 4, False), (8, 0, 8, False), (16, 0, 8, False),
               (8, 128, 4, True), (8, 64, 4, True), (8, 32, 4, True), (16, 64, 4, True), (16, 32, 4, True),
               (4, 64, 2, True), (8, 128, 8, True), (16, 128, 8, True), (32, 32, 8, True), (8, 64, 2, True),
               (4, 128, 4, True), (4, 32, 2, True), (8, 32, 2, True), (32, 64, 8, True), (16, 16, 2, True),
               (64, 32, 8, True), (16, 32, 8, True),
               (1, 0, 1, False), (2, 0, 1, False), (2, 128, 1, True), (4, 64, 1, True), (8, 32, 1, True))


def _tiles(k: int) -> list[tuple]:
    """TILES for rows of K: the one-chunk tiles at the row's width, the pipelined ones whose chunks split the row;
    LONG_TILES for rows of more than 1024 words."""
    words = 1 << (k // 8 - 1).bit_length()
    if words > 1024:
        return list(LONG_TILES)
    return [(bn, bkw or words, warps, pipe) for bn, bkw, warps, pipe in TILES if not pipe or bkw <= words // 2]


def _half2_tiles(k: int) -> list[tuple]:
    """HALF2_TILES for rows of K runs: at most 16 elements (64 words) per thread in one chunk, 8 per pipelined
    chunk (two in flight), the pipelined chunks splitting the row."""
    runs = 1 << (k // 32 - 1).bit_length()
    out = []
    for bn, br, warps, pipe in HALF2_TILES:
        br = br or runs
        per_thread = bn * br // (32 * warps)
        if (pipe and br <= runs // 2 and per_thread <= 8) or (not pipe and br == runs and per_thread <= 16):
            out.append((bn, br, warps, pipe))
    return out


def _sets(n: int, k: int, dev: str, bf16: bool = False) -> list[dict]:
    """Enough INT4 weight sets (``p4`` / ``s4``, and tinygemm's ``tiny``) to miss L2; ``bf16``: each keeps its bf16
    weight too (``w``)."""
    count = max(2, -(-3 * L2_BYTES // (n * k // 2)))
    out = []
    for _ in range(count):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        p4, s4 = int4_quantize(w, GROUP)
        out.append({"p4": p4, "s4": s4, "tiny": _tinygemm_pack(n, k, dev), **({"w": w} if bf16 else {})})
    return out


def _shape_list(text: str | None) -> tuple:
    return NKS if not text else tuple(tuple(int(v) for v in nk.split("x")) for nk in text.split(","))


def _extra(ap) -> None:
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", help="NxK,... (default: %s)" % ",".join(f"{n}x{k}" for n, k in NKS))
    ap.add_argument("--forms", default="rows",
                    help="rows, spans, stream, half2, half2spans (comma-separated)")
    ap.add_argument("--pdl-only", action="store_true", help="time each tile with PDL only")
    ap.add_argument("--label", help="write the runs under this key of the --out file (kept: the other keys)")


def main(argv=None) -> None:
    args = sweep_args(__doc__, "benchmarks/results/sweep_w4a16_gemv_h200.json", None, argv, _extra)
    if args is None:
        sys.exit(1)
    dev = "cuda"
    ctx = measured_context()  # the copy rate of this card, this run: the weights' bytes per second as its fraction
    forms = set(args.forms.split(","))
    runs = []
    for n, k in _shape_list(args.shapes):
        sets = _sets(n, k, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        counters = torch.zeros(n, dtype=torch.int32, device=dev)
        ref = w4a16_gemm_reference(x, sets[0]["p4"], sets[0]["s4"], GROUP).float()
        fns = {
            "tinygemm": lambda: [torch.ops.aten._weight_int4pack_mm(x, s["tiny"][0], GROUP, s["tiny"][1])
                                 for s in sets],
            "default_prefetch": lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, prefetch_weights=True)
                                         for s in sets],
        }
        if not args.pdl_only:
            fns["planes1"] = lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, gemv="planes1") for s in sets]
            fns["default"] = lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y) for s in sets]
            fns["planes1_ws"] = lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, counters=counters,
                                                    gemv="planes1") for s in sets]
        errors = {}

        def add(name: str, launch) -> bool:
            """``launch`` (one weight set -> the call) checked once against the reference into a NaN-poisoned y,
            then timed over every set; a setting that fails to compile is a finding, recorded as its error."""
            try:
                y.fill_(float("nan"))
                launch(sets[0])
                torch.cuda.synchronize()
                errors[name] = rel_err(y, ref)
            except Exception as e:  # noqa: BLE001
                errors[name] = f"{type(e).__name__}: {e}"[:300]
                return False
            fns[name] = lambda: [launch(s) for s in sets]
            return True

        def rows(tile, pdl=PDL, stream=None):
            return lambda s: gemv_launch(x[0], s["p4"], s["s4"], y[0], GROUP, tile, pdl, stream=stream)

        def half2(tile, stream=None, pairs=None, inline=False, pdl=PDL):
            """pair_order with PDL, then the GEMV (what prefetch_weights launched until session 37); ``pairs``: the
            GEMV alone, on pairs made once; ``inline``: the GEMV alone on x, which it puts in pair order itself
            (``pdl``: with PDL, or None: plainly)."""
            def launch(s):
                if inline:
                    return half2_launch_x(x[0], s["p4"], s["s4"], y[0], GROUP, tile, pdl, stream=stream)
                p, ps = pairs or pair_order(x)
                return half2_launch(p[0], ps[0], s["p4"], s["s4"], y[0], GROUP, tile, PDL, stream=stream)
            return launch

        if "rows" in forms:
            for tile in _tiles(k):
                bn, bkw, warps, pipe = tile
                for pdl in (PDL,) if args.pdl_only else (None, PDL):
                    add(f"rows BN={bn} BKW={bkw} w={warps}" + (" pipe" if pipe else "") + (" pdl" if pdl else ""),
                        rows(tile, pdl))
        if "spans" in forms:
            for bn, warps in SPAN_TILES:
                add(f"rows BN={bn} spans w={warps} pdl", rows((bn, 0, warps, False)))
        if "stream" in forms:  # both GEMVs' rule tiles with plain and with streamed weight loads
            tile, tile2 = gemv_tile(n, k), half2_tile_rule(n, k)
            for stream in (False, True):
                add(f"rows {tile} stream {stream} pdl", rows(tile, stream=stream))
                add(f"half2 {tile2} stream {stream} pdl", half2(tile2, stream))
            add(f"half2 {tile2} pdl gemv only", half2(tile2, pairs=pair_order(x)))  # no pair-order launch
            add(f"half2 {tile2} pdl inline", half2(tile2, inline=True))  # x put in pair order by the GEMV
            # both forms as a user calls them: plainly, and with prefetch_weights (PDL, weights before the wait);
            # the half2 GEMV also with its pair_order launch (HALF2_INLINE_X off)
            for form, prefetch in itertools.product(("rows", "rows_half2", "rows_half2 pair_order"), (False, True)):
                def call(s, form=form, prefetch=prefetch):
                    with module_attrs(W, {"HALF2_INLINE_X": not form.endswith("pair_order")}):
                        return w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, gemv=form.split()[0],
                                          prefetch_weights=prefetch)
                add(f"w4a16_gemm {form}" + (" prefetch" if prefetch else ""), call)
        half2_settings = []
        if "half2" in forms:
            half2_settings += [(f"half2 BN={bn} BR={br} w={warps}" + (" pipe" if pipe else "") + " pdl",
                                (bn, br, warps, pipe)) for bn, br, warps, pipe in _half2_tiles(k)]
        if "half2spans" in forms:
            half2_settings += [(f"half2 BN={bn} spans w={warps} pdl", (bn, 0, warps, False))
                               for bn, warps in HALF2_SPAN_TILES]
        if half2_settings:
            fns["rows_half2_prefetch"] = lambda: [w4a16_gemm(x, s["p4"], s["s4"], GROUP, out=y, gemv="rows_half2",
                                                             prefetch_weights=True) for s in sets]
            made = pair_order(x)
            for i, (name, tile) in enumerate(half2_settings):
                if add(name, half2(tile)) and (i == 0 or tile == half2_tile_rule(n, k) or tile[2] == 1):
                    add(name + " gemv only", half2(tile, pairs=made))
                add(name + " inline", half2(tile, inline=True))
                if not args.pdl_only:
                    add(name.removesuffix(" pdl") + " inline plain", half2(tile, inline=True, pdl=None))
        rows = timing_rows(interleaved_graph_us(fns, reps=len(sets), rounds=args.rounds), errors, n, k,
                           ctx.copy_tbps)
        print(f"\n{n} x {k}: {len(sets)} weight sets")
        for rw in rows[:16] + [rw for rw in rows[16:] if not rw["setting"].startswith(("rows ", "half2 "))]:
            print(f"  {rw['setting']:<36} {rw.get('median_us')} µs  {rw.get('tbps')} TB/s "
                  f"({rw.get('frac_of_copy')} of copy)  x{rw.get('vs_tinygemm')} tinygemm  err {rw.get('rel_err')}")
        runs.append({"N": n, "K": k, "sets": len(sets), "rows": rows})
        del sets
        torch.cuda.empty_cache()
        _write(args, runs, ctx=ctx)
    print("wrote", args.out)


def timing_rows(rounds: dict, errors: dict, n: int, k: int, copy_tbps: float = 0.0) -> list[dict]:
    """One row per setting of ``interleaved_graph_us``'s ``rounds`` (an N x K weight): its rounds or its error, its
    check against the reference (``errors``), median µs, weight bytes per second (with ``copy_tbps``, the copy rate
    measured in the same run, also as its fraction) and the ratio to ``tinygemm`` timed in the same rounds; fastest
    first."""
    tiny = rounds.get("tinygemm")
    tiny_us = sorted(tiny)[len(tiny) // 2] if isinstance(tiny, list) else None
    rows = []
    for name, r in rounds.items():
        row = {"setting": name, "rounds_us": r if isinstance(r, list) else None,
               "error": r if isinstance(r, str) else None, "rel_err": errors.get(name)}
        if isinstance(r, list):
            med = sorted(r)[len(r) // 2]
            row["median_us"] = round(med, 3)
            row["tbps"] = round((n * k // 2 + 2 * n * k // GROUP) / (med * 1e-6) / 1e12, 3)
            if copy_tbps:
                row["frac_of_copy"] = round(row["tbps"] / copy_tbps, 3)
            if tiny_us:
                row["vs_tinygemm"] = round(tiny_us / med, 3)
        rows.append(row)
    return sorted(rows, key=lambda rw: rw.get("median_us", 1e9))


def half2_tile_rule(n: int, k: int) -> tuple:
    from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_tile

    return half2_tile(n, k)


def _write(args, runs: list, about: str | None = None, ctx: Context | None = None) -> None:
    """The results so far: the whole file (headed ``about``, default this sweep's), or (``--label``) one key of the
    file (the other keys kept); ``ctx``: the run's measured ceilings for the meta."""
    doc = {"meta": meta(ctx or Context()), "runs": runs}
    write_labelled(args.out, doc if args.label else {"about": about or __doc__.splitlines()[0], **doc}, args.label)


if __name__ == "__main__":
    main()
