"""Static sm_90 check of the ws FP8 GEMM's wgmma pipeline, without a GPU (``kernel_ws.py``, ``AHEAD``).

    PYTHONPATH=. python -m benchmarks.fp8_gemm_sass

Compiles ``fp8_gemm(variant="ws")`` through ``compile_check``'s fake Hopper in each consumer form (128 × 128 tiles
with and without ``AHEAD``, ``KSPLIT`` with and without it, both with ``AHEAD`` and ``PAIR_SLOTS``, 128 × 256) and
prints, per form, one JSON line: the fp8 wgmma count in the SASS (``QGMMA``), the levels of its
``WARPGROUP.DEPBAR.LE`` waits (``1``: a wgmma left in flight while the previous product is promoted; only ``0``:
every wgmma waited for at once), and ptxas's C75xx notes (C7514: wgmma serialized). Static only: nothing runs.
"""
from __future__ import annotations

import json
import re

import torch

from benchmarks.compile_check import ptxas_log
from benchmarks.sass_tools import collect_compiled, disassemble

FORMS = {"128x128": {"BN": 128, "STAGES": 4}, "128x128 AHEAD": {"BN": 128, "STAGES": 4, "AHEAD": 1},
         "KSPLIT": {"BN": 128, "STAGES": 6, "KSPLIT": 1},
         "KSPLIT AHEAD": {"BN": 128, "STAGES": 6, "KSPLIT": 1, "AHEAD": 1},
         "128x128 AHEAD PAIR_SLOTS": {"BN": 128, "STAGES": 3, "AHEAD": 1, "PAIR_SLOTS": 1},
         "KSPLIT AHEAD PAIR_SLOTS": {"BN": 128, "STAGES": 2, "KSPLIT": 1, "AHEAD": 1, "PAIR_SLOTS": 1},
         "128x256": {"BN": 256, "STAGES": 4}}


def profile() -> dict[str, dict]:
    """Form name -> {"qgmma", "depbar" (wait levels in program order), "ptxas" (C75xx notes)}."""
    with collect_compiled(("_fp8_gemm_ws_kernel",)) as (log, compiled):
        from mla_quant.kernels.fp8_gemm import fp8_gemm

        m, n, k = 1024, 1024, 2048
        fp8 = torch.float8_e4m3fn
        a, a_s = torch.zeros(m, k, dtype=fp8), torch.ones(m, k // 128)
        b, b_s = torch.zeros(n, k, dtype=fp8), torch.ones(n // 128, k // 128)
        for cfg in FORMS.values():
            fp8_gemm(a, a_s, b, b_s, config={"GROUP_M": 8, "TMA_STORE": 1, **cfg}, variant="ws")
    if log.errors:
        raise RuntimeError("\n".join(log.errors))
    out = {}
    for name, (_, _, kernel) in zip(FORMS, compiled):
        sass = disassemble(kernel).splitlines()
        out[name] = {"qgmma": sum("QGMMA" in line for line in sass),
                     "depbar": [int(re.search(r"gsb0, 0x(\d+)", line).group(1)) for line in sass
                                if "WARPGROUP.DEPBAR.LE" in line],
                     "ptxas": re.findall(r"\((C75\d\d)\)", ptxas_log(kernel.asm["ptx"]) or "")}
    return out


def main() -> int:
    for name, row in profile().items():
        print(json.dumps({"form": name, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
