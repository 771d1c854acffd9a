"""Sweep of W4A16 GEMM configs, default dequant vs ``FAST_DEQUANT``, to pick the defaults in one GPU call.

    python -m benchmarks.sweep_w4a16 [--ms 1,4,16] [--splits auto,1,4] [--top 5] [--out sweep.json]
    python -m benchmarks.sweep_w4a16 --swap [--ms 4,8,16]   # the swapped-operand kernel's tile and largest split

For each M ∈ {1, 4, 16} and N×K ∈ {2048×7168, 7168×2048, 4096×7168} (group 32, bf16) it times, from CUDA
graphs over enough weight sets to miss L2 (as ``bench_gemm``): tinygemm, the autotuned default and the
autotuned ``fast_dequant=1`` and ``2`` launchers, then every pinned config of a small grid — the one-token
GEMV (M = 1 only; FAST_DEQUANT does not change it) and 16-row tensor-core tiles at FAST_DEQUANT 0, 1 and 2,
each at the split-K heuristic's choice ("auto") and the given explicit splits. Prints the best ``--top``
per shape with µs, the speedup over tinygemm and over the autotuned default. Mostly Triton compiles
(~50 kernels): expect 1–2 minutes on the H200; ``--ms 1`` for a one-token pass.

``--swap`` instead times the swapped-operand kernel (``swap_ab=True``, 2–16 tokens) at each ``SWAP_SETTINGS`` entry:
its tile (``kernel.SWAP_TILE``: BN, BK, warps, stages) and largest split (``kernel.SWAP_MAX_SPLIT``), beside the
previous path (``fast1_autotuned``: what ``swap_ab=False`` runs there). Session 13's scratch version of it:
``results/sweep_w4a16_swap_h200.json``.
"""
from __future__ import annotations

import argparse
import json

import torch

from mla_quant.kernels.int4_quant import int4_quantize
from mla_quant.kernels.w4a16_gemm import SWAP_MAX_M, w4a16_gemm
from mla_quant.kernels.w4a16_gemm import kernel as w4a16_kernel

from .bench_gemm import _tinygemm_pack
from .common import L2_BYTES, graph_us, module_attrs

GROUP = 32
NKS = ((2048, 7168), (7168, 2048), (4096, 7168))
# (BN, BK, num_warps, num_stages)
GEMV_TILES = ((16, 512, 4, 2), (32, 512, 4, 2), (16, 1024, 4, 2), (64, 256, 4, 3), (32, 1024, 8, 2))
MMA_TILES = ((16, 256, 4, 2), (32, 256, 4, 2), (64, 256, 4, 3), (32, 512, 8, 2), (16, 512, 4, 3), (64, 128, 4, 4))


# (SWAP_TILE, SWAP_MAX_SPLIT) settings of --swap: the default first
SWAP_SETTINGS = (((64, 256, 4, 2), 16), ((64, 256, 4, 3), 16), ((64, 256, 4, 2), 8), ((64, 256, 4, 2), 32),
                 ((128, 256, 8, 2), 16), ((64, 128, 4, 3), 32), ((64, 512, 4, 2), 16))


def swap_setting(setting) -> dict:
    """The module constants one --swap setting patches."""
    tile, max_split = setting
    return {"SWAP_TILE": tile, "SWAP_MAX_SPLIT": max_split}


def grid(m: int, splits: list) -> list[dict]:
    """The pinned configs tried at ``m`` tokens (SPLIT_K None = the launcher's heuristic)."""
    out = []
    if m == 1:
        out += [{"BM": 1, "BN": bn, "BK": bk, "num_warps": w, "num_stages": st, "FAST_DEQUANT": 0}
                for bn, bk, w, st in GEMV_TILES]
    out += [{"BM": 16, "BN": bn, "BK": bk, "num_warps": w, "num_stages": st, "FAST_DEQUANT": fast}
            for fast in (0, 1, 2) for bn, bk, w, st in MMA_TILES]
    return [{**c, "GROUP_M": 1, "SPLIT_K": s} for c in out for s in splits]


