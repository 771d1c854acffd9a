"""Probe: where the fixed cost of a short MLA decode goes (issue #3: 16 heads, batch 32 × 4k).

    python -m benchmarks.probe_mla_fixed [--out probe_mla_fixed.json] [--rounds 5] [--parts timeline,tiles]

Parts (``--parts``, comma-separated; default all): ceilings (``floor`` and ``copy`` below), shapes, tiles, timeline,
warps, pdl. Findings: docs/mla.md "Where the fixed cost of a short decode goes"; results/probe_mla_fixed_h200.json.

A bench ``mla_decode`` row at 16 heads × batch 32 × 4k (151 MB of BF16 pages) reads ~51 µs where the pages alone
take ~36 µs at the copy rate, and the split decode's time fits ``a + b·tiles`` with ``a`` ≈ 14-17 µs. This probe
splits that ``a`` into its parts, on one GPU call:

- ``floor``: a CUDA graph of one (two) tiny kernels, timed as the bench times a decode (do_bench median, L2 flushed
  between replays): what the measurement itself adds to any graph;
- ``copy``: ``dst.copy_(src)`` at the decode's page bytes (read + written), timed eagerly as the bench's ceiling is:
  the copy rate at this size against the 1 GiB ceiling;
- per shape (BF16 pages and the Gluon kernel's fp8_e4m3 pages): the bench's time (one call per graph), the time
  per call of a graph of four calls over distinct pages, and a profiler trace of the one-call graph (each kernel's
  duration, the gap between the decode and merge kernels, the span from the first kernel's start to the last one's
  end);
- ``tiles``: the decode kernel's duration at batch 32, 4 splits, 1k-16k tokens (4-64 tiles per program): the fit
  ``a + b·tiles`` of the kernel alone;
- ``timeline``: each decode program's own timeline (``mla_decode.PROBE_BUFFER``: globaltimer and clock64 stamps at
  entry, seq_len loaded, page ids loaded, first tile scored, loop done, outputs stored; kernel.py ``PROBE``), as
  percentiles over the programs of eager calls after an L2 flush: how long the programs wait to start, how long each
  step takes and how far apart they finish;
- ``warps``: interleaved rounds of ``TMA_CONFIG`` with 16 warps against the launcher's 8;
- ``pdl``: interleaved rounds of the launcher as it is against its decode and merge kernels launched with PDL
  (``_pdl.SKIP`` without them).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from .bench_mla_decode import _input_sets, _row_bytes, rotation_sets
from .common import _captured, graph_us, interleaved_graph_us, median_us, module_attrs, random_kv_pool

HEADS, D, D_LATENT, PAGE, SCALE = 16, 576, 512, 64, 0.1447
FLUSH = 256 * 2**20


def _pool(kind, pages, dev):
    return random_kv_pool(kind, pages, PAGE, D_LATENT, D - D_LATENT, dev)


def _sets(batch, ctx, n_sets, dev, heads=HEADS):
    """``n_sets`` (q, block table) over distinct pages of one pool of ``n_sets·batch·ctx/PAGE`` pages."""
    return _input_sets(batch, ctx, heads, "bf16", n_sets * batch * ctx // PAGE, dev, n_sets=n_sets)


def _medians(rounds: dict) -> dict:
    """``interleaved_graph_us``'s rounds -> the median µs per setting (a setting's error message as it is)."""
    return {k: round(statistics.median(v), 2) if isinstance(v, list) else v for k, v in rounds.items()}


def trace(fn, reps: int = 30) -> dict:
    """Kernel durations of ``fn`` replayed from a CUDA graph ``reps`` times (L2 flushed before each replay), from
    the profiler's trace: mean µs per kernel name, the mean gap between consecutive kernels of a replay and the mean
    span from its first kernel's start to its last one's end."""
    graph = _captured(fn)
    flush = torch.empty(FLUSH, dtype=torch.int8, device="cuda")
    for _ in range(3):
        flush.zero_()
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    replays, cur = [], []
    for e in kernels:  # a replay = the kernels after one flush (the memset / fill kernel)
        if "fill" in e["name"].lower() or "memset" in e["name"].lower():
            if cur:
                replays.append(cur)
            cur = []
        else:
            cur.append(e)
    if cur:
        replays.append(cur)
    dur, gaps, spans = {}, [], []
    for rep in replays:
        for e in rep:
            dur.setdefault(e["name"][:60], []).append(e["dur"])
        gaps += [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(rep, rep[1:])]
        spans.append(rep[-1]["ts"] + rep[-1]["dur"] - rep[0]["ts"])
    return {"kernels_us": {k: round(statistics.mean(v), 2) for k, v in dur.items()},
            "gap_us": round(statistics.mean(gaps), 2) if gaps else None,
            "span_us": round(statistics.mean(spans), 2), "replays": len(replays)}


def floor() -> dict:
    a = torch.zeros(1, device="cuda")
    b = torch.zeros(1, device="cuda")
    one = graph_us(lambda: a.add_(1.0))[0]
    two = graph_us(lambda: (a.add_(1.0), b.add_(1.0)))[0]
    eager = median_us(lambda: a.add_(1.0))
    return {"graph_one_tiny_us": round(one, 2), "graph_two_tiny_us": round(two, 2), "eager_one_tiny_us": round(eager, 2)}


def copy_at(moved_bytes: int) -> dict:
    """``dst.copy_(src)`` moving ``moved_bytes`` (read + written), timed as the bench's ceiling is (eager do_bench:
    a CUDA-graph replay of the same copy read 2.7 TB/s at 1 GiB, against 4.22 eager, in session 26's first call)."""
    n = moved_bytes // 4  # bf16 elements read (n·2 bytes) and written (n·2)
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src))
    return {"bytes_moved": 4 * n, "us": round(t, 2), "tbps": round(4 * n / t / 1e6, 3)}


