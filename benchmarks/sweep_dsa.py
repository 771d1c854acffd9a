"""Sweep of the DSA decode step's launch settings (GLM 5.2, fp8_ds_mla pages, 64k context), in one GPU call.

    python -m benchmarks.sweep_dsa [--out sweep_dsa.json] [--heads 8,64] [--rounds 7]

The step is ``bench_dsa``'s (indexer scores with the top-k's first round fused, the radix select with a kept
work buffer, the sparse attention and its split merge) timed as one CUDA-graph replay over rotating block
tables; each setting changes one part and times the whole step:

- ``finish``: the candidate finish in the compact pass's last program of the row (``fused``) or its own
  launch (``unfused``), with compact programs of 1, 2 or 4 warps; radix tiles of 128 or 512 columns instead of
  ``topk.radix_block``'s 256 (round 1 and the compact pass: 512 or 128 programs at one row of 64k); the finish's
  bit search block-wide instead of per warp (``warp_search``);
- ``indexer``: keys per scores program at decode (``indexer_scores.DECODE_BLOCK_N``) and warps (``DECODE_WARPS``);
- ``sparse``: warps per attention program (``sparse_mla_decode.KERNEL_WARPS``) and fp32 partials per merge
  program (``COMBINE_PARTIALS``); bf16 split partials (``PARTIAL_DTYPE``);
- ``pdl``: every kernel launched plainly (``_pdl.ENABLED`` False) instead of with programmatic dependent launch,
  each program signalling the next kernel after its wait (``EARLY`` False), or one op more or fewer launched plainly
  (``_pdl.SKIP``); the dense peer is also timed with plain launches
  (``dense_no_pdl``) and with PDL for its split kernel too (``dense_pdl_all``, ``SKIP`` empty).

Every setting (and the dense ``mla_decode`` peer) is captured once and timed in ``--rounds`` round-robin passes
(``common.interleaved_graph_us``: in session 7's first sweep the default, timed first and last in a row, read
30.98 and 32.78 µs, more than most settings differ); the median of the rounds is reported, with its min and max.
"""
from __future__ import annotations

import contextlib
import functools
import json
import statistics

import torch

from mla_quant.kernels import _pdl

from .common import Context, interleaved_graph_us, meta, module_attrs, sweep_args

FINISH = [*({"fused_finish": f, "compact_warps": w} for f, w in ((False, 4), (True, 1))),
          *({"block": b} for b in (128, 512)),   # columns per radix tile (round 1, compact): 512 or 128 programs
          {"warp_search": False}]                # the finish's search block-wide, not per warp
INDEXER = [{"DECODE_BLOCK_N": n, "DECODE_WARPS": w} for n, w in ((128, None), (256, 4))]
SPARSE = [*({"KERNEL_WARPS": w, "COMBINE_PARTIALS": c} for w, c in ((8, 8192), (4, 8192), (4, 2048))),
          {"PARTIAL_DTYPE": "bfloat16"}]   # the split partials in bf16: half the bytes written and merged
PDL_SKIP = sorted(_pdl.SKIP)   # the ops the library launches plainly
# without PDL; each program signalling after its wait; one op more or fewer launched plainly than the default
PDL = [{"ENABLED": False}, {"EARLY": False},
       *({"SKIP": sorted(set(PDL_SKIP) ^ {op})}
         for op in ("indexer_scores", "topk", "sparse_mla_decode", "sparse_mla_decode_merge"))]
# settings of several parts at once: signalling after the wait with the runners-up of e9fbe0a's sweep
COMBOS = [(("pdl", {"EARLY": False}), ("sparse", {"KERNEL_WARPS": 4, "COMBINE_PARTIALS": 8192})),
          (("pdl", {"EARLY": False}), ("finish", {"fused_finish": False, "compact_warps": 4}))]


def knob_value(name: str, value):
    """A setting's value as the module constant takes it (settings are JSON: lists for sets, names for dtypes)."""
    if name == "SKIP":
        return frozenset(value)
    return getattr(torch, value) if name == "PARTIAL_DTYPE" else value


def _patched(part: str, setting: dict):
    """A context that applies one setting of ``part`` (``"combo"``: ``setting`` is a tuple of (part, setting)
    pairs) to the library's modules and restores them."""
    from mla_quant.kernels import indexer_scores, sparse_mla_decode, topk

    stack = contextlib.ExitStack()
    for p, s in (setting if part == "combo" else ((part, setting),)):
        if p == "finish":   # launcher arguments of the radix select, bound into the function its callers look up
            stack.enter_context(module_attrs(topk, {"_radix_topk": functools.partial(topk._radix_topk, **s)}))
        elif s:
            module = {"indexer": indexer_scores, "sparse": sparse_mla_decode, "pdl": _pdl}[p]
            stack.enter_context(module_attrs(module, {k: knob_value(k, v) for k, v in s.items()}))
    return stack


