"""Sweep of ``mla_decode``'s split count × kernel configuration at one BF16 shape, in one GPU call.

    python -m benchmarks.sweep_mla_decode [--out sweep_mla_decode.json] [--batch 64] [--ctx 4096] [--rounds 5]
        [--kind bf16 | fp8_e4m3 [--fp8-dequant fp8mma]] [--only SUBSTRING ...] [--splits 2,3,4,5,8]

The launcher picks the split count first (``plan_num_splits``) and the autotuner then picks the kernel
configuration for it; a configuration with fewer registers or less shared memory fits more programs per SM,
so a larger split count might only pay with it. This times the pairs jointly at 16 heads (the goal case of
issue #3: ≥ 75 % of copy at 4k): every (splits, config) pair and the launcher's own choice (``default``) is
captured once and timed in round-robin passes (``common.interleaved_graph_us``), inputs rotating over block
tables as in ``bench_mla_decode``; so are the split merge's settings (``MERGES``, at the launcher's split and
config), and the launcher's choice with plain launches instead of programmatic dependent ones (``no_pdl``:
``_pdl.ENABLED`` False) or with the split kernel and the merge launched so too (``pdl_all``: ``_pdl.SKIP``
empty), and with bf16 split partials (``PARTIAL_DTYPE``) at the launcher's split count and at 5 and 6. Reports
µs (median of the rounds, min, max) and the fraction of the copy bandwidth measured in the same run.
``--kind fp8_e4m3`` sweeps FP8 pages (per-token scales) with ``--fp8-dequant``'s own candidates instead.
``--peer-bf16`` adds the BF16 launcher on BF16 pages of the same shape (``bf16_auto``), the peer of the FP8 goals,
timed in the same rounds (results/sweep_mla_frag_h200.json timed a removed fp8_dequant="fragments" so).
``no_tma_launch``: the launcher with ``TMA_LAUNCH`` off (the autotuner and its own split count, as before session
11). ``--only`` keeps the settings whose name contains one of the substrings.
"""
from __future__ import annotations

import json
import statistics

import torch

from .common import Context, interleaved_graph_us, measure_ceilings, meta, module_attrs, sweep_args

HEADS = 16
SPLITS = (2, 3, 4, 5, 8)
# (BLOCK_M, BLOCK_N, QK_SPLIT_LOAD, num_warps, num_stages, TMA) per KV kind. sm_90 (Triton 3.6, compile_check),
# with the block table read per chunk of tiles (so num_stages - 1 tile buffers): bf16 m16n64w8s2 92 KB smem,
# 102 registers (2 programs per SM, one buffer); m16n32w8s3 91 KB, 97 (2 per SM, two buffers); m16n32w8s4 127 KB
# (1 per SM); m16n16w4s3 54 KB (4 per SM). TMA (descriptor loads of whole tiles): m16n64w8s3 164 KB, 221
# registers; m16n32w8s4 127 KB, 185; m16n16w4s3 54 KB, 219 (2 per SM) — the V operand is read from shared
# memory right after the tile lands, so it lives in registers through the softmax.
CONFIGS = {
    "bf16": ((16, 64, False, 8, 2, False), (16, 32, False, 8, 3, False), (16, 32, False, 8, 4, False),
             (16, 16, False, 4, 3, False), (16, 64, False, 8, 3, True), (16, 32, False, 8, 4, True),
             (16, 32, False, 8, 3, True), (16, 16, False, 4, 3, True)),
    # fp8mma below 64 rows puts BLOCK_N tokens on wgmma's M (≥ 64); fp16: 16/32-token tiles
    "fp8mma": ((16, 128, False, 8, 2, False), (16, 64, False, 4, 2, False), (16, 64, False, 4, 3, False),
               (16, 64, False, 8, 3, False)),
    "fp16": ((16, 32, False, 8, 2, False), (16, 32, False, 8, 3, False), (16, 32, False, 8, 3, True),
             (16, 16, False, 4, 3, False)),
    # bitcast: the words by pointer loads (the autotuner's m16n32w4s2) or staged by TMA (no spills: m16n32w4 208 /
    # 229 registers at 2 / 3 stages, 2 programs per SM; m16n64w8s3 172 registers, 156 KB, 1 per SM)
    "bitcast": ((16, 32, False, 4, 2, False), (16, 32, False, 4, 2, True), (16, 32, False, 4, 3, True),
                (16, 64, False, 8, 3, True), (16, 32, False, 8, 3, True), (16, 64, False, 8, 4, True)),
}


# the row merge (mla_decode.ROWS_BLOCK_R query rows per program, ROWS_WARPS) besides the launcher's 4 rows, 4 warps:
# at 4 splits x 64 requests x 16 heads, 8 rows are 128 programs (about one per SM), each reading 64 KB of partials
MERGES = tuple({"ROWS_BLOCK_R": r, "ROWS_WARPS": w} for r, w in ((2, 4), (8, 4), (8, 8), (2, 2)))


def _patched(fn, constants: dict, module=None):
    """``fn`` run with module constants of ``module`` (default ``mla_decode``) set to ``constants`` (restored after
    each call)."""
    if module is None:
        from mla_quant.kernels import mla_decode as module

    def run():
        with module_attrs(module, constants):
            return fn()
    return run


def _config(c) -> dict:
    return {"BLOCK_M": c[0], "BLOCK_N": c[1], "QK_SPLIT_LOAD": c[2], "num_warps": c[3], "num_stages": c[4],
            "TMA": c[5]}


