"""Static profile of the MLA decode kernel's main loop on sm_90, without a GPU (docs/mla.md, "Why FP8 pages are
slower at 16 heads").

    PYTHONPATH=. /path/to/venv-triton-3.6/bin/python -m benchmarks.mla_decode_sass [--heads 16] [--dump DIR]

Compiles ``_mla_decode_kernel`` through ``compile_check``'s fake Hopper for every autotune candidate the launcher
keeps, per KV kind and ``fp8_dequant``, disassembles it (``cuobjdump -sass``, the Triton backend's copy) and
counts the instructions of the longest loop (the loop over KV tiles), per warp and per iteration: cp.async
(LDGSTS) vs plain global loads (LDG), shared stores / loads / ldmatrix, barriers, tensor-core ops, the FP8
conversion ops; plus registers, spills, programs per SM and warp-instructions per KV token. ``--dump`` keeps
each kernel's TTGIR, PTX and SASS; ``--only fp8_e4m3_fp16 ...`` restricts the cases.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch

from benchmarks import compile_check as cc

COLUMNS = ("LDGSTS", "LDG", "STS", "LDS", "LDSM", "BAR", "HMMA", "HGMMA", "F2F", "F2FP", "PRMT", "LOP3", "SHF",
           "STL", "LDL")
CASES = (("bf16", "convert"), ("fp8_e4m3", "convert"), ("fp8_e4m3", "bitcast"), ("fp8_e4m3", "fp16"),
         ("fp8_ds_mla", "convert"), ("fp8_ds_mla", "bitcast"), ("fp8_ds_mla", "fp16"))
REGS_PER_SM, SMEM_PER_SM, WARPS_PER_SM = 65536, 233472, 64


def sass_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (the span of the longest backward branch)."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = (0, -1)
    for addr, text in ins:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    return [t for a, t in ins if best[0] <= a <= best[1]]


def opcode(text: str) -> str:
    """'@!P0 LDG.E.128 R4, ...' -> 'LDG'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    regs_per_warp = -(-regs // 8) * 8 * 32
    return min(REGS_PER_SM // (regs_per_warp * warps), SMEM_PER_SM // (smem + 1024), WARPS_PER_SM // warps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dump", help="folder for each kernel's .ttgir / .ptx / .sass")
    parser.add_argument("--only", nargs="*", help="kind_dequant cases to compile (default: all), e.g. fp8_e4m3_fp16")
    args = parser.parse_args(argv)
    log = cc.CompileLog()
    cc.install_fake_hopper(log, ptxas=True)
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.runtime import jit

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    compiled = []
    patched = jit.JITFunction.run

    def run(self, *a, **kw):
        kernel = patched(self, *a, **kw)
        if kernel is not None and self.__name__ == "_mla_decode_kernel":
            compiled.append((kw, kernel))
        return kernel

    jit.JITFunction.run = run
    from mla_quant.kernels.mla_decode import mla_decode

    table, lens = cc._table([100, 200])
    print(f"{'kernel':34s} regs spill smem/K prog/SM | per warp per loop iteration: instr "
          + " ".join(COLUMNS) + " | warp-instr/token")
    for kind, dequant in CASES:
        if args.only and f"{kind}_{dequant}" not in args.only:
            continue
        data, scales = cc._kv_pages(kind, "token", table.numel())
        q = torch.randn(2, 1, args.heads, cc.D_LATENT + cc.D_ROPE, dtype=torch.bfloat16)
        start = len(compiled)
        mla_decode(q, data, scales, table, lens, 0.1, kind, cc.D_LATENT, fp8_dequant=dequant, num_splits=2)
        for kw, kernel in compiled[start:]:
            name = (f"{kind}_{dequant}_m{kw['BLOCK_M']}n{kw['BLOCK_N']}{'T' if kw['QK_SPLIT_LOAD'] else ''}"
                    f"w{kw['num_warps']}s{kw['num_stages']}{'P' if kw.get('PREFETCH') else ''}")
            with tempfile.TemporaryDirectory() as tmp:
                cubin = os.path.join(tmp, "k.cubin")
                with open(cubin, "wb") as f:
                    f.write(kernel.asm["cubin"])
                sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for ext, text in (("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"]), ("sass", sass)):
                    with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                        f.write(text)
            body = sass_loop(sass)
            counts = collections.Counter(opcode(t) for t in body)
            regs, spills = log.ptxas[kernel.metadata.hash]
            progs = programs_per_sm(regs or 255, kernel.metadata.shared, kw["num_warps"])
            per_token = len(body) * kw["num_warps"] / kw["BLOCK_N"]
            print(f"{name:34s} {regs:4} {spills:5} {kernel.metadata.shared // 1024:6} {progs:7} | {len(body):5} "
                  + " ".join(f"{counts[c]:>{len(c)}}" for c in COLUMNS) + f" | {per_token:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
