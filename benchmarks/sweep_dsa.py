"""Sweep of the DSA decode step's launch settings (GLM 5.2, fp8_ds_mla pages, 64k context), in one GPU call.

    python -m benchmarks.sweep_dsa [--out sweep_dsa.json] [--heads 8,64] [--budget-s 120]

The step is ``bench_dsa``'s (indexer scores with the top-k's first round fused, the radix select with a kept
work buffer, the sparse attention and its split merge) timed as one CUDA-graph replay over rotating block
tables; each setting changes one part and times the whole step:

- ``finish``: the candidate finish in the compact pass's last program of the row (``fused``) or its own
  launch (``unfused``), with compact programs of 1, 2 or 4 warps;
- ``indexer``: keys per scores program (``indexer_scores.BLOCK_N``) and warps (``WARPS``);
- ``sparse``: warps per attention program (``sparse_mla_decode.KERNEL_WARPS``) and fp32 partials per merge
  program (``COMBINE_PARTIALS``).

The launcher's default is timed first and last (the spread between the two is the run's noise) and the dense
``mla_decode`` peer once, so every setting has its ratio to dense in the same run.
"""
from __future__ import annotations

import functools
import json
import time

import torch

from .common import Context, graph_us, meta, sweep_args

FINISH = [{"fused_finish": f, "compact_warps": w} for f, w in ((False, 4), (True, 4), (True, 2), (True, 1))]
INDEXER = [{"BLOCK_N": n, "WARPS": w} for n, w in ((64, 2), (64, 4), (128, 8), (256, 4), (256, 8))]
SPARSE = [{"KERNEL_WARPS": w, "COMBINE_PARTIALS": c} for w, c in ((4, 8192), (8, 4096), (8, 2048), (4, 4096))]


def _patched(part: str, setting: dict):
    """A context that applies one setting of ``part`` to the library's modules and restores them."""
    import contextlib

    from mla_quant.kernels import indexer_scores, sparse_mla_decode, topk

    @contextlib.contextmanager
    def ctx():
        saved = []
        if part == "finish":
            saved.append((topk, "_radix_topk", topk._radix_topk))
            topk._radix_topk = functools.partial(topk._radix_topk, **setting)
        else:
            module = indexer_scores if part == "indexer" else sparse_mla_decode
            for name, value in setting.items():
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        try:
            yield
        finally:
            for module, name, value in saved:
                setattr(module, name, value)
    return ctx()


def main(argv: list[str] | None = None) -> int:
    args = sweep_args(__doc__, "sweep_dsa.json", 120.0, argv, lambda ap: ap.add_argument(
        "--heads", default="8", help="comma-separated attention heads per GPU (8: TP8, 64: one GPU)"))
    if args is None:
        return 2
    from mla_quant.kernels.indexer_scores import indexer_topk, topk_work_buffer
    from mla_quant.kernels.mla_decode import mla_decode, tuned_config
    from mla_quant.kernels.sparse_mla_decode import sparse_mla_decode

    from .bench_dsa import (D_LATENT, D_ROPE, IDX_DIM, IDX_HEADS, INDEX_KEY_BYTES, PAGE, SCALE, TOPK,
                            _fill_pools, _tables)
    from mla_quant.formats import KVFormat

    start, dev, kind, n, batch = time.time(), "cuda", "fp8_ds_mla", 65536, 1
    pool, scales, keys, key_scales = _fill_pools(kind, 16 * n // PAGE, dev)
    row_bytes = KVFormat(kind).bytes_per_token(D_LATENT, D_ROPE)
    tables = _tables(batch, n, batch * n * (row_bytes + INDEX_KEY_BYTES), 16 * n // PAGE, dev)
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
    req_ids = torch.arange(batch, dtype=torch.int32, device=dev)
    positions = torch.full((batch,), n - 1, dtype=torch.int64, device=dev)
    q_idx = torch.randn(batch, IDX_HEADS, IDX_DIM, device=dev).mul(30).to(torch.float8_e4m3fn)
    w_idx = torch.rand(batch, IDX_HEADS, device=dev)
    work = topk_work_buffer(dev, batch)
    rows, skipped = [], []
    for heads in [int(h) for h in args.heads.split(",") if h]:
        q = torch.randn(batch, heads, D_LATENT + D_ROPE, device=dev, dtype=torch.bfloat16)

        def step(tb):
            idx = indexer_topk(q_idx, w_idx, keys, key_scales, tb, req_ids, positions, TOPK, n, work=work)
            return sparse_mla_decode(q[..., :D_LATENT], q[..., D_LATENT:], pool, scales, kind, tb, seq_lens,
                                     req_ids, idx, SCALE)

        def dense(tb):
            return mla_decode(q[:, None], pool, scales, tb, seq_lens, SCALE, kind, D_LATENT, max_seq_len=n,
                              validate=False)

        def timed(fn):
            return graph_us(lambda: [fn(tb) for tb in tables], len(tables))[0]

        t_dense = timed(dense)
        print(f"heads {heads}: dense mla_decode {t_dense:.2f} µs ({tuned_config()})", flush=True)
        settings = [("default", {}), *[("finish", s) for s in FINISH], *[("indexer", s) for s in INDEXER],
                    *[("sparse", s) for s in SPARSE], ("default", {})]
        for part, setting in settings:
            if time.time() - start > args.budget_s:
                skipped.append({"heads": heads, "part": part, "setting": setting})
                continue
            try:
                with _patched(part, setting):
                    t = timed(step)
            except Exception as e:  # noqa: BLE001 - a setting that fails to compile or launch is a finding
                print(f"  {part:8s} {json.dumps(setting):48s} failed: {type(e).__name__}: {e}"[:300], flush=True)
                rows.append({"heads": heads, "part": part, "setting": setting, "error": f"{e}"[:500]})
                continue
            rows.append({"heads": heads, "part": part, "setting": setting, "step_us": round(t, 3),
                         "dense_us": round(t_dense, 3), "ratio_vs_dense": round(t / t_dense, 4)})
            print(f"  {part:8s} {json.dumps(setting):48s} {t:8.2f} µs  {t / t_dense:.3f}x dense", flush=True)
    if skipped:
        print(f"budget spent: {len(skipped)} settings not timed")
    with open(args.out, "w") as f:
        json.dump({"meta": meta(Context()), "ctx": n, "batch": batch, "kv": kind, "rows": rows, "skipped": skipped}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
