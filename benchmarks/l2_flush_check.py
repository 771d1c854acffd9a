"""Does the L2 flush between timed runs bias short, bandwidth-bound cases? ``triton.testing.do_bench`` (our
``median_us``) zeroes a 256 MB buffer before every run, which leaves L2 (50 MB on the H200) full of *dirty*
lines: the timed kernel then pays their write-back to HBM on top of its own traffic — up to ~50 MB, a sixth of a
302 MB decode (16 heads, batch 64, 4k, BF16) but 2.5 % of the 2 GiB copy that sets the copy ceiling. A decode
step's L2 holds mostly clean lines (the weights the projections just read), so this times each case after both
flushes: ``dirty`` (do_bench's zeroing) and ``clean`` (a read of the same 256 MB buffer: L2 full of clean lines).

    python -m benchmarks.l2_flush_check [--out l2_flush.json]

Cases: device-to-device copies of 64 MB to 1 GiB (bytes read + written), and the BF16 MLA decode at 16 heads,
batch 64, contexts 4k and 64k (``bench_mla_decode``'s shapes, one CUDA-graph replay per run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from .common import _captured

FLUSH_BYTES = 256 * 2**20


def timed_us(fn, flush, reps: int = 60, warmup: int = 5) -> float:
    """Median µs of ``fn()`` over ``reps`` runs, each after ``flush()``, timed by CUDA events."""
    for _ in range(warmup):
        flush()
        fn()
    times = []
    for _ in range(reps):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graphed(fn):
    """The replay of ``fn`` captured in a CUDA graph (``common._captured``)."""
    return _captured(fn).replay


def both_flushes(label: str, bytes_moved: int, fn, flushes: dict) -> dict:
    """One results row: ``fn`` timed after each flush, µs and TB/s."""
    row = {"case": label, "bytes": bytes_moved}
    for name, flush in flushes.items():
        t = timed_us(fn, flush)
        row[f"{name}_us"], row[f"{name}_tbps"] = round(t, 3), round(bytes_moved / t / 1e6, 3)
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="l2_flush.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (run it on the H200)", file=sys.stderr)
        return 2
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    flushes = {"dirty": buf.zero_, "clean": buf.sum}
    rows = []
    for mb in (64, 151, 256, 1024):
        src = torch.randn(mb * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        rows.append(both_flushes(f"copy {mb} MB", 2 * src.numel() * 2, graphed(lambda: dst.copy_(src)), flushes))
        del src, dst
    from mla_quant.kernels.mla_decode import mla_decode

    from .bench_mla_decode import D_LATENT, D_ROPE, PAGE, SCALE, _fill_pool
    for n in (4096, 65536):
        batch, heads = 64, 16
        pool, scales = _fill_pool("bf16", batch * n // PAGE, "cuda")
        table = torch.randperm(batch * n // PAGE, device="cuda").to(torch.int32).reshape(batch, -1)
        seq_lens = torch.full((batch,), n, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 1, heads, D_LATENT + D_ROPE, device="cuda", dtype=torch.bfloat16)
        fn = graphed(lambda: mla_decode(q, pool, scales, table, seq_lens, SCALE, "bf16", D_LATENT, max_seq_len=n,
                                        validate=False))
        rows.append(both_flushes(f"mla_decode bf16 16h batch 64 ctx {n}", batch * n * (D_LATENT + D_ROPE) * 2, fn,
                                 flushes))
        del pool, scales
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
