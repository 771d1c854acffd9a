"""Static profile of the MLA decode kernel's main loop on sm_90, without a GPU (docs/mla.md, "Why FP8 pages are
slower at 16 heads").

    PYTHONPATH=. /path/to/venv-triton-3.6/bin/python -m benchmarks.mla_decode_sass [--heads 16] [--dump DIR]

Compiles ``_mla_decode_kernel`` through ``compile_check``'s fake Hopper for every autotune candidate the launcher
keeps, per KV kind and ``fp8_dequant``, disassembles it (``cuobjdump -sass``, the Triton backend's copy) and
counts the instructions of the longest loop (the loop over KV tiles), per warp and per iteration: cp.async
(LDGSTS) vs plain global loads (LDG), shared stores / loads / ldmatrix, barriers, tensor-core ops, the FP8
conversion ops; plus registers, spills, programs per SM and warp-instructions per KV token. ``--dump`` keeps
each kernel's TTGIR, PTX and SASS; ``--only fp8_e4m3_fp16 ...`` restricts the cases.

``--gluon`` profiles instead the Gluon kernel (``fp8_dequant="gluon"``, kernel_gluon.py) in the settings of
``GLUON_SETTINGS``: the shortest loop that issues MMAs (the attention warps' tile loop; the warp-specialized kernel's
longest branch span also covers the TMA warp's waits), per attention warp and 64-token tile.

``--buffers`` prints instead (JSON) how many shared-memory buffers Triton's pipeliner gives the latent tile of
a few bf16 configurations (``BUFFER_CASES``, TTGIR ``memdesc<N x BLOCK_N x 512>``): ``num_stages - 1`` since the
block table is read per chunk of tiles, one whatever ``num_stages`` while the page lookup sat in the tile loop
(docs/mla.md, "Tile pipelining and TMA tiles"); ``tma_config_probe`` is TMA_CONFIG with the timeline stamps on
(``mla_decode.PROBE_BUFFER``), which must keep the same buffers, and ``probe_stamps`` counts its ``%globaltimer``
reads in the PTX. A test runs it.
"""
from __future__ import annotations

import argparse
import json
import re

import torch

from benchmarks import compile_check as cc
from benchmarks.sass_tools import collect_compiled, loop_profile, mma_loop

COLUMNS = ("LDGSTS", "LDG", "STS", "LDS", "LDSM", "BAR", "HMMA", "QMMA", "HGMMA", "QGMMA", "F2F", "F2FP", "PRMT",
           "LOP3", "SHF", "STL", "LDL")
CASES = (("bf16", "convert"), ("fp8_e4m3", "convert"), ("fp8_e4m3", "bitcast"), ("fp8_e4m3", "fp16"),
         ("fp8_ds_mla", "convert"), ("fp8_ds_mla", "bitcast"), ("fp8_ds_mla", "fp16"), ("fp8_e4m3", "fp8mma"),
         ("fp8_e4m3", "fp8mma_pv"), ("fp8_e4m3", "fp8mma_q1"), ("fp8_e4m3", "fp8mma_pv_q1"))


# name -> mla_decode config (16 heads, bf16 pages of 64 tokens)
BUFFER_CASES = {
    "tma_config": None,  # the launcher's TMA_CONFIG (3 stages)
    "m16n32w8s3": dict(BLOCK_M=16, BLOCK_N=32, QK_SPLIT_LOAD=False, num_warps=8, num_stages=3),
    "m16n32w8s4": dict(BLOCK_M=16, BLOCK_N=32, QK_SPLIT_LOAD=False, num_warps=8, num_stages=4),
    "m16n64w8s2": dict(BLOCK_M=16, BLOCK_N=64, QK_SPLIT_LOAD=False, num_warps=8, num_stages=2),
}


def tile_buffers() -> dict[str, list[int]]:
    """{case: the buffer counts of the latent tile's shared-memory allocations in its sm_90 TTGIR} (one entry per
    tile loop: the TMA config has a TMA loop and a pointer-load loop for the masked tail), and ``probe_stamps``."""
    out = {}
    with collect_compiled(("_mla_decode_kernel",)) as (log, compiled):
        import mla_quant.kernels.mla_decode as md
        from mla_quant.kernels.mla_decode import TMA_CONFIG, mla_decode

        table, lens = cc._table([100, 200])
        data, scales = cc._kv_pages("bf16", "token", table.numel())
        q = torch.randn(2, 1, 16, cc.D_LATENT + cc.D_ROPE, dtype=torch.bfloat16)
        for name, config in BUFFER_CASES.items():
            start = len(compiled)
            mla_decode(q, data, scales, table, lens, 0.1, "bf16", cc.D_LATENT, num_splits=2,
                       config=config or TMA_CONFIG)
            ttgir = "".join(kernel.asm["ttgir"] for _, _, kernel in compiled[start:])
            tile_alloc = rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x{cc.D_LATENT}x"
            out[name] = sorted(int(n) for n in re.findall(tile_alloc, ttgir))
        start = len(compiled)
        md.PROBE_BUFFER = torch.zeros(16 * 64, dtype=torch.int64)
        try:
            mla_decode(q, data, scales, table, lens, 0.1, "bf16", cc.D_LATENT, num_splits=2, config=TMA_CONFIG)
        finally:
            md.PROBE_BUFFER = None
        ttgir = "".join(kernel.asm["ttgir"] for _, _, kernel in compiled[start:])
        out["tma_config_probe"] = sorted(int(n) for n in re.findall(tile_alloc, ttgir))
        out["probe_stamps"] = sum(kernel.asm["ptx"].count("%globaltimer") for _, _, kernel in compiled[start:])
        if log.errors:
            raise RuntimeError(log.errors[0])
    return out


