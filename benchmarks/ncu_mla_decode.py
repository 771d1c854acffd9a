"""Nsight Compute profiles of the MLA decode kernel, and their summary (the H200 machine has ``ncu``).

    # on the GPU: one launch per case under ncu, then the summary of the reports
    python -m benchmarks.ncu_mla_decode --run --out ncu_mla_decode.json [--folder DIR] [--only bf16 ...]
    # one case's launch alone (what --run starts under ncu)
    python -m benchmarks.ncu_mla_decode --case KIND DEQUANT BATCH CTX HEADS

Each case (``CASES``: 16 heads, batch 64 × 4k, bf16 pages and the fp8_e4m3 choices) runs its launch three times;
ncu profiles the third (``--launch-skip 2``) with the sections that say where the time goes (speed of light,
occupancy, warp states, scheduler, source counters). The summary per case: duration (ncu locks the clocks, so
absolute times are above the bench's), DRAM and issue throughput, registers, warps per scheduler, the stall
reasons per issued instruction, and the warp-level instructions per KV token by opcode (from the SASS source
page) — the numbers docs/mla.md "Where the FP8 time goes" quotes.
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import re
import subprocess
import sys

CASES = (("bf16", "auto"), ("fp8_e4m3", "auto"), ("fp8_e4m3", "fp8mma"), ("fp8_e4m3", "convert"))
SHAPE = (64, 4096, 16)  # batch, ctx, heads
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats",
            "MemoryWorkloadAnalysis", "SourceCounters")
# raw-page metrics kept in the summary, and the factors that bring ncu's units to the summary's (µs, TB/s)
METRICS = {
    "gpu__time_duration.sum": "duration_us",
    "dram__bytes.sum.per_second": "dram_tbps",
    "sm__inst_executed.avg.pct_of_peak_sustained_elapsed": "issue_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "smsp__warps_active.avg.per_cycle_active": "warps_per_scheduler",
    "smsp__warps_eligible.avg.per_cycle_active": "eligible_per_scheduler",
    "smsp__inst_executed.sum": "warp_instructions",
}
UNITS = {"duration_us": {"nsecond": 1e-3, "msecond": 1e3}, "dram_tbps": {"Gbyte/s": 1e-3, "Mbyte/s": 1e-6}}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def run_case(kind: str, dequant: str, batch: int, ctx: int, heads: int) -> None:
    """Three launches of one bench case (ncu profiles the third)."""
    import torch

    from mla_quant.kernels.mla_decode import last_launch, mla_decode

    from .bench_mla_decode import D_LATENT, PAGE, SCALE, _fill_pool, _input_sets

    num_pages = batch * ctx // PAGE
    pool, scales = _fill_pool(kind, num_pages, "cuda")
    q, table = _input_sets(batch, ctx, heads, kind, num_pages, "cuda")[0]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    for _ in range(3):
        mla_decode(q, pool, scales, table, seq_lens, SCALE, kind, D_LATENT, max_seq_len=ctx, validate=False,
                   fp8_dequant=dequant)
    torch.cuda.synchronize()
    print(kind, dequant, batch, ctx, heads, last_launch())


def _csv_rows(text: str) -> list[list[str]]:
    return [r for r in csv.reader(io.StringIO(text)) if r]


def summarize_raw(text: str) -> dict:
    """The METRICS and stall reasons of one kernel from ``ncu --page raw --csv`` (header, units, values)."""
    rows = _csv_rows(text)
    header = next(r for r in rows if "gpu__time_duration.sum" in r)
    units = dict(zip(header, rows[rows.index(header) + 1]))
    raw = dict(zip(header, rows[rows.index(header) + 2]))
    out = {}
    for metric, name in METRICS.items():
        try:
            value = float(raw[metric].replace(",", ""))
        except (KeyError, ValueError):
            continue
        out[name] = round(value * UNITS.get(name, {}).get(units.get(metric, ""), 1.0), 3)
    stalls = {}
    for metric, value in raw.items():
        m = STALL.fullmatch(metric)
        if m:
            try:
                stalls[m.group(1)] = round(float(value), 3)
            except ValueError:
                pass
    out["stalls_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:10])
    return out


def summarize_source(text: str, tokens: int, top: int = 16) -> dict:
    """Warp-level instructions per KV token by opcode (register moves ``IMAD.MOV`` apart) and each opcode's share of
    the stall samples, from ``ncu --page source --csv --print-source sass``."""
    rows = _csv_rows(text)
    header = next(r for r in rows if "Source" in r and "Instructions Executed" in r)
    ix = {h: i for i, h in enumerate(header)}
    count, stall, moves = collections.Counter(), collections.Counter(), 0.0
    for r in rows[rows.index(header) + 1:]:
        try:
            n = float(r[ix["Instructions Executed"]] or 0)
            sampled = float(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        except (ValueError, IndexError):
            continue
        source = r[ix["Source"]].strip()
        m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", source)
        op = m.group(1) if m else "?"
        count[op] += n
        stall[op] += sampled
        moves += n if "IMAD.MOV" in source else 0.0
    total, samples = sum(count.values()), sum(stall.values()) or 1.0
    return {"warp_instr_per_token": round(total / tokens, 1),
            "per_token_by_opcode": {op: round(c / tokens, 1) for op, c in count.most_common(top)},
            "imad_mov_per_token": round(moves / tokens, 1),
            "stall_sample_share": {op: round(c / samples, 3) for op, c in stall.most_common(top)}}


def profile(rep: str, kernel_regex: str, case_cmd: list[str], ncu_args: tuple[str, ...] = ()):
    """Run ``case_cmd`` (a python module's argument list) under ncu, profiling the third launch of the kernels named by
    ``kernel_regex`` with SECTIONS into ``rep``.ncu-rep. Returns (the run's stdout, a function reading one of the
    report's pages by ncu's ``--page`` arguments), or (the error's tail, None)."""
    cmd = ["ncu", "-k", f"regex:{kernel_regex}", "--launch-skip", "2", "--launch-count", "1", *ncu_args, "-f",
           "-o", rep]
    for s in SECTIONS:
        cmd += ["--section", s]
    log = subprocess.run(cmd + [sys.executable, "-m", *case_cmd], capture_output=True, text=True, timeout=300)
    if log.returncode or not os.path.exists(rep + ".ncu-rep"):
        return (log.stdout + log.stderr)[-1500:], None

    def page(*args):
        return subprocess.run(["ncu", "-i", rep + ".ncu-rep", *args], capture_output=True, text=True,
                              timeout=300).stdout
    return log.stdout, page


def run_all(folder: str, only: list[str] | None) -> dict:
    batch, ctx, heads = SHAPE
    os.makedirs(folder, exist_ok=True)
    cases = {}
    for kind, dequant in CASES:
        name = f"{kind}_{dequant}"
        if only and not any(o in name for o in only):
            continue
        out, page = profile(os.path.join(folder, name), "_mla_decode_kernel",
                            ["benchmarks.ncu_mla_decode", "--case", kind, dequant, str(batch), str(ctx), str(heads)])
        if page is None:
            cases[name] = {"error": out}
            continue
        launch = [ln for ln in out.splitlines() if ln.startswith(kind)]
        row = {"launch": launch[-1] if launch else None, **summarize_raw(page("--page", "raw", "--csv")),
               **summarize_source(page("--page", "source", "--csv", "--print-source", "sass"), batch * ctx)}
        cases[name] = row
        print(name, json.dumps(row)[:400], flush=True)
    return {"shape": {"batch": batch, "ctx": ctx, "heads": heads}, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs=5, metavar=("KIND", "DEQUANT", "BATCH", "CTX", "HEADS"))
    ap.add_argument("--run", action="store_true", help="profile CASES under ncu and summarize")
    ap.add_argument("--folder", default="/tmp/ncu_mla_decode", help="where the .ncu-rep reports go")
    ap.add_argument("--only", nargs="*", help="cases whose name contains one of these")
    ap.add_argument("--out", default="ncu_mla_decode.json")
    args = ap.parse_args(argv)
    if args.case:
        kind, dequant, *dims = args.case
        run_case(kind, dequant, *map(int, dims))
        return 0
    if not args.run:
        ap.print_help()
        return 2
    result = run_all(args.folder, args.only)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
