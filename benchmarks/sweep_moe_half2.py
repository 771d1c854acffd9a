"""The INT4 half2 GEMV (``fused_moe(..., gemv="half2")``, docs/moe.md "The half2 GEMV") against the plane GEMV at
Kimi decode, in one GPU call.

    python -m benchmarks.sweep_moe_half2 [--out results/sweep_moe_half2_h200.json] [--tokens 1,4,16] [--pin FORMS]
        [--rows] [--early] [--pairs] [--stream-weights] [--inline-x] [--label NAME]

Kimi widths (384 experts, hidden 7168, expert 2048, top-8), the bench ``moe``'s random experts and its 8 routings
per CUDA graph; per token count, in interleaved rounds (``common.interleaved_graph_us``): the plane GEMV with
prefetch (``prefetch``, the default until session 23), the plain planes, ``half2`` and ``half2_prefetch`` (the
defaults for bf16 x since) autotuned and with each candidate tile of the forms in ``--pin`` pinned (gate-up and down
alike), ``half2_prefetch`` with ``pair_order`` launched without PDL, and at one token ``fused_moe`` on BF16 and
FP8-block experts (the goal's peers: INT4 ≥ 3.0× BF16 and ≥ 1.6× FP8). Per form also the largest |difference| to the
reference over max |reference| on the first routing, and whether two calls give the same bits. ``--rows`` adds
``half2_prefetch`` pinned at each of its tiles in the row orientation (``HALF2_ROWS``: a warp's lanes on consecutive
runs of one weight row) and at ``ROWS_TILES`` (each with its error against the reference); ``--label`` writes the
rows under that key of an existing ``--out`` file. ``--early`` adds ``half2_prefetch`` (autotuned) with each
setting of ``fused_moe.WEIGHTS_BEFORE_WAIT`` (which launches read their routing and first weights before the PDL
wait: none, the down only, both), with and without ``PAIRS_IN_GATE_UP`` (h in pair order from the gate-up's
epilogue, no pair_order launch between the GEMVs). ``--pairs`` adds, at one token, ``half2_prefetch`` with the gate-up and the down
launch pinned to different tiles (each pair of ``PAIR_GATE_UP`` × ``PAIR_DOWN``). ``--stream-weights`` adds
``half2_prefetch`` with ``fused_moe.HALF2_STREAM_WEIGHTS`` (the experts' words and scales without L1 lines).
``--inline-x`` adds ``half2_prefetch`` and ``half2`` with ``fused_moe.HALF2_INLINE_X`` (the gate-up puts x in pair
order itself: no pair_order launch, and no early routing read in the gate-up).
"""
from __future__ import annotations

import contextlib
import json
import statistics

import torch
import triton

from mla_quant.kernels.fused_moe import fused_moe, fused_moe_reference
from mla_quant.kernels import _half2_gemv as H
from mla_quant.kernels import fused_moe as F
from mla_quant.kernels.fused_moe import kernel as moe_kernel
from mla_quant.modules.experts import kernel_args

from .bench_moe import FORMATS, HIDDEN, SETS, _random_experts, _routings
from .common import (interleaved_graph_us, measure_ceilings, meta, module_attrs, rel_err, sweep_args, write_labelled,
                     Context)


# extra (BLOCK_N, BLOCK_K, warps) tiles of half2_prefetch in the row orientation: wider rows of runs per warp
ROWS_TILES = ((16, 1024, 4), (32, 512, 4), (16, 512, 2), (8, 2048, 4), (16, 2048, 8), (32, 1024, 8), (64, 512, 8),
              (32, 256, 2), (64, 256, 4), (128, 256, 8), (32, 256, 4), (16, 256, 1))

# --pairs: (BLOCK_N, BLOCK_K, warps) of the gate-up and of the down launch (row orientation), timed in every pairing
PAIR_GATE_UP = ((64, 512, 8), (32, 512, 4))
PAIR_DOWN = ((64, 256, 4), (32, 512, 4), (16, 1024, 4), (64, 512, 8))


def _tile_name(cfg, form="half2") -> str:
    rows = "_rows" if cfg.kwargs.get("HALF2_ROWS") else ""
    return f"{form}_{cfg.kwargs['BLOCK_N']}x{cfg.kwargs['BLOCK_K']}w{cfg.num_warps}{rows}"


def _rows_configs(cfgs) -> list:
    """``cfgs`` and ROWS_TILES with HALF2_ROWS (half2_prefetch)."""
    out = [triton.Config({**c.kwargs, "HALF2_ROWS": True}, num_warps=c.num_warps, num_stages=c.num_stages)
           for c in cfgs]
    return out + [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "HALF2": True, "PREFETCH": True, "HALF2_ROWS": True},
                                num_warps=w, num_stages=1) for bn, bk, w in ROWS_TILES]