# fp8_dequant="gluon" settings (mla_decode module constants) profiled by --gluon
GLUON_SETTINGS = {"ws": dict(GLUON_WS=True), "plain": dict(GLUON_WS=False),
                  "ws_swap": dict(GLUON_WS=True, GLUON_SWAP_QK=True), "plain_w8": dict(GLUON_WS=False, GLUON_WARPS=8),
                  "ws_qrows": dict(GLUON_WS=True, GLUON_Q_FRAG=False),
                  "ws_pconv": dict(GLUON_WS=True, GLUON_P_FRAG=False)}


def gluon_profile(heads: int, scale: str, folder: str | None) -> int:
    """Static profile of the Gluon kernel's tile loop (per attention warp and 64-token tile) in each of
    ``GLUON_SETTINGS``: its instructions, the columns above, registers (at launch), shared memory, programs per SM."""
    from benchmarks.common import module_attrs

    with collect_compiled(("_mla_decode_fp8_gluon_kernel",)) as (log, compiled):
        import mla_quant.kernels.mla_decode as md

        table, lens = cc._table([100, 200])
        kind = "fp8_ds_mla" if scale == "ds_mla" else "fp8_e4m3"  # (ds_mla: FlashMLA's rows, tile scales)
        data, scales = cc._kv_pages(kind, "token" if scale == "ds_mla" else scale, table.numel())
        q = torch.randn(2, 1, heads, cc.D_LATENT + cc.D_ROPE, dtype=torch.bfloat16)
        print(f"{'setting':10s} regs spill smem/K prog/SM | per attention warp per tile: instr " + " ".join(COLUMNS)
              + " | warp-instr/token")
        for name, setting in GLUON_SETTINGS.items():
            start = len(compiled)
            with module_attrs(md, setting):
                md.mla_decode(q, data, scales, table, lens, 0.1, kind, cc.D_LATENT, fp8_dequant="gluon",
                              num_splits=2)
                warps, block_n = md.GLUON_WARPS, md.GLUON_BLOCK_N
            for _, kw, kernel in compiled[start:]:
                # warp-specialized: 4 attention warps + the TMA warp's group of 4 at the launch registers
                body, counts, regs, spills, progs = loop_profile(
                    log, kernel, warps + (4 if kw.get("WS") else 0), folder, f"gluon_{name}", loop=mma_loop)
                print(f"{name:10s} {regs:4} {spills:5} {kernel.metadata.shared // 1024:6} {progs:7} | {len(body):5} "
                      + " ".join(f"{counts[c]:>{len(c)}}" for c in COLUMNS)
                      + f" | {len(body) * warps / block_n:6.1f}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--scale", choices=("token", "tensor", "ds_mla"), default="token",
                        help="fp8_e4m3 scale kind, or fp8_ds_mla pages (--gluon)")
    parser.add_argument("--dump", help="folder for each kernel's .ttgir / .ptx / .sass")
    parser.add_argument("--only", nargs="*", help="kind_dequant cases to compile (default: all), e.g. fp8_e4m3_fp16")
    parser.add_argument("--buffers", action="store_true", help="print the latent tile's buffer counts (JSON)")
    parser.add_argument("--gluon", action="store_true",
                        help="profile fp8_dequant='gluon' (kernel_gluon.py) in its settings instead")
    args = parser.parse_args(argv)
    if args.buffers:
        print(json.dumps(tile_buffers()))
        return 0
    if args.gluon:
        return gluon_profile(args.heads, args.scale, args.dump)
    with collect_compiled(("_mla_decode_kernel",)) as (log, compiled):
        from mla_quant.kernels.mla_decode import mla_decode

        table, lens = cc._table([100, 200])
        print(f"{'kernel':34s} regs spill smem/K prog/SM | per warp per loop iteration: instr "
              + " ".join(COLUMNS) + " | warp-instr/token")
        for kind, dequant in CASES:
            if args.only and f"{kind}_{dequant}" not in args.only:
                continue
            data, scales = cc._kv_pages(kind, args.scale if kind == "fp8_e4m3" else "token", table.numel())
            q = torch.randn(2, 1, args.heads, cc.D_LATENT + cc.D_ROPE, dtype=torch.bfloat16)
            start = len(compiled)
            mla_decode(q, data, scales, table, lens, 0.1, kind, cc.D_LATENT, fp8_dequant=dequant, num_splits=2)
            for _, kw, kernel in compiled[start:]:
                name = (f"{kind}_{dequant}_m{kw['BLOCK_M']}n{kw['BLOCK_N']}{'T' if kw['QK_SPLIT_LOAD'] else ''}"
                        f"w{kw['num_warps']}s{kw['num_stages']}{'P' if kw.get('PREFETCH') else ''}")
                body, counts, regs, spills, progs = loop_profile(log, kernel, kw["num_warps"], args.dump, name)
                per_token = len(body) * kw["num_warps"] / kw["BLOCK_N"]
                print(f"{name:34s} {regs:4} {spills:5} {kernel.metadata.shared // 1024:6} {progs:7} | {len(body):5} "
                      + " ".join(f"{counts[c]:>{len(c)}}" for c in COLUMNS) + f" | {per_token:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