def main(argv: list[str] | None = None) -> int:
    def extra(ap):
        ap.add_argument("--heads", default="8", help="comma-separated attention heads per GPU (8: TP8, 64: one GPU)")
        ap.add_argument("--rounds", type=int, default=7, help="round-robin timing passes over the settings")
    args = sweep_args(__doc__, "sweep_dsa.json", None, argv, extra)
    if args is None:
        return 2
    from mla_quant.kernels.indexer_scores import indexer_topk, topk_work_buffer
    from mla_quant.kernels.mla_decode import mla_decode, tuned_config
    from mla_quant.kernels.sparse_mla_decode import sparse_mla_decode

    from .bench_dsa import D_LATENT, D_ROPE, INDEX_KEY_BYTES, PAGE, SCALE, TOPK, _fill_pools, _tables, decode_queries
    from mla_quant.formats import KVFormat

    dev, kind, n, batch = "cuda", "fp8_ds_mla", 65536, 1
    pool, scales, keys, key_scales = _fill_pools(kind, 16 * n // PAGE, dev)
    row_bytes = KVFormat(kind).bytes_per_token(D_LATENT, D_ROPE)
    tables = _tables(batch, n, batch * n * (row_bytes + INDEX_KEY_BYTES), 16 * n // PAGE, dev)
    seq_lens, req_ids, positions, q_idx, w_idx = decode_queries(batch, n, dev)
    work = topk_work_buffer(dev, batch)
    rows = []
    for heads in [int(h) for h in args.heads.split(",") if h]:
        q = torch.randn(batch, heads, D_LATENT + D_ROPE, device=dev, dtype=torch.bfloat16)

        def step(tb):
            idx = indexer_topk(q_idx, w_idx, keys, key_scales, tb, req_ids, positions, TOPK, n, work=work)
            return sparse_mla_decode(q[..., :D_LATENT], q[..., D_LATENT:], pool, scales, kind, tb, seq_lens,
                                     req_ids, idx, SCALE)

        def dense(tb):
            return mla_decode(q[:, None], pool, scales, tb, seq_lens, SCALE, kind, D_LATENT, max_seq_len=n,
                              validate=False)

        settings = [("default", {}), *[("finish", x) for x in FINISH], *[("indexer", x) for x in INDEXER],
                    *[("sparse", x) for x in SPARSE], *[("pdl", x) for x in PDL], *[("combo", c) for c in COMBOS]]

        def over_tables(fn, part="default", setting=None):
            """fn over every block table, under one setting."""
            def run():
                with _patched(part, setting or {}):
                    return [fn(tb) for tb in tables]
            return run

        fns = {"dense": over_tables(dense), "dense_no_pdl": over_tables(dense, "pdl", {"ENABLED": False}),
               "dense_pdl_all": over_tables(dense, "pdl", {"SKIP": []})}
        fns.update({json.dumps([part, setting]): over_tables(step, part, setting) for part, setting in settings})
        times = interleaved_graph_us(fns, reps=len(tables), rounds=args.rounds)
        if isinstance(times["dense"], str):
            raise RuntimeError(f"the dense peer failed: {times['dense']}")
        t_dense = statistics.median(times["dense"])
        t_dense_no_pdl, t_dense_pdl_all = (round(statistics.median(t), 3) if not isinstance(t, str) else t
                                           for t in (times["dense_no_pdl"], times["dense_pdl_all"]))
        print(f"heads {heads}: dense mla_decode {t_dense:.2f} µs ({tuned_config()}), rounds "
              f"{[round(t, 2) for t in times['dense']]}; without PDL {t_dense_no_pdl}, with PDL for its split kernel "
              f"too {t_dense_pdl_all}", flush=True)
        for part, setting in settings:
            got = times[json.dumps([part, setting])]
            if isinstance(got, str):
                print(f"  {part:8s} {json.dumps(setting):60s} failed: {got}", flush=True)
                rows.append({"heads": heads, "part": part, "setting": setting, "error": got})
                continue
            t = statistics.median(got)
            rows.append({"heads": heads, "part": part, "setting": setting, "step_us": round(t, 3),
                         "rounds_us": [round(x, 3) for x in got], "dense_us": round(t_dense, 3),
                         "dense_no_pdl_us": t_dense_no_pdl, "dense_pdl_all_us": t_dense_pdl_all,
                         "ratio_vs_dense": round(t / t_dense, 4)})
            print(f"  {part:8s} {json.dumps(setting):60s} {t:8.2f} µs (min {min(got):.2f}, max {max(got):.2f})"
                  f"  {t / t_dense:.3f}x dense", flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta(Context()), "ctx": n, "batch": batch, "kv": kind, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
