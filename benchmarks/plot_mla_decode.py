"""Plot for ``docs/benchmarks.md`` (CPU; needs matplotlib): ``python -m benchmarks.plot_mla_decode [--results F]``.

``docs/img/mla_decode_bandwidth.png``: achieved bandwidth of the ``mla_decode`` rows against batch, one panel per
head count, one line per (KV format, context) — the path of the row (circles: the conversion for FP8 pages) and,
where present, the fp8 tensor-core dots (``fp8mma``, triangles: what ``fp8_dequant="auto"`` takes for fp8_e4m3 pages
at ≥ 32k cached tokens and more than 16 query rows), the bitcast (squares: at ≤ 16 query rows it runs
``FP8_TMA_CONFIG``) and the Gluon kernel (diamonds: ``fp8_dequant="gluon"``, what "auto" takes for fp8_e4m3 pages at
≤ 16 query rows on Hopper) — with the copy ceiling measured in the same run. FP8 rows move half
the bytes, so at the same TB/s they run twice as fast.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import RESULTS

IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
COLORS = {"bf16": "tab:gray", "fp8_e4m3": "tab:blue", "fp8_ds_mla": "tab:orange"}
STYLES = {1024: ":", 4096: "-.", 16384: "--", 65536: "-"}
VARIANTS = {None: "o", "fp8mma": "^", "bitcast": "s", "gluon": "D"}  # case "variant" -> marker


def plot(results: Path, out: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(results.read_text())
    rows = [c for c in doc["cases"] if c["bench"] == "mla_decode" and c["case"].get("variant") in VARIANTS]
    if not rows:
        return False
    heads = sorted({c["case"]["heads"] for c in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(4.2 * len(heads), 4), sharey=True, squeeze=False)
    copy = doc["meta"].get("copy_tbps")
    for ax, h in zip(axes[0], heads):
        for kind in COLORS:
            for ctx, (variant, marker) in ((c, v) for c in STYLES for v in VARIANTS.items()):
                pts = sorted((c["case"]["batch"], c["tbps"]) for c in rows
                             if c["case"]["heads"] == h and c["case"]["kv"] == kind and c["case"]["ctx"] == ctx
                             and c["case"].get("variant") == variant)
                if pts:
                    ax.plot(*zip(*pts), STYLES[ctx], marker=marker, ms=3, color=COLORS[kind],
                            label=f"{kind}{', ' + variant if variant else ''}, ctx {ctx // 1024}k")
        if copy:
            ax.axhline(copy, color="k", lw=0.8)
            ax.axhline(0.75 * copy, color="k", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{h} heads")
        ax.set_xlabel("batch (requests)")
    axes[0][0].set_ylabel("achieved TB/s (pages + q + out)")
    axes[0][0].legend(fontsize=5.5, ncol=2, loc="upper left")  # (the first panel has every line: 16 heads)
    fig.suptitle("mla_decode on the H200 — line: copy ceiling of the run; dotted: 75% of it", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot_mla_decode", description=__doc__)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    out = IMG / "mla_decode_bandwidth.png"
    print(f"wrote {out}" if plot(args.results, out) else "no mla_decode rows in the results file")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
