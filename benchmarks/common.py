"""Shared benchmark machinery: ceilings measured in the same run, medians of many runs, the results file.

Every bench module ``benchmarks/bench_<name>.py`` exposes ``run(ctx: Context) -> list[dict]`` returning
cases made by :func:`case` (schema in DESIGN.md, "Benchmark results file").
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import itertools
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

L2_BYTES = 60 * 2**20  # H200 L2 is 50 MB; rotate inputs past this so reads come from HBM
RESULTS = Path(__file__).parent / "results" / "h200.json"


@dataclass
class Context:
    device: str = "cuda"
    quick: bool = False
    copy_tbps: float = 0.0
    bf16_tflops: float = 0.0
    notes: list[str] = field(default_factory=list)


def sweep_args(doc: str, out: str, budget_s: float | None, argv: list[str] | None = None,
               extra=lambda ap: None) -> argparse.Namespace | None:
    """Arguments of a one-call GPU sweep or profile (``--out``, ``--budget-s`` unless ``budget_s`` is None — the
    sweeps timed in interleaved rounds have no budget — and what ``extra`` adds to the parser); None (after
    saying so) when there is no CUDA device to run on."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=out)
    if budget_s is not None:
        ap.add_argument("--budget-s", type=float, default=budget_s, help="stop starting new settings after this long")
    extra(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{ap.prog} needs CUDA (run it on the H200)", file=sys.stderr)
        return None
    return args


def median_us(fn, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn()`` in µs (triton.testing.do_bench, L2 flushed between runs)."""
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def _captured(fn):
    """``fn`` called once eagerly (compile / autotune outside the capture), then captured in a CUDA graph."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_us(fn, reps: int = 1, warmup_ms: float = 25, rep_ms: float = 100) -> tuple[float, bool]:
    """Median µs of one of ``reps`` calls made by ``fn()``, replayed from a CUDA graph, so host-side launch
    overhead is excluded for ours and the peers alike (as in a CUDA-graph decode loop). Falls back to eager
    timing when capture fails. Returns (µs, captured)."""
    import torch

    try:
        graph = _captured(fn)
        t = median_us(graph.replay, warmup_ms, rep_ms) / reps
        del graph
        return t, True
    except RuntimeError:
        torch.cuda.synchronize()
        return median_us(fn, warmup_ms, rep_ms) / reps, False


@contextlib.contextmanager
def module_attrs(module, values: dict):
    """Set attributes of ``module`` (a launcher's module constants: a sweep's setting) for the ``with`` body."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def interleaved_graph_us(fns: dict, reps: int = 1, rounds: int = 5, warmup_ms: float = 10,
                         rep_ms: float = 30) -> dict[str, list[float]]:
    """For settings whose differences are near the run-to-run drift: each ``fns[name]()`` (``reps`` calls) is
    captured once in a CUDA graph (after one eager call: compile, autotune), then the graphs are timed in
    ``rounds`` round-robin passes (do_bench medians, L2 flushed between replays), so slow drift of the clocks
    or the host reaches every setting alike. Passes after the first take the settings in a shuffled order (seeded
    by the pass), so no setting always follows the same one: on the H200 a kernel timed right after a lighter one
    read up to 8 % faster (session 24, the FP8 GEMM: the clocks recover under less load; a rotated order keeps
    every setting's predecessor). Returns name -> the µs per call of each round (in round order); a setting whose
    first call or capture raised maps to its error message instead."""
    import torch

    graphs, out = {}, {}
    for name, fn in fns.items():
        try:
            graphs[name], out[name] = _captured(fn), []
        except Exception as e:  # noqa: BLE001 - one setting that fails to compile or capture is a finding
            torch.cuda.synchronize()
            out[name] = f"{type(e).__name__}: {e}"[:300]
    for order in round_orders(list(graphs), rounds):
        for name in order:
            out[name].append(median_us(graphs[name].replay, warmup_ms, rep_ms) / reps)
    return out


def round_orders(names: list, rounds: int) -> list[list]:
    """The order of each of ``rounds`` passes over ``names`` (``interleaved_graph_us``): as given, then shuffled
    with the pass number as the seed (reproducible)."""
    orders = []
    for r in range(rounds):
        order = list(names)
        if r:
            random.Random(r).shuffle(order)
        orders.append(order)
    return orders


def random_kv_pool(kind: str, num_pages: int, page: int, d_latent: int, d_rope: int, device: str):
    """One layer's MLA pages in ``kind`` (kernels/kv_layout.py) with realistic values and no NaN bit
    patterns, filled chunk by chunk so huge pools need little scratch. Returns (data, scales)."""
    from mla_quant.kernels.kv_layout import DS_MLA_TILE, kv_data_dtype, kv_row_width

    width = kv_row_width(kind, d_latent, d_rope)
    data = torch.empty(num_pages, page, width, dtype=kv_data_dtype(kind), device=device)
    scales = torch.rand(num_pages, page, device=device) * 0.02 + 0.01 if kind == "fp8_e4m3" else None
    n_tiles = d_latent // DS_MLA_TILE
    for lo in range(0, num_pages, 4096):
        hi = min(num_pages, lo + 4096)
        rows = torch.randn(hi - lo, page, d_latent + d_rope, device=device, dtype=torch.bfloat16)
        if kind == "bf16":
            data[lo:hi] = rows
        elif kind == "fp8_e4m3":
            data[lo:hi] = rows.to(torch.float8_e4m3fn)
        else:  # fp8_ds_mla: e4m3 latent | fp32 power-of-two tile scales | bf16 rope
            chunk = data[lo:hi]
            chunk.view(torch.float8_e4m3fn)[..., :d_latent] = rows[..., :d_latent].to(torch.float8_e4m3fn)
            exps = torch.randint(-8, -4, (hi - lo, page, n_tiles), device=device).float()
            chunk.view(torch.float32)[..., d_latent // 4: d_latent // 4 + n_tiles] = torch.exp2(exps)
            chunk.view(torch.bfloat16)[..., (d_latent + 4 * n_tiles) // 2:] = rows[..., d_latent:]
    return data, scales


def rotating(make_inputs, bytes_per_set: int, min_sets: int = 2, max_sets: int = 32):
    """Build enough independent input sets that cycling through them exceeds the L2 cache.
    Returns a zero-argument function yielding the next set."""
    n = max(min_sets, min(max_sets, -(-3 * L2_BYTES // max(bytes_per_set, 1))))
    sets = [make_inputs() for _ in range(n)]
    cycle = itertools.cycle(sets)
    return lambda: next(cycle)


def measure_ceilings(ctx: Context) -> None:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate, in this run."""
    n = 2**30 // 2  # 1 GiB of bf16
    src = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = median_us(lambda: dst.copy_(src))
    ctx.copy_tbps = 2 * src.numel() * 2 / (t * 1e-6) / 1e12
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=ctx.device, dtype=torch.bfloat16)
    t = median_us(lambda: a @ b)
    ctx.bf16_tflops = 2 * m**3 / (t * 1e-6) / 1e12


def measured_context() -> Context:
    """A sweep's CUDA :class:`Context` with this run's ceilings measured and printed (its rates are fractions of
    them)."""
    ctx = Context(device="cuda")
    measure_ceilings(ctx)
    print(f"copy {ctx.copy_tbps:.3f} TB/s, bf16 matmul {ctx.bf16_tflops:.0f} TFLOP/s", flush=True)
    return ctx


def case(bench: str, case: dict, median_us: float, bytes: int = 0, flops: int = 0,
         peer: str | None = None, peer_median_us: float | None = None, **extra) -> dict:
    """One results row; derived rates are added for convenience (readers may recompute them)."""
    row = {"bench": bench, "case": case, "median_us": round(median_us, 3), "bytes": int(bytes),
           "flops": int(flops), "peer": peer,
           "peer_median_us": None if peer_median_us is None else round(peer_median_us, 3)}
    if bytes:
        row["tbps"] = round(bytes / (median_us * 1e-6) / 1e12, 4)
    if flops:
        row["tflops"] = round(flops / (median_us * 1e-6) / 1e12, 2)
    if peer_median_us:
        row["speedup_vs_peer"] = round(peer_median_us / median_us, 3)
    row.update(extra)
    return row


def _git_commit() -> str:
    """MLA_QUANT_COMMIT first: the device's copy of the tree has no .git of its own (a rev-parse there found
    an unrelated repository's HEAD)."""
    if os.environ.get("MLA_QUANT_COMMIT"):
        return os.environ["MLA_QUANT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def meta(ctx: Context) -> dict:
    import triton

    return {"commit": _git_commit(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "copy_tbps": round(ctx.copy_tbps, 4), "bf16_tflops": round(ctx.bf16_tflops, 2), "notes": ctx.notes}


def _case_key(case: dict) -> tuple[str, str]:
    return case["bench"], json.dumps(case["case"], sort_keys=True)


def write_results(path: Path, ctx: Context, cases: list[dict], replace_benches: set[str] | None = None) -> None:
    """Write the results file. A full run (``replace_benches`` None, or no file yet) writes its meta and cases. A
    partial run (the benches in ``replace_benches``) merges into the existing file: its cases replace the rows of the
    same bench and case, every other row stays; each row then names its run's commit (meta "commit": "per-row"), and
    the file's notes stay, with one note for this run (rewritten, not repeated, by the per-bench writes of a run)."""
    run = meta(ctx)
    if replace_benches is None or not path.exists():
        doc = {"meta": run, "cases": cases}
    else:
        old = json.loads(path.read_text())
        old_commit = old["meta"].get("commit", "unknown")
        fresh = [{**c, "commit": c.get("commit", run["commit"])} for c in cases]
        keys = {_case_key(c) for c in fresh}
        kept = [c if "commit" in c or old_commit == "per-row" else {**c, "commit": old_commit}
                for c in old["cases"] if _case_key(c) not in keys]
        head = (f"run of {run['commit']} on {run['device']} (copy {run['copy_tbps']} TB/s, bf16 {run['bf16_tflops']} "
                f"TFLOP/s)")
        notes = [n for n in old["meta"].get("notes", []) if not n.startswith(head)]
        notes.append(f"{head}, {run['date']}: {', '.join(sorted(replace_benches))}, {len(cases)} cases"
                     + "".join(f"; {n}" for n in ctx.notes))
        doc = {"meta": {**old["meta"], "commit": "per-row", "notes": notes}, "cases": kept + fresh}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def rel_err(y, ref) -> float:
    """max |y - ref| / max |ref| (a sweep's check of a setting against its reference)."""
    ref = ref.float()
    return float((y.float() - ref).abs().max() / ref.abs().max())


def write_labelled(path: str, result: dict, label: str | None) -> None:
    """Write a sweep's ``result`` to ``path`` as JSON; with ``label``, under that key of the file's existing document
    (its other keys kept), so one results file holds the runs of several calls."""
    import json
    import os

    if label and os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        doc[label] = result
        result = doc
    elif label:
        result = {label: result}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