def _tuner(form):
    return moe_kernel.moe_gemv_half2_prefetch_autotuned if form == "half2_prefetch" else \
        moe_kernel.moe_gemv_half2_autotuned


@contextlib.contextmanager
def _pinned(cfg, form="half2"):
    """Within the block the autotuner of ``form`` holds only ``cfg`` (its cache cleared: the next call compiles that
    tile); after it, its configs and cache are as before, so a later autotuned setting runs the tiles it chose."""
    tuner = _tuner(form)
    configs, cache = tuner.configs, dict(tuner.cache)
    tuner.configs = [cfg]
    tuner.cache.clear()
    try:
        yield
    finally:
        tuner.configs = configs
        tuner.cache.clear()
        tuner.cache.update(cache)


def _rows_config(bn, bk, w):
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "HALF2": True, "PREFETCH": True, "HALF2_ROWS": True},
                         num_warps=w, num_stages=1)


@contextlib.contextmanager
def _pinned_pair(gate_up, down, call):
    """Within the block half2_prefetch's gate-up launch runs ``gate_up`` and its down launch ``down`` (configs), by
    writing its autotuner's cache per key (GATED is in the key); ``call()`` first if the cache holds no key yet (an
    eager call: never inside a graph capture, which follows an eager call of the same setting). Restored after, as
    :func:`_pinned`."""
    tuner = _tuner("half2_prefetch")
    configs, cache = tuner.configs, dict(tuner.cache)
    tuner.configs = [gate_up, down]  # more than one: the autotuner consults its cache
    try:
        if not tuner.cache:
            call()
        gated = tuner.keys.index("GATED")
        for key in list(tuner.cache):
            tuner.cache[key] = gate_up if key[gated] else down
        yield
    finally:
        tuner.configs = configs
        tuner.cache.clear()
        tuner.cache.update(cache)


