"""Static profile of the INT4 tensor-core tiles of ``fused_moe`` on sm_90, without a GPU (docs/moe.md, "The INT4
plane tile").

    PYTHONPATH=. /path/to/venv-triton-3.6/bin/python -m benchmarks.moe_tile_sass [--block-m 16 32 64] [--dump DIR]

Compiles, through ``compile_check``'s fake Hopper, every autotune candidate ``fused_moe`` keeps for INT4 experts
at Kimi K2.6 shapes (gate-up: N = 2048, K = 7168, gated; down: N = 7168, K = 2048) at each ``block_m``, in both
``int4_tile`` forms ("dequant": the [BN, BK] dequantized tile, the default; "planes": one dot per nibble plane),
disassembles each kernel and counts the instructions of its K loop: global loads (LDG, LDGSTS), shared stores /
loads / ldmatrix / barriers, tensor-core ops (HMMA: mma.sync, HGMMA: wgmma), the unpack / scale ops; registers,
spills, programs per SM and **warp-instructions per weight** (loop instructions x warps / weights per
iteration). Static counts only: nothing runs.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import compile_check as cc
from benchmarks.sass_tools import collect_compiled, loop_profile

COLUMNS = ("LDG", "LDGSTS", "STS", "LDS", "LDSM", "BAR", "HMMA", "HGMMA", "SHF", "LOP3", "PRMT", "FADD", "FMUL",
           "FFMA", "F2FP", "HADD2", "HMUL2", "HFMA2")
HIDDEN, INTER, EXPERTS, TOP_K = 7168, 2048, 8, 8  # Kimi K2.6 widths; the number of experts does not change the code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--forms", nargs="+", default=["dequant", "planes"])
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="activation dtype (float32: the IEEE fp32 dots of the exact mode)")
    parser.add_argument("--dump", help="folder for each kernel's .ttgir / .ptx / .sass")
    args = parser.parse_args(argv)
    with collect_compiled(("_moe_gemm_kernel",)) as (log, compiled):
        from mla_quant.kernels.fused_moe import fused_moe

        gate, up, down = (cc._moe_weights("int4_group", EXPERTS, n, k) for n, k in ((INTER, HIDDEN), (INTER, HIDDEN),
                                                                                  (HIDDEN, INTER)))
        print(f"{'kernel':40s} regs spill prog/SM | loop instr/iter (per thread) " + " ".join(COLUMNS)
              + " | warp-instr/weight")
        for bm in args.block_m:
            tokens = bm * EXPERTS // TOP_K  # every token routed to all 8 experts: bm rows per expert
            x = torch.randn(tokens, HIDDEN, dtype=getattr(torch, args.dtype))
            ids = torch.arange(EXPERTS, dtype=torch.int32)[None].expand(tokens, TOP_K).contiguous()
            w = torch.ones(tokens, TOP_K)
            for form in args.forms:
                start = len(compiled)
                fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=bm, int4_tile=form)
                for _, kw, kernel in compiled[start:]:
                    bn, bk, gated, warps = kw["BLOCK_N"], kw["BLOCK_K"], kw["GATED"], kw["num_warps"]
                    tag = f"m{bm} {form} {'gate-up' if gated else 'down'} {bn}x{bk} w{warps} s{kw['num_stages']}"
                    body, counts, regs, spills, progs = loop_profile(log, kernel, warps, args.dump,
                                                                     tag.replace(" ", "_"))
                    weights = bn * bk * (2 if gated else 1)
                    print(f"{tag:40s} {regs:4} {spills:5} {progs:7} | {len(body):5} "
                          + " ".join(f"{counts[c]:>{len(c)}}" for c in COLUMNS)
                          + f" | {len(body) * warps / weights:.4f}", flush=True)
    if log.errors:
        print("\n".join(log.errors))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
