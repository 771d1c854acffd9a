"""Markdown tables from a results file, one per bench: ``python -m benchmarks.report [--results F]``.

Columns: the case keys, our median, the peer and its median, the speed-up over the peer, and the achieved
rate against the run's ceilings (copy bandwidth, bf16 matmul rate); some benches add their own columns
(:data:`EXTRA_COLUMNS`). A row without a time (``median_us`` None, e.g. ``e2e_decode``'s out-of-pages rows)
shows "—"; a peer that has none shows its ``peer_status``.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from .common import RESULTS


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _pages(r: dict) -> str:
    return f"{r['pages_needed']} / {r['pages_held']}" if "pages_needed" in r else ""


# bench -> (header, row -> cell) columns after the case keys' and µs
EXTRA_COLUMNS = {
    "e2e_decode": (("tokens/s", lambda r: _fmt(r["tokens_per_s"]) if r.get("tokens_per_s") else "—"),
                   ("pages needed / held", _pages)),
}


def _peer_us(r: dict) -> str:
    if r.get("peer_median_us"):
        return _fmt(r["peer_median_us"])
    return r.get("peer_status", "") if r.get("peer") and r.get("peer_status") != "ok" else ""


def _pct(r: dict, key: str, rate, ceiling) -> str:
    """The row's own fraction of its run's ceiling when it carries one, else against the file's ceiling."""
    if key in r:
        return f"{100 * r[key]:.0f}"
    return f"{100 * rate / ceiling:.0f}" if rate else ""


def tables(results: dict) -> str:
    meta = results["meta"]
    copy, mm = meta["copy_tbps"], meta["bf16_tflops"]
    by_bench = defaultdict(list)
    for c in results["cases"]:
        by_bench[c["bench"]].append(c)
    out = [f"Run: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, commit "
           f"`{meta['commit'][:10]}`; ceilings measured in the run: copy {copy:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s.\n"]
    out += [f"- {note}" for note in meta.get("notes", [])] + ([""] if meta.get("notes") else [])
    for bench, rows in by_bench.items():
        keys = list(dict.fromkeys(k for r in rows for k in r["case"]))
        extra = EXTRA_COLUMNS.get(bench, ())
        runs = any("commit" in r for r in rows)  # rows merged from several runs name their commit
        head = keys + ["µs"] + [h for h, _ in extra] + ["peer", "peer µs", "× peer", "% copy BW", "% bf16 MMA"]
        head += ["commit"] if runs else []
        out.append(f"### `{bench}`\n")
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in rows:
            tb = r.get("tbps")
            tf = r.get("tflops")
            timed = r["median_us"] is not None
            cells = [_fmt(r["case"].get(k, "")) for k in keys] + [_fmt(r["median_us"]) if timed else "—"] + [
                cell(r) for _, cell in extra] + [
                r.get("peer") or "", _peer_us(r),
                _fmt(r["peer_median_us"] / r["median_us"]) if timed and r.get("peer_median_us") else "",
                _pct(r, "frac_of_copy", tb, copy), _pct(r, "frac_of_matmul", tf, mm)]
            cells += [f"`{r.get('commit', '')[:7]}`"] if runs else []
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    print(tables(json.loads(args.results.read_text())))


if __name__ == "__main__":
    main()
