"""Which loads of each PDL kernel run before its ``griddepcontrol.wait``, in the sm_90 SASS, without a GPU.

    PYTHONPATH=. python -m benchmarks.pdl_sass [op ...]                  # every op with a PDL kernel by default
    PYTHONPATH=. python -m benchmarks.pdl_sass w4a16_gemm -k prefetch=True [--all] [--json out.json]

A kernel launched with PDL may run while the kernel before it is still writing; only ``griddepcontrol.wait``
(SASS ``ACQBULK``) makes those writes visible. So every load placed before it must read bytes that no kernel of
the step writes (weights, and what the caller promised, e.g. ``prefetch_weights``). ptxas moves loads on its own:
it takes ``ld.global.nc`` bytes (SASS ``LDG ... .CONSTANT``) as constant for the kernel's life and moves their loads
across the wait both ways, while coherent loads (``LDG`` without ``.CONSTANT``) never move above it (they may sink
below it). Until session 36 the one-token GEMVs read their activations with ``.nc`` loads: the rows GEMV's x loads
and 663-860 float ops ran before its wait; and the half2 GEMV's prefetched weights, ``.nc`` too, all ran after it
(``_gemm_utils.ld4``'s ``CONSTANT``).

Compiles, through ``compile_check``'s fake Hopper (every op with PDL), each op's cases, and reports per kernel the
position of the (last) wait and what comes before it: coherent and ``.CONSTANT`` global loads and float arithmetic (which
can only work on bytes read before the wait), with the PTX ``.nc`` loads placed after the wait (those ptxas may
hoist; weights there are fine). By default one line per kernel with the largest counts over its compiled variants
(autotuned configs, cases); ``--all`` one line per variant. Static only: whether a load before the wait reads
weights or activations is for the reader (or the GPU tests in ``tests/kernels/test_pdl.py``) to tell.
"""
from __future__ import annotations

import argparse
import json
import re

from benchmarks import compile_check as cc
from benchmarks.sass_tools import collect_compiled, disassemble

PDL_OPS = ("w4a16_gemm", "fused_moe", "topk", "indexer_scores", "sparse_mla_decode", "mla_decode")
_FMA = {"FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2"}  # float arithmetic: before the wait, it can only be on
# bytes read before it (weights: a dequantization; activations: the hazard)
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")


def loads_around_wait(sass: str, ptx: str) -> dict | None:
    """What one kernel's SASS places before its last ``ACQBULK`` in address order (None: the kernel has no wait) —
    the main path's wait where an early-exit branch has its own before it (fused_moe's dropped experts) — and its
    PTX's ``.nc`` global loads after the last ``griddepcontrol.wait``. Before the last wait also counts the code
    of branches that end before it: an upper bound."""
    instrs = [text.split()[0] if not text.startswith("@") else text.split()[1] for _, text in _INSTR.findall(sass)]
    if "ACQBULK" not in instrs:
        return None
    wait = len(instrs) - 1 - instrs[::-1].index("ACQBULK")
    before = [op for op in instrs[:wait] if op.startswith("LDG")]
    after_wait_ptx = ptx.rsplit("griddepcontrol.wait", 1)[1]
    return {"wait_at": wait, "instructions": len(instrs), "waits": instrs.count("ACQBULK"),
            "fma_before": sum(op.split(".")[0] in _FMA for op in instrs[:wait]),
            "ldg_before": len(before), "constant_before": sum(".CONSTANT" in op for op in before),
            "coherent_before": sum(".CONSTANT" not in op for op in before),
            "ldg_after": sum(op.startswith("LDG") for op in instrs[wait:]),
            "ptx_nc_after_wait": len(re.findall(r"\bld\.global\.nc\b", after_wait_ptx))}


def audit(ops: list[str], only: str | None = None) -> list[dict]:
    """Compile ``ops`` on the fake Hopper (``only``: the cases whose label contains it); one row per distinct kernel
    with a PDL wait."""
    rows, seen = [], set()
    with collect_compiled(None, ptxas=False) as (_, compiled):
        for op in ops:
            for label, call in cc.OPS[op]():
                if only and only not in label:
                    continue
                n = len(compiled)
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - report and go on
                    rows.append({"op": op, "case": label, "error": f"{type(e).__name__}: {e}"[:300]})
                for name, kw, kernel in compiled[n:]:
                    if kernel.metadata.hash in seen:
                        continue
                    seen.add(kernel.metadata.hash)
                    found = loads_around_wait(disassemble(kernel), kernel.asm["ptx"])
                    if found is not None:
                        config = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
                                  for k, v in kw.items() if k.isupper()}
                        rows.append({"op": op, "case": label, "kernel": name, "config": config, **found})
                del compiled[n:]
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """One row per (op, kernel): how many compiled variants, and the largest of each count over them."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if "error" in r:
            continue
        s = out.setdefault((r["op"], r["kernel"]), {"op": r["op"], "kernel": r["kernel"], "variants": 0, "wait_share": 0.0})
        s["variants"] += 1
        s["wait_share"] = max(s["wait_share"], r["wait_at"] / r["instructions"])
        for key in ("coherent_before", "constant_before", "fma_before", "ptx_nc_after_wait"):
            s[key] = max(s.get(key, 0), r[key])
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", default=list(PDL_OPS), help=f"ops (default: {', '.join(PDL_OPS)})")
    parser.add_argument("-k", dest="only", help="only the cases whose label contains this")
    parser.add_argument("--all", action="store_true", help="one line per compiled variant (default: per kernel)")
    parser.add_argument("--json", help="also write every variant's row here")
    args = parser.parse_args(argv)
    rows = audit(args.ops, args.only)
    for r in rows:
        if "error" in r:
            print(f"{r['op']:18s} [{r['case']}] ERROR {r['error']}")
        elif args.all:
            print(f"{r['op']:18s} {r['kernel']:28s} wait at {r['wait_at']:5d}/{r['instructions']:5d}  before it: "
                  f"{r['coherent_before']:3d} coherent LDG, {r['constant_before']:3d} .CONSTANT, {r['fma_before']:4d} "
                  f"float ops; LDG after {r['ldg_after']:4d}; PTX .nc after {r['ptx_nc_after_wait']:3d}  [{r['case']}]")
    if not args.all:
        print(f"{'op':18s} {'kernel':28s} variants  wait at  | most before the wait: coherent LDG  .CONSTANT LDG  "
              "float ops | PTX .nc after")
        for s in summary(rows):
            print(f"{s['op']:18s} {s['kernel']:28s} {s['variants']:8d}  {s['wait_share']:6.1%}  | {s['coherent_before']:26d}"
                  f"  {s['constant_before']:13d}  {s['fma_before']:9d} | {s['ptx_nc_after_wait']:13d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