def shape_probe(kind: str, batch: int, ctx: int, dev: str = "cuda") -> dict:
    from mla_quant.kernels.mla_decode import last_launch, mla_decode

    sets = _sets(batch, ctx, 4, dev)
    kv, sc = _pool(kind, 4 * batch * ctx // PAGE, dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

    def call(q, table, **kw):
        return mla_decode(q, kv, sc, table, lens, SCALE, kind, D_LATENT, validate=False, max_seq_len=ctx, **kw)

    one = graph_us(lambda: call(*sets[0]))[0]
    splits, config = last_launch() if kind == "bf16" else (None, "gluon")
    four = graph_us(lambda: [call(q, t) for q, t in sets], 4)[0]
    page_bytes = batch * ctx * _row_bytes(kind)
    out = {"kind": kind, "batch": batch, "ctx": ctx, "splits": splits, "config": config,
           "page_mb": round(page_bytes / 1e6, 1), "one_call_graph_us": round(one, 2),
           "four_call_graph_us_per_call": round(four, 2), "trace": trace(lambda: call(*sets[0]))}
    return out


def tiles_fit(kind: str, batch: int = 32, splits: int = 4, contexts=(1024, 2048, 4096, 8192, 16384)) -> dict:
    from mla_quant.kernels.mla_decode import mla_decode

    dev = "cuda"
    kv, sc = _pool(kind, batch * max(contexts) // PAGE, dev)
    rows = []
    for ctx in contexts:
        (q, table), = _sets(batch, ctx, 1, dev)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        tr = trace(lambda: mla_decode(q, kv, sc, table, lens, SCALE, kind, D_LATENT, validate=False,
                                      max_seq_len=ctx, num_splits=splits))
        decode_us = max(tr["kernels_us"].values())
        rows.append({"ctx": ctx, "tiles_per_program": ctx // splits // 64, "decode_kernel_us": decode_us,
                     "trace": tr})
    xs = [r["tiles_per_program"] for r in rows]
    ys = [r["decode_kernel_us"] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"kind": kind, "batch": batch, "splits": splits, "rows": rows, "fit_a_us": round(my - b * mx, 2),
            "fit_b_us_per_tile": round(b, 3)}


STEPS = ("wait_and_seq_len", "page_ids", "first_tile", "tile_loop", "masked_phase", "epilogue")


def _pct(xs, qs=(0, 50, 90, 100)) -> dict:
    xs = sorted(xs)
    return {f"p{q}": round(xs[min(len(xs) - 1, q * len(xs) // 100)], 2) for q in qs}


def timeline(batch: int, ctx: int, calls: int = 10) -> dict:
    """Per-program timelines of the Triton decode kernel over BF16 pages (TMA_CONFIG; the only kernel with the
    ``PROBE`` stamps) over ``calls`` eager calls."""
    import mla_quant.kernels.mla_decode as md

    dev = "cuda"
    (q, table), = _sets(batch, ctx, 1, dev)
    kv, _ = _pool("bf16", batch * ctx // PAGE, dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    buf = torch.zeros(16 * 4 * batch * 256, dtype=torch.int64, device=dev)
    flush = torch.empty(FLUSH, dtype=torch.int8, device=dev)
    acc = {k: [] for k in ("entry_after_first", "finish_before_last", "span_us", "clock_ghz", *STEPS)}
    try:
        md.PROBE_BUFFER = buf
        for i in range(calls + 2):
            buf.zero_()
            flush.zero_()
            md.mla_decode(q, kv, None, table, lens, SCALE, "bf16", D_LATENT, validate=False, max_seq_len=ctx)
            torch.cuda.synchronize()
            if i < 2:  # compile, warm-up
                continue
            st = buf.view(-1, 16)
            st = st[st[:, 0] != 0].double()
            g, c = st[:, 0:14:2], st[:, 1:14:2]
            ghz = ((c[:, 6] - c[:, 0]) / (g[:, 6] - g[:, 0])).median().item()
            acc["clock_ghz"].append(ghz)
            acc["entry_after_first"] += ((g[:, 0] - g[:, 0].min()) / 1e3).tolist()
            acc["finish_before_last"] += ((g[:, 6].max() - g[:, 6]) / 1e3).tolist()
            acc["span_us"].append(((g[:, 6].max() - g[:, 0].min()) / 1e3).item())
            for j, name in enumerate(STEPS):  # (slot j + 1 minus slot j, in this SM's cycles)
                acc[name] += ((c[:, j + 1] - c[:, j]) / ghz / 1e3).tolist()
            sms = st[:, 14].long()
        programs = int(st.shape[0])
    finally:
        md.PROBE_BUFFER = None
    per_sm = torch.bincount(sms).max().item()
    return {"kind": "bf16", "batch": batch, "ctx": ctx, "programs": programs, "splits": md.last_launch()[0],
            "sms_used": int(sms.unique().numel()), "max_programs_per_sm": per_sm,
            "clock_ghz": round(statistics.median(acc.pop("clock_ghz")), 3),
            "span_us": _pct(acc.pop("span_us"), (0, 50, 100)),
            **{k: _pct(v) for k, v in acc.items()}}


def pdl_rounds(kind: str, batch: int, ctx: int, rounds: int) -> dict:
    import mla_quant.kernels._pdl as pdl
    from mla_quant.kernels.mla_decode import mla_decode

    dev = "cuda"
    (q, table), = _sets(batch, ctx, 1, dev)
    kv, sc = _pool(kind, batch * ctx // PAGE, dev)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)

    def with_skip(skip):
        def call():
            with module_attrs(pdl, {"SKIP": skip}):
                return mla_decode(q, kv, sc, table, lens, SCALE, kind, D_LATENT, validate=False, max_seq_len=ctx)
        return call

    settings = {"as_is": with_skip(pdl.SKIP),
                "merge_early": with_skip(pdl.SKIP - {"mla_decode_merge"}),
                "both_early": with_skip(pdl.SKIP - {"mla_decode_merge", "mla_decode"})}
    return _medians(interleaved_graph_us(settings, rounds=rounds))


def config_rounds(batch: int, ctx: int, configs: dict, rounds: int, heads: int = HEADS) -> dict:
    """Interleaved rounds of ``mla_decode.TMA_CONFIG`` variants (name -> overrides) on BF16 pages, input sets and
    graphs as in ``sweep_mla_decode``; each variant's output compared with the launcher's."""
    import mla_quant.kernels.mla_decode as md

    n_sets = rotation_sets(batch, ctx, "bf16")
    kv, _ = _pool("bf16", n_sets * batch * ctx // PAGE, "cuda")
    sets = _sets(batch, ctx, n_sets, "cuda", heads)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

    def setting(over):
        def call():
            with module_attrs(md, {"TMA_CONFIG": {**md.TMA_CONFIG, **over}}):
                return [md.mla_decode(q, kv, None, t, lens, SCALE, "bf16", D_LATENT, validate=False,
                                      max_seq_len=ctx) for q, t in sets]
        return call

    fns = {"launcher": setting({}), **{name: setting(over) for name, over in configs.items()}}
    ref = fns["launcher"]()[0][0].float()
    err = {k: float((f()[0][0].float() - ref).abs().max() / ref.abs().max()) for k, f in fns.items()}
    times = _medians(interleaved_graph_us(fns, reps=len(sets), rounds=rounds))
    moved = batch * ctx * _row_bytes("bf16") + batch * heads * 2 * (D + D_LATENT)
    out = {"batch": batch, "ctx": ctx, "heads": heads, "sets": len(sets), "rel_err_vs_launcher": err, **times}
    out.update({f"{k}_TBps": round(moved / t / 1e6, 3) for k, t in times.items() if not isinstance(t, str)})
    return out


PARTS = ("ceilings", "shapes", "timeline", "tiles", "pdl", "warps")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_mla_fixed.json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    args = ap.parse_args()
    parts = args.parts.split(",")
    res = {"commit": os.environ.get("MLA_QUANT_COMMIT", "unknown"), "device": torch.cuda.get_device_name()}
    copy_at(2**30)  # (the clocks ramp up: the first timing of an idle GPU read 2.7 TB/s)
    if "ceilings" in parts:
        res["copy_1gib"] = copy_at(2**31)
        res["floor"] = floor()
        res["copy_at_32x4k"] = copy_at(32 * 4096 * 2 * D)
        res["copy_at_64x4k"] = copy_at(64 * 4096 * 2 * D)
        print(json.dumps(res), flush=True)
    if "shapes" in parts:
        res["shapes"] = []
        for kind, batch, ctx in (("bf16", 32, 4096), ("fp8_e4m3", 32, 4096), ("bf16", 16, 8192),
                                 ("fp8_e4m3", 16, 8192), ("bf16", 64, 4096), ("fp8_e4m3", 64, 4096),
                                 ("bf16", 1, 4096), ("fp8_e4m3", 1, 4096)):
            res["shapes"].append(shape_probe(kind, batch, ctx))
            print(json.dumps(res["shapes"][-1]), flush=True)
            torch.cuda.empty_cache()
    if "timeline" in parts:
        res["timeline"] = []
        for b, c in ((32, 4096), (64, 4096), (1, 4096), (32, 1024)):
            res["timeline"].append(timeline(b, c))
            print(json.dumps(res["timeline"][-1]), flush=True)
    if "tiles" in parts:
        res["tiles"] = [tiles_fit("bf16"), tiles_fit("fp8_e4m3")]
        print(json.dumps(res["tiles"]), flush=True)
    if "pdl" in parts:
        res["pdl"] = {f"{k}_{b}x{c}": pdl_rounds(k, b, c, args.rounds) for k, b, c in
                      (("bf16", 32, 4096), ("fp8_e4m3", 32, 4096), ("bf16", 64, 4096))}
        print(json.dumps(res["pdl"]), flush=True)
    if "warps" in parts:  # TMA_CONFIG with 16 warps (128 registers, 212 B of spills at sm_90) against 8
        res["warps"] = []
        for b, c in ((32, 4096), (16, 8192), (64, 4096), (128, 4096), (64, 65536), (1, 4096)):
            res["warps"].append(config_rounds(b, c, {"w16": {"num_warps": 16}}, args.rounds))
            print(json.dumps(res["warps"][-1]), flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