def name(cfg: dict) -> str:
    if "SWAP_TILE" in cfg:
        bn, bk, w, st = cfg["SWAP_TILE"]
        return f"swap  BN={bn:<3} BK={bk:<4} w={w} s={st} max split={cfg['SWAP_MAX_SPLIT']}"
    kind = "gemv " if cfg["BM"] == 1 else f"fast{cfg['FAST_DEQUANT']}" if cfg["FAST_DEQUANT"] else "mma  "
    split = cfg["SPLIT_K"] or "auto"
    return f"{kind} BN={cfg['BN']:<3} BK={cfg['BK']:<4} w={cfg['num_warps']} s={cfg['num_stages']} split={split}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--splits", default="auto", help="comma-separated: auto (heuristic) and/or integers")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write every timing as JSON here")
    ap.add_argument("--swap", action="store_true", help="sweep the swapped-operand kernel (2-16 tokens) instead")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    splits = [None if v == "auto" else int(v) for v in args.splits.split(",")]
    dev = "cuda"
    results = []
    for n, k in NKS:
        n_sets = max(2, -(-3 * L2_BYTES // (n * k // 2)))  # cycle the weights past L2
        sets = []
        for _ in range(n_sets):
            p4, s4 = int4_quantize(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02, GROUP)
            sets.append((p4, s4))
        try:
            tiny = [_tinygemm_pack(n, k, dev) for _ in range(n_sets)]
        except Exception as e:  # noqa: BLE001 — the op's signature moved between torch releases
            print(f"tinygemm unavailable: {type(e).__name__}: {e}")
            tiny = None

        def timed(call):
            def all_sets():
                for i in range(n_sets):
                    call(i)
            return graph_us(all_sets, n_sets, warmup_ms=5, rep_ms=30)[0]

        for m in ms:
            if args.swap and not 2 <= m <= SWAP_MAX_M:
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = {"default": timed(lambda i: w4a16_gemm(x, *sets[i], GROUP))}
            for level in (1, 2):
                try:
                    ref[f"fast{level}_autotuned"] = timed(lambda i: w4a16_gemm(x, *sets[i], GROUP, fast_dequant=level))
                except Exception as e:  # noqa: BLE001
                    print(f"  M={m} {n}x{k} fast_dequant={level} autotuned: {type(e).__name__}: {str(e)[:120]}")
            if tiny is not None:
                ref["tinygemm"] = timed(lambda i: torch.ops.aten._weight_int4pack_mm(x, tiny[i][0], GROUP, tiny[i][1]))
            rows = []
            for cfg in ([swap_setting(s) for s in SWAP_SETTINGS] if args.swap else grid(m, splits)):
                try:
                    if args.swap:
                        with module_attrs(w4a16_kernel, cfg):
                            us = timed(lambda i: w4a16_gemm(x, *sets[i], GROUP, swap_ab=True))
                    else:
                        us = timed(lambda i: w4a16_gemm(x, *sets[i], GROUP, config=cfg))
                except Exception as e:  # noqa: BLE001 — a config that does not compile/fit is skipped, not fatal
                    print(f"  M={m} {n}x{k} {name(cfg)}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    continue
                rows.append((us, cfg))
                results.append({"M": m, "N": n, "K": k, "config": cfg, "us": us,
                                **{f"{r}_us": v for r, v in ref.items()}})
            rows.sort(key=lambda r: r[0])
            head = "  ".join(f"{r}={v:.2f}us" for r, v in ref.items())
            print(f"M={m} N={n} K={k}: {head}")
            for us, cfg in rows[:args.top]:
                vs_tiny = f"{ref['tinygemm'] / us:5.2f}x tinygemm" if "tinygemm" in ref else ""
                print(f"    {us:8.2f} us  {ref['default'] / us:5.2f}x default  {vs_tiny}  {name(cfg)}")
        del sets, tiny
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