def main(argv: list[str] | None = None) -> int:
    args = sweep_args(__doc__, "sweep_moe_half2_h200.json", None, argv,
                      lambda ap: (ap.add_argument("--tokens", default="1,4,16"),
                                  ap.add_argument("--pin", default="half2,half2_prefetch",
                                                  help="forms whose tiles are also timed pinned, comma-separated"),
                                  ap.add_argument("--rows", action="store_true"),
                                  ap.add_argument("--early", action="store_true"),
                                  ap.add_argument("--pairs", action="store_true"),
                                  ap.add_argument("--stream-weights", action="store_true"),
                                  ap.add_argument("--inline-x", action="store_true"),
                                  ap.add_argument("--label")))
    if args is None:
        return 1
    ctx = Context(device="cuda", quick=False)
    measure_ceilings(ctx)
    dev, tokens_all = "cuda", [int(t) for t in args.tokens.split(",")]
    all_configs = {form: list(_tuner(form).configs) for form in ("half2", "half2_prefetch")}
    result = {"meta": meta(ctx), "about": __doc__.splitlines()[0], "rows": []}
    with torch.inference_mode():
        experts = {name: _random_experts(name, dev)[0] for name in FORMATS}
        for t in tokens_all:
            routings = _routings(t, dev)
            xs = [torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(SETS)]

            def routed(name, **form):
                p = experts[name]
                return [fused_moe(x, w, ids, p["gate_proj"], p["up_proj"], p["down_proj"], **kernel_args(FORMATS[name]),
                                  **form) for x, (w, ids) in zip(xs, routings)]

            def setting(name, cfgs=None, **form):
                def fn():
                    if cfgs is None:
                        return routed(name, **form)
                    with _pinned(cfgs, form["gemv"]):
                        return routed(name, **form)
                return fn

            def no_pair_pdl():  # pair_order launched plainly (the launch before session 23)
                with module_attrs(H, {"PAIR_ORDER_PDL": False}):
                    return routed("int4_g32", block_m=1, gemv="half2_prefetch")

            def early(launches, pairs):  # fused_moe.WEIGHTS_BEFORE_WAIT and PAIRS_IN_GATE_UP at capture
                def fn():
                    with module_attrs(F, {"WEIGHTS_BEFORE_WAIT": launches, "PAIRS_IN_GATE_UP": pairs}):
                        return routed("int4_g32", block_m=1, gemv="half2_prefetch")
                return fn

            fns = {"prefetch": setting("int4_g32", block_m=1, gemv="prefetch"),
                   "half2_prefetch_plain_pair_order": no_pair_pdl,
                   "planes": setting("int4_g32", block_m=1, gemv="planes"),
                   "half2": setting("int4_g32", None, block_m=1, gemv="half2"),
                   "half2_prefetch": setting("int4_g32", None, block_m=1, gemv="half2_prefetch")}
            for form, cfgs in all_configs.items():
                for cfg in (cfgs if form in args.pin.split(",") else ()):
                    fns[_tile_name(cfg, form)] = setting("int4_g32", cfg, block_m=1, gemv=form)
            rows_cfgs = _rows_configs(all_configs["half2_prefetch"]) if args.rows else []
            for cfg in rows_cfgs:
                fns[_tile_name(cfg, "half2_prefetch")] = setting("int4_g32", cfg, block_m=1, gemv="half2_prefetch")
            if args.early:
                for launches, pairs in (((), False), (("down",), False), (("gate_up", "down"), False), ((), True),
                                        (("gate_up", "down"), True)):
                    name = "half2_prefetch_early_{}_pairs_{}".format("_".join(launches) or "none", "on" if pairs else "off")
                    fns[name] = early(launches, pairs)
            if args.stream_weights:  # fused_moe.HALF2_STREAM_WEIGHTS at capture
                def stream():
                    with module_attrs(F, {"HALF2_STREAM_WEIGHTS": True}):
                        return routed("int4_g32", block_m=1, gemv="half2_prefetch")
                fns["half2_prefetch_stream"] = stream
            if args.inline_x:  # fused_moe.HALF2_INLINE_X at capture: no pair_order launch for x
                def inline(form):
                    def fn():
                        with module_attrs(F, {"HALF2_INLINE_X": True}):
                            return routed("int4_g32", block_m=1, gemv=form)
                    return fn
                fns["half2_prefetch_inline_x"] = inline("half2_prefetch")
                fns["half2_inline_x"] = inline("half2")
            if args.pairs and t == 1:
                for g in PAIR_GATE_UP:
                    for d in PAIR_DOWN:
                        def pair(cg=_rows_config(*g), cd=_rows_config(*d)):
                            call = lambda: routed("int4_g32", block_m=1, gemv="half2_prefetch")  # noqa: E731
                            with _pinned_pair(cg, cd, call):
                                return call()
                        fns["half2_prefetch_{}x{}w{}_down_{}x{}w{}".format(*g, *d)] = pair
            if t == 1:
                fns["bf16"] = setting("bf16")
                fns["fp8_block"] = setting("fp8_block")
            rounds = interleaved_graph_us(fns, reps=SETS, rounds=5)
            x0, (w0, ids0) = xs[0], routings[0]
            p = experts["int4_g32"]
            ref = fused_moe_reference(x0, w0, ids0, p["gate_proj"], p["up_proj"], p["down_proj"], kind="int4_group")
            errs, same = {}, {}
            for cfg in rows_cfgs:  # each row-orientation tile against the reference
                try:
                    with _pinned(cfg, "half2_prefetch"):
                        a = fused_moe(x0, w0, ids0, p["gate_proj"], p["up_proj"], p["down_proj"], kind="int4_group",
                                      block_m=1, gemv="half2_prefetch")
                    errs[_tile_name(cfg, "half2_prefetch")] = rel_err(a, ref)
                except Exception as e:  # noqa: BLE001 - a tile that fails is a finding
                    errs[_tile_name(cfg, "half2_prefetch")] = f"{type(e).__name__}: {e}"[:200]
            for form in ("prefetch", "planes", "half2", "half2_prefetch"):
                kw = {"gemv": form}
                a = fused_moe(x0, w0, ids0, p["gate_proj"], p["up_proj"], p["down_proj"], kind="int4_group",
                              block_m=1, **kw)
                b = fused_moe(x0, w0, ids0, p["gate_proj"], p["up_proj"], p["down_proj"], kind="int4_group",
                              block_m=1, **kw)
                errs[form] = rel_err(a, ref)
                same[form] = bool(torch.equal(a, b))
            chosen = {form: {str(k): str(v) for k, v in _tuner(form).cache.items()} for form in all_configs}
            us = {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in rounds.items()}
            row = {"tokens": t, "us": us, "rounds": rounds, "err_vs_reference": errs, "deterministic": same,
                   "half2_autotuned_configs": chosen}
            base = us["prefetch"]
            row["speedup_vs_prefetch"] = {k: round(base / v, 3) for k, v in us.items() if isinstance(v, float)}
            if t == 1:
                for peer in ("bf16", "fp8_block"):
                    if isinstance(us.get(peer), float):
                        row[f"vs_{peer}"] = {k: round(us[peer] / v, 3) for k, v in us.items()
                                             if isinstance(v, float) and k not in ("bf16", "fp8_block")}
            result["rows"].append(row)
            print(json.dumps({k: row[k] for k in row if k != "rounds"}), flush=True)
    write_labelled(args.out, result, args.label)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