def main(argv: list[str] | None = None) -> int:
    def extra(ap):
        ap.add_argument("--batch", type=int, default=64)
        ap.add_argument("--heads", type=int, default=HEADS, help="query heads (≤ 16: the 16-row candidates)")
        ap.add_argument("--ctx", type=int, default=4096)
        ap.add_argument("--rounds", type=int, default=5, help="round-robin timing passes over the settings")
        ap.add_argument("--kind", choices=("bf16", "fp8_e4m3"), default="bf16")
        ap.add_argument("--fp8-dequant", choices=("fp8mma", "fp16", "bitcast"), default="fp8mma")
        ap.add_argument("--peer-bf16", action="store_true", help="also time BF16 pages of the shape (bf16_auto)")
        ap.add_argument("--only", nargs="*", help="time only the settings whose name contains one of these")
        ap.add_argument("--splits", default=",".join(map(str, SPLITS)),
                        help="split counts of the (splits, config) pairs, comma-separated")
    args = sweep_args(__doc__, "sweep_mla_decode.json", None, argv, extra)
    if args is None:
        return 2
    from mla_quant.kernels import _pdl
    from mla_quant.kernels.mla_decode import last_launch, mla_decode

    from .bench_mla_decode import D_LATENT, D_ROPE, PAGE, SCALE, _fill_pool, _input_sets, _row_bytes, rotation_sets

    ctx = Context()
    measure_ceilings(ctx)
    batch, n, kind, heads = args.batch, args.ctx, args.kind, args.heads
    dequant = args.fp8_dequant if kind != "bf16" else "auto"
    num_pages = rotation_sets(batch, n, kind) * batch * n // PAGE  # pages for the bench's input sets
    pool, scales = _fill_pool(kind, num_pages, "cuda")
    sets = _input_sets(batch, n, heads, kind, num_pages, "cuda")
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    moved = batch * (n * _row_bytes(kind) + heads * 2 * (D_LATENT + D_ROPE + D_LATENT))
    moved_bf16 = moved + batch * n * (_row_bytes("bf16") - _row_bytes(kind))

    def decode(splits=None, config=None, fp8_dequant=dequant):
        return lambda: [mla_decode(q, pool, scales, tb, seq_lens, SCALE, kind, D_LATENT, num_splits=splits,
                                   max_seq_len=n, validate=False, config=config, fp8_dequant=fp8_dequant)
                        for q, tb in sets]

    decode()()  # the launcher's own split count and configuration (autotuned once here)
    planned, tuned = last_launch()
    fns = {"default": decode()}
    for s in (int(v) for v in args.splits.split(",") if v):
        for c in CONFIGS[kind if kind == "bf16" else dequant]:
            fns[json.dumps({"splits": s, **_config(c)})] = decode(s, _config(c))
    for merge in MERGES:   # the launcher's split and config, the row merge's rows per program and warps
        fns[json.dumps(merge)] = _patched(decode(), merge)
    fns["no_tma_launch"] = _patched(decode(), {"TMA_LAUNCH": False})
    if kind != "bf16":  # the launcher's own fp8_dequant choice ("auto"), beside the swept one
        fns["fp8_dequant_auto"] = decode(fp8_dequant="auto")
    fns["no_pdl"] = _patched(decode(), {"ENABLED": False}, _pdl)
    fns["pdl_all"] = _patched(decode(), {"SKIP": frozenset()}, _pdl)
    for s in (None, 5, 6):   # bf16 partials: half the split traffic, so more splits may pay
        fns[f"partials_bf16_splits{s or planned}"] = _patched(decode(s), {"PARTIAL_DTYPE": torch.bfloat16})
    if args.peer_bf16:   # BF16 pages of the same shape, rotating over as many block tables
        pool16, _ = _fill_pool("bf16", num_pages, "cuda")
        fns["bf16_auto"] = lambda: [mla_decode(q, pool16, None, tb, seq_lens, SCALE, "bf16", D_LATENT, max_seq_len=n,
                                               validate=False) for q, tb in sets]
    if args.only:
        fns = {k: f for k, f in fns.items() if k == "default" or any(o in k for o in args.only)}
    times = interleaved_graph_us(fns, reps=len(sets), rounds=args.rounds)
    rows = []
    print(f"copy {ctx.copy_tbps:.3f} TB/s; {kind} ({dequant}) {heads} heads, batch {batch}, ctx {n}; "
          f"launcher: {planned} splits, {tuned}", flush=True)
    for name, got in times.items():
        if isinstance(got, str):
            print(f"  {name:100s} failed: {got}", flush=True)
            rows.append({"setting": name, "error": got})
            continue
        t = statistics.median(got)
        nbytes = moved_bf16 if name == "bf16_auto" else moved
        frac = nbytes / (t * 1e-6) / 1e12 / ctx.copy_tbps
        rows.append({"setting": name, "median_us": round(t, 3), "rounds_us": [round(x, 3) for x in got],
                     "frac_of_copy": round(frac, 4)})
        print(f"  {name:100s} {t:8.2f} µs (min {min(got):.2f}, max {max(got):.2f}) {frac:.3f} of copy", flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta(ctx), "kind": kind, "fp8_dequant": dequant, "heads": heads, "batch": batch, "ctx": n,
                   "launcher_splits": planned, "launcher_config": tuned, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
