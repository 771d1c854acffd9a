"""Static profile of the INT4 GEMV loops on sm_90, without a GPU (docs/moe.md, "The INT4 plane GEMV").

    PYTHONPATH=. /path/to/venv-triton-3.6/bin/python -m benchmarks.gemv_sass [--dump DIR]
    PYTHONPATH=. python -m benchmarks.gemv_sass --fragments    # the fragment kernel's MMA operand layouts (JSON)
    PYTHONPATH=. python -m benchmarks.gemv_sass --rows         # the whole-row GEMVs (gemv.py, gemv_half2.py)

Compiles, through ``compile_check``'s fake Hopper, every autotune candidate the launchers keep for one token
at Kimi K2.6 shapes — ``fused_moe`` INT4 at ``block_m=1`` (gate-up: N = 2048, K = 7168, gated; down:
N = 7168, K = 2048) in each ``gemv`` form, and ``w4a16_gemm`` at M = 1 (7168 x 7168) in each form —
disassembles each kernel (``cuobjdump -sass``) and counts the instructions of its longest loop (the K loop):
global loads (LDG, with the 128-bit ones), shared stores / loads and barriers (layout conversions), the
unpack and FP ops; plus registers, spills, programs per SM and **warp-instructions per weight** (loop
instructions x warps / weights per iteration). Static counts only: nothing runs.
"""
from __future__ import annotations

import argparse
import json
import re

import torch

from benchmarks import compile_check as cc
from benchmarks.sass_tools import collect_compiled, disassemble, loop_profile, opcode

COLUMNS = ("LDG", "LDG128", "STS", "LDS", "BAR", "SHFL", "LOP3", "SHF", "FADD", "FMUL", "FFMA", "IMAD", "PRMT",
           "HFMA2", "HADD2")
HIDDEN, INTER, EXPERTS = 7168, 2048, 4  # Kimi K2.6 widths; the number of experts does not change the code


def mma_layouts(ttgir: str) -> list[str]:
    """The distinct layouts of the tensors that the inline-asm ``mma.sync`` ops of a TTGIR module take and return."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, flags=re.M))
    used = {name for line in ttgir.splitlines() if "mma.sync" in line
            for name in re.findall(r"tensor<[^>]*, (#\w+)>", line)}
    return sorted(aliases.get(name, name) for name in used)


def staged_before_mma(ttgir: str) -> int:
    """TTGIR ops that move data between threads (``convert_layout``, shared-memory allocs / loads / stores) placed
    before the module's last ``mma.sync`` (program order: the main loop comes before the epilogue)."""
    lines = ttgir.splitlines()
    last = max((i for i, line in enumerate(lines) if "mma.sync" in line), default=-1)
    moves = ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.local_store")
    return sum(any(op in line for op in moves) for line in lines[:last])


def fragment_layouts() -> dict:
    """Compile the fragment kernel (``w4a16_gemm/fragments.py``) for sm_90 at 2, 8 and 16 tokens (every launch tile):
    per kernel the layouts of its MMA operands (each must hold one element per thread, lanes in order, for the
    warp-wide ``mma.sync`` to see the fragments it was given), the count of MMA ops, the data moves between threads
    before the last MMA and the shared memory (Triton 3.9's store coalescing lays the split-K epilogue out through
    shared memory; 3.6 does not)."""
    with collect_compiled(("_w4a16_frag_kernel",)) as (_, compiled):
        from mla_quant.kernels.w4a16_gemm import w4a16_gemm

        packed, scale = torch.zeros(2048, HIDDEN // 8, dtype=torch.int32), torch.ones(2048, HIDDEN // 32,
                                                                                      dtype=torch.bfloat16)
        for m in (2, 8, 16):
            w4a16_gemm(torch.randn(m, HIDDEN, dtype=torch.bfloat16), packed, scale, 32, fragments=True)
    return {f"NT{kw['NT']} BK{kw['BK']} W{kw['W']}": {
        "layouts": mma_layouts(kernel.asm["ttgir"]), "num_warps": kw["num_warps"],
        "mma_ops": sum("mma.sync" in line for line in kernel.asm["ttgir"].splitlines()),
        "staged_before_mma": staged_before_mma(kernel.asm["ttgir"]),
        "shared": kernel.metadata.shared} for _, kw, kernel in compiled}


ROWS_SHAPES = ((2048, 7168), (4096, 7168), (7168, 2048), (6144, 12288), (7168, 18432))


