"""Plots for ``docs/recipes.md`` (CPU; needs matplotlib): ``python -m benchmarks.plot_recipes [--results F]``.

* ``docs/img/recipes_roofline.png`` — the model: time of a GEMM per format against tokens, bounded by
  HBM bytes (weights dominate at small T) and by the tensor-core rate (FP8 runs at twice bf16);
* ``docs/img/gemm_speedup.png`` — measured ``gemm`` rows: each format's speedup over bf16 cuBLAS against M;
* ``docs/img/w4a16_tokens.png`` — measured ``gemm`` rows at 1-16 tokens: the W4A16 kernels' µs per call against
  tinygemm's and the weight bytes at the measured copy bandwidth (docs/moe.md);
* ``docs/img/prefill_decode.png`` — measured ``prefill`` rows: tokens/s of the layer stack per format;
* ``docs/img/e2e_concurrency.png`` — measured ``e2e_decode`` rows (one KV budget for every format): decode
  tokens/s against concurrency, where BF16 KV runs out of pages, and the two ratios beside the seed's figures.

The measured plots are skipped when the results file has no such rows.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import RESULTS

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
# roofline inputs: the H200 ceilings measured by `python -m benchmarks` (copy 4.25 TB/s, bf16 ~700 TFLOP/s);
# fp8 tensor cores at twice bf16; INT4 runs its products on the bf16 tensor cores after dequantizing.
COPY_TBPS, BF16_TFLOPS = 4.25, 700.0
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8_block": 1.0 + 4 / 128**2, "int4_g32": 0.5 + 2 / 32}
TFLOPS = {"bf16": BF16_TFLOPS, "fp8_block": 2 * BF16_TFLOPS, "int4_g32": BF16_TFLOPS}
COLORS = {"bf16": "tab:gray", "fp8_block": "tab:blue", "int4_g32": "tab:orange", "tinygemm_int4": "tab:red",
          "torch_scaled_mm": "tab:cyan"}


def roofline_us(fmt: str, tokens: int, n: int = 7168, k: int = 7168) -> float:
    """Lower bound on one [tokens, k] x [k, n] GEMM: max(bytes / bandwidth, flops / tensor-core rate)."""
    act_bytes = 2 * tokens * (k + n)
    t_mem = (BYTES_PER_WEIGHT[fmt] * n * k + act_bytes) / (COPY_TBPS * 1e12)
    t_math = 2 * tokens * n * k / (TFLOPS[fmt] * 1e12)
    return 1e6 * max(t_mem, t_math)


def plot_roofline(plt, path: Path) -> None:
    tokens = [2**i for i in range(0, 15)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for fmt in ("bf16", "fp8_block", "int4_g32"):
        us = [roofline_us(fmt, t) for t in tokens]
        ax1.loglog(tokens, us, "-o", ms=3, color=COLORS[fmt], label=fmt)
        ax2.semilogx(tokens, [roofline_us("bf16", t) / u for t, u in zip(tokens, us)], "-o", ms=3,
                     color=COLORS[fmt], label=fmt)
    for fmt in ("fp8_block", "int4_g32"):  # the ridge: tokens where the math time reaches the byte time
        ridge = TFLOPS[fmt] * BYTES_PER_WEIGHT[fmt] / (2 * COPY_TBPS)
        ax1.axvline(ridge, color=COLORS[fmt], ls=":", lw=1)
    ax1.set(xlabel="tokens in the batch (M)", ylabel="µs per 7168×7168 GEMM (lower bound)",
            title="roofline: bytes bound left, tensor cores right")
    ax2.set(xlabel="tokens in the batch (M)", ylabel="speedup over bf16 (bound)",
            title="INT4 wins decode (≤ ~3.6×), FP8 wins prefill (2×)")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"H200 model: {COPY_TBPS} TB/s, bf16 {BF16_TFLOPS:.0f} / fp8 {2 * BF16_TFLOPS:.0f} TFLOP/s "
                 "(INT4 computes in bf16)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gemm_panels(plt, rows: list[dict], width: float, height: float):
    """One panel per (N, K) of the ``gemm`` rows: (figure, [(axis, N, K, that shape's rows)]), or None without rows."""
    shapes = sorted({(c["case"]["N"], c["case"]["K"]) for c in rows})
    if not shapes:
        return None
    fig, axes = plt.subplots(1, len(shapes), figsize=(width * len(shapes), height), squeeze=False)
    return fig, [(ax, n, k, [c for c in rows if (c["case"]["N"], c["case"]["K"]) == (n, k)])
                 for ax, (n, k) in zip(axes[0], shapes)]


def _save(plt, fig, path: Path) -> bool:
    fig.axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_gemm(plt, cases: list[dict], path: Path) -> bool:
    got = _gemm_panels(plt, [c for c in cases if c["bench"] == "gemm"], 4, 3.6)
    if got is None:
        return False
    fig, panels = got
    for ax, n, k, mine in panels:
        for fmt in ("fp8_block", "int4_g32"):
            pts = sorted((c["case"]["M"], c) for c in mine if c["case"]["format"] == fmt)
            ms = [m for m, _ in pts]
            ax.semilogx(ms, [c["cublas_bf16_us"] / c["median_us"] for _, c in pts], "-o", ms=3,
                        color=COLORS[fmt], label=fmt)
            peer = [(m, c["cublas_bf16_us"] / c["peer_median_us"]) for m, c in pts if c.get("peer_median_us")]
            if peer:
                ax.semilogx(*zip(*peer), "--", color=COLORS[pts[0][1]["peer"]], label=pts[0][1]["peer"])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(title=f"N={n}, K={k}", xlabel="M", ylabel="speedup over bf16 cuBLAS")
        ax.grid(True, which="both", alpha=0.3)
    return _save(plt, fig, path)


# W4A16 rows at 1-16 tokens: row format -> (label, line style, colour)
W4A16_ROWS = {"int4_g32": ("default (GEMV at 1, fragments at 2-16)", "-o", "tab:blue"),
              "int4_g32_frag_ws": ("fragments, kept counters", ":o", "tab:orange"),
              "int4_g32_swap": ("swapped wgmma kernel (session 13)", "-s", "tab:green"),
              "int4_g32_planes1_ws": ("GEMV, kept counters", "o", "tab:purple")}


def plot_w4a16_tokens(plt, cases: list[dict], path: Path) -> bool:
    got = _gemm_panels(plt, [c for c in cases if c["bench"] == "gemm" and c["case"]["M"] <= 16
                                and c["case"]["format"] in W4A16_ROWS], 5, 3.8)
    if got is None:
        return False
    fig, panels = got
    for ax, n, k, mine in panels:
        for fmt, (label, style, color) in W4A16_ROWS.items():
            pts = sorted((c["case"]["M"], c["median_us"]) for c in mine if c["case"]["format"] == fmt)
            if pts:
                ax.plot(*zip(*pts), style, ms=3, color=color, label=label)
        peer = sorted((c["case"]["M"], c["peer_median_us"]) for c in mine
                      if c["case"]["format"] == "int4_g32" and c.get("peer_median_us"))
        ax.plot(*zip(*peer), "--", color=COLORS["tinygemm_int4"], label="tinygemm (same run)")
        floor = n * k * BYTES_PER_WEIGHT["int4_g32"] / (COPY_TBPS * 1e6)
        ax.axhline(floor, color="k", lw=0.8, ls=":", label=f"weights at {COPY_TBPS} TB/s")
        ax.set(title=f"W4A16, N={n}, K={k} (bf16)", xlabel="tokens", ylabel="µs per call", ylim=(0, None))
        ax.set_xticks([1, 2, 4, 8, 16])
        ax.grid(True, alpha=0.3)
    return _save(plt, fig, path)


def plot_prefill(plt, cases: list[dict], path: Path) -> bool:
    rows = [c for c in cases if c["bench"] == "prefill"]
    if not rows:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, phase in zip(axes, ("decode", "prefill")):
        pts = [c for c in rows if c["case"].get("phase") == phase]
        tokens = sorted({c["case"]["tokens"] for c in pts})
        width = 0.27
        for i, fmt in enumerate(("bf16", "fp8_block", "int4_g32")):
            tps = [next((c["tokens_per_s"] for c in pts if c["case"]["format"] == fmt and c["case"]["tokens"] == t), 0)
                   for t in tokens]
            ax.bar([j + (i - 1) * width for j in range(len(tokens))], tps, width, color=COLORS[fmt], label=fmt)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set(title=f"{phase}: one Kimi dense layer's projections", xlabel="tokens per step", ylabel="tokens/s")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


SEED_INT4_OVER_FP8_AT_1 = 1.55  # Cloudflare: INT4 experts decode +55 % at one request (GLM 5.2)
SEED_FP8_KV_OVER_BF16 = 0.97    # Cloudflare: FP8 KV "a few %" slower per step than BF16 KV


def plot_e2e(plt, cases: list[dict], path: Path) -> bool:
    rows = [c for c in cases if c["bench"] == "e2e_decode" and "experts" in c["case"]]
    if not rows:
        return False

    def series(kv, experts):
        pts = sorted((c["case"]["concurrency"], c) for c in rows
                     if c["case"]["kv"] == kv and c["case"]["experts"] == experts)
        return [(n, c) for n, c in pts]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {("bf16", "fp8_block"): ("tab:gray", "BF16 KV, FP8 experts"),
              ("fp8_e4m3", "fp8_block"): ("tab:blue", "FP8 KV, FP8 experts"),
              ("fp8_e4m3", "int4_g32"): ("tab:orange", "FP8 KV, INT4 experts"),
              ("bf16", "int4_g32"): ("tab:brown", "BF16 KV, INT4 experts")}
    for (kv, experts), (color, label) in styles.items():
        pts = series(kv, experts)
        if not pts:
            continue
        ok = [(n, c["tokens_per_s"]) for n, c in pts if c["case"].get("status", "ok") == "ok"]
        ax1.plot(*zip(*ok), "-o", ms=4, color=color, label=label)
        for n, c in pts:
            if c["case"].get("status") == "out_of_pages":
                ax1.plot([n], [0], "x", ms=10, mew=2, color=color)
                ax1.annotate(f"{label.split(',')[0]}: out of pages\n({c['pages_needed']} needed, "
                             f"{c['pages_held']} held)", (n, 0), textcoords="offset points", xytext=(-120, 12),
                             fontsize=7, color=color)
    budget = rows[0]["case"].get("budget_gb")
    ctx = rows[0]["case"].get("ctx")
    ax1.set(xlabel="concurrency (requests decoding)", ylabel="decode tokens/s (3-layer slice)",
            title=f"one KV budget ({budget} GB), {ctx} tokens each")
    for (kv_a, ex_a), (kv_b, ex_b), color, label, seed in (
            (("fp8_e4m3", "fp8_block"), ("bf16", "fp8_block"), "tab:blue", "FP8 / BF16 KV", SEED_FP8_KV_OVER_BF16),
            (("fp8_e4m3", "int4_g32"), ("fp8_e4m3", "fp8_block"), "tab:orange", "INT4 / FP8 experts",
             SEED_INT4_OVER_FP8_AT_1)):
        a = {n: c for n, c in series(kv_a, ex_a) if c.get("median_us")}
        b = {n: c for n, c in series(kv_b, ex_b) if c.get("median_us")}
        common = sorted(set(a) & set(b))
        if common:
            ax2.plot(common, [b[n]["median_us"] / a[n]["median_us"] for n in common], "-o", ms=4, color=color,
                     label=f"{label} (measured)")
            ax2.axhline(seed, color=color, ls=":", lw=1.2, label=f"{label} (seed: {seed:.2f}×)")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set(xlabel="concurrency", ylabel="speed-up (step time ratio)", title="beside the seed's figures")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot_recipes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    plot_roofline(plt, IMG / "recipes_roofline.png")
    cases = json.loads(args.results.read_text())["cases"] if args.results.is_file() else []
    for name, fn in (("gemm_speedup.png", plot_gemm), ("w4a16_tokens.png", plot_w4a16_tokens),
                     ("prefill_decode.png", plot_prefill), ("e2e_concurrency.png", plot_e2e)):
        print(("wrote " if fn(plt, cases, IMG / name) else "no rows for ") + str(IMG / name))
    print(f"wrote {IMG / 'recipes_roofline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
