"""Host-side cost of the launchers, measured without a GPU.

    PYTHONPATH=. python -m benchmarks.host_overhead [op ...] [--calls 200] [--profile]

``compile_check``'s fake-Hopper driver makes every launch compile once and then return without running, and the
autotuners keep their first configuration (their timing is faked), so what is timed is the Python a caller pays per
call beside the GPU work: input checks, launch planning, Triton's launcher. An eager caller pays it on every layer;
a CUDA-graph replay does not. Ops (``CASES``): ``fp8_linear`` (act_quant_fp8 + fp8_gemm at one token, 2048 × 7168),
``w4a16`` (w4a16_gemm at one token, 2048 × 7168), ``mla_decode`` (bf16 pages, 16 heads, batch 4 × 4k).
``--profile`` prints the top functions by cumulative time.

Session 17 (Triton 3.6, the 2-core CI machine): ``fp8_linear`` 190 µs per call before the launchers stopped calling
``triton.cdiv`` / ``triton.next_power_of_2`` from Python (``kernels._host``), 128 µs after.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from .compile_check import CompileLog, install_fake_hopper


def _fp8_linear():
    from mla_quant.kernels.fp8_gemm import fp8_gemm
    from mla_quant.kernels.fp8_quant import FP8, act_quant_fp8
    x = torch.randn(1, 7168, dtype=torch.bfloat16)
    w, ws = torch.zeros(2048, 7168, dtype=FP8), torch.ones(16, 56)

    def call():
        q, s = act_quant_fp8(x, 128)
        return fp8_gemm(q, s, w, ws)
    return call


def _w4a16():
    from mla_quant.kernels.w4a16_gemm import w4a16_gemm
    x = torch.randn(1, 7168, dtype=torch.bfloat16)
    packed, scale = torch.zeros(2048, 7168 // 8, dtype=torch.int32), torch.ones(2048, 7168 // 32, dtype=torch.bfloat16)
    return lambda: w4a16_gemm(x, packed, scale, 32)


def _mla_decode():
    from mla_quant.kernels.mla_decode import mla_decode
    batch, ctx, page = 4, 4096, 64
    q = torch.randn(batch, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(batch * ctx // page, page, 576, dtype=torch.bfloat16)
    table = torch.arange(batch * ctx // page, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    return lambda: mla_decode(q, kv, None, table, lens, 0.1, "bf16", 512, validate=False)


CASES = {"fp8_linear": _fp8_linear, "w4a16": _w4a16, "mla_decode": _mla_decode}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("ops", nargs="*", default=list(CASES), help=f"of {list(CASES)}")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    from triton.runtime import autotuner
    real_run = autotuner.Autotuner.run
    install_fake_hopper(CompileLog(), ptxas=False)
    autotuner.Autotuner.run = real_run  # the real autotuner (it caches its choice); its timing is faked below
    autotuner.Autotuner._bench = lambda self, *a, **k: [1.0, 1.0, 1.0]
    for op in args.ops:
        call = CASES[op]()
        for _ in range(3):  # compile and pick the configurations
            call()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        print(f"{op:12s} {1e6 * (time.perf_counter() - t0) / args.calls:8.1f} µs per call (host, no launch)",
              flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(50):
                call()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(12)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