def rows_profile() -> list[str]:
    """The one-token whole-row GEMVs (``gemv.py``'s fp32 rows kernel and ``gemv_half2.py``'s fp16x2 one) compiled for
    sm_90 at each of ``ROWS_SHAPES`` with the tiles their rules pick (bf16 x, PDL): registers, spills and, over the
    whole kernel (its chunks are unrolled, so there is no loop to profile), SASS instructions, global loads and
    warp-instructions per weight of a program."""
    lines = []
    with collect_compiled(("_w4a16_gemv_kernel", "_w4a16_gemv_half2_kernel")) as (log, compiled):
        from mla_quant.kernels._half2_gemv import pair_order_reference
        from mla_quant.kernels.w4a16_gemm.gemv import gemv_launch, gemv_tile
        from mla_quant.kernels.w4a16_gemm.gemv_half2 import half2_launch, half2_tile

        pdl = {"PDL": 2, "launch_pdl": True}
        for n, k in ROWS_SHAPES:
            packed, scale = torch.zeros(n, k // 8, dtype=torch.int32), torch.ones(n, k // 32, dtype=torch.bfloat16)
            x, y = torch.randn(k, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
            pairs, pair_scales = pair_order_reference(x[None])
            for form, tile, launch in (
                    ("rows", gemv_tile(n, k), lambda t: gemv_launch(x, packed, scale, y, 32, t, pdl)),
                    ("rows_spans", (8, 0, 4, False), lambda t: gemv_launch(x, packed, scale, y, 32, t, pdl)),
                    ("rows_half2", half2_tile(n, k),
                     lambda t: half2_launch(pairs[0], pair_scales[0], packed, scale, y, 32, t, pdl)),
                    ("half2_spans", (2, 0, 1, False),
                     lambda t: half2_launch(pairs[0], pair_scales[0], packed, scale, y, 32, t, pdl))):
                start = len(compiled)
                launch(tile)
                for _, _, kernel in compiled[start:]:
                    ins = [opcode(t) for t in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", disassemble(kernel))]
                    regs, spills = log.ptxas[kernel.metadata.hash]
                    per_weight = len(ins) * tile[2] / (tile[0] * k)
                    lines.append(f"{n}x{k} {form:10s} tile {str(tile):22s} regs {regs:3} spill {spills} "
                                 f"instr {len(ins):5} LDG {ins.count('LDG'):3} warp-instr/weight {per_weight:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", help="folder for each kernel's .ttgir / .ptx / .sass")
    parser.add_argument("--fragments", action="store_true", help="print the fragment kernel's MMA operand layouts")
    parser.add_argument("--rows", action="store_true", help="profile the whole-row one-token GEMVs")
    args = parser.parse_args(argv)
    if args.rows:
        print("\n".join(rows_profile()))
        return 0
    if args.fragments:
        print(json.dumps(fragment_layouts()))
        return 0
    with collect_compiled(("_moe_gemm_kernel", "_w4a16_gemm_kernel")) as (log, compiled):
        from mla_quant.kernels.fused_moe import GEMV_FORMS, fused_moe
        from mla_quant.kernels.w4a16_gemm import GEMV_FORMS as W4_FORMS
        from mla_quant.kernels.w4a16_gemm import w4a16_gemm

        x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
        gate, up, down = (cc._moe_weights("int4_group", EXPERTS, n, k) for n, k in ((INTER, HIDDEN), (INTER, HIDDEN),
                                                                                  (HIDDEN, INTER)))
        ids, w = torch.arange(EXPERTS, dtype=torch.int32)[None], torch.ones(1, EXPERTS)
        packed, scale = torch.zeros(HIDDEN, HIDDEN // 8, dtype=torch.int32), torch.ones(HIDDEN, HIDDEN // 32,
                                                                                       dtype=torch.bfloat16)
        calls = [(f"moe {form}", lambda form=form: fused_moe(x, w, ids, gate, up, down, kind="int4_group", block_m=1,
                                                              gemv=form)) for form in GEMV_FORMS]
        calls += [(f"w4a16 {form}", lambda form=form: w4a16_gemm(x, packed, scale, 32, gemv=form))
                  for form in W4_FORMS]
        print(f"{'kernel':36s} regs spill prog/SM | loop instr/iter (per thread) " + " ".join(COLUMNS)
              + " | warp-instr/weight")
        for label, call in calls:
            start = len(compiled)
            call()
            for name, kw, kernel in compiled[start:]:
                if name == "_moe_gemm_kernel":
                    bn, bk, gated = kw["BLOCK_N"], kw["BLOCK_K"], kw["GATED"]
                    tag = f"{label} {'gate-up' if gated else 'down'} {bn}x{bk}"
                else:
                    bn, bk, gated = kw["BN"], kw["BK"], False
                    tag = f"{label} {bn}x{bk} split{kw['SPLIT_K']}"
                warps = kw["num_warps"]
                tag += f" w{warps}"
                body, counts, regs, spills, progs = loop_profile(log, kernel, warps, args.dump, tag.replace(" ", "_"))
                counts["LDG128"] = sum(1 for t in body if opcode(t) == "LDG" and ".128" in t)
                weights = bn * bk * (2 if gated else 1)
                print(f"{tag:36s} {regs:4} {spills:5} {progs:7} | {len(body):5} "
                      + " ".join(f"{counts[c]:>{len(c)}}" for c in COLUMNS)
                      + f" | {len(body) * warps * 32 / weights / 32:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
