"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of one decode step.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still running: its
programs become resident, then block in ``griddepcontrol.wait`` (``grid_dependency_sync``, the first statement
of every kernel that takes ``PDL``) until that kernel has finished and its writes are visible, and only then
read or write memory. Each program also signals, before its wait (``EARLY``), that the next kernel may be
scheduled, so a chain of short kernels (the DSA step: indexer, top-k rounds, sparse attention, split merge) loses
most of the launch gap between kernels, also inside a CUDA graph (stream capture keeps the programmatic edges).
Because every program waits before its first memory access, the ordering is the same as a plain launch: a kernel
sees all writes of every kernel before it, and none of its writes can overtake a read of the kernel before it.

Measured on the H200 (GLM 5.2 DSA step, fp8_ds_mla pages, 8 heads, batch 1, 64k context, ``sweep_dsa``,
interleaved rounds, run of 29275a0): 29.69 µs with PDL as below against 30.84 with plain launches.
"""
from __future__ import annotations

import functools
import os

import torch

from ._backend import triton_interpreted

ENABLED = os.environ.get("MLA_QUANT_PDL", "1") != "0"   # module constant: the sweeps time both settings
# sparse_mla_decode_wide: the split kernel at more than 16 heads; pair_order: the half2 GEMV's activation layout (x
# before fused_moe's gate-up, h between its GEMVs); w4a16_gemv: w4a16_gemm's one-token "rows" GEMV with
# prefetch_weights (it loads its weights before the wait: gemv.py)
OPS = ("mla_decode", "mla_decode_merge", "indexer_scores", "topk", "sparse_mla_decode", "sparse_mla_decode_wide",
       "sparse_mla_decode_merge", "fused_moe", "pair_order", "w4a16_gemv")
# Ops launched plainly even when ENABLED: they start once the previous kernel has finished, yet still let the next
# kernel be scheduled early. Launched early, a kernel's programs are placed on the SMs as the previous kernel's
# programs leave them, not spread evenly; that costs a kernel whose grid is one balanced wave of long programs.
# H200, sweep_dsa (interleaved rounds, fp8_ds_mla, batch 1, 64k; runs of c698703 to 29275a0):
# - mla_decode_merge: GLM 5.2's dense decode at 64 heads took 201.2 µs with its merge launched early against
#   168.7 plain (that merge of 218 splits runs ~26 µs);
# - mla_decode: the same kind of grid, kept plain, not timed early on its own (early together with the merge:
#   199-201 µs at 64 heads; 83.2-84.5 against 84.7-84.9 at 8);
# - sparse_mla_decode_wide: the DSA step at 64 heads 42.6 µs with the sparse kernel launched early against 39.2;
# - sparse_mla_decode (≤ 16 heads): launched early in session 8 (30.6 against 30.9 µs plain at 8 heads), plain since
#   the top-k's loads moved ahead of its scans (e94d0f7, two sweeps: 29.04 against 29.27 µs and 29.34 against 29.62
#   at 8 heads; 37.13 against 37.20 and 37.40 against 37.50 at 64 heads);
# - indexer_scores: launched plainly 30.1 against 30.6 µs at 8 heads, 42.2 against 42.6 at 64.
# The top-k launches and the sparse merge gain 0.2-1.0 µs each from PDL.
# - w4a16_gemm's one-token GEMV (planes1, not in OPS): launched with PDL in session 24 (d253abe, reverted), bench gemm
#   at M = 1 with kept counters read 7.90 / 12.05 µs against 7.55 / 10.69 plain (2048 / 4096 x 7168; each call after
#   the previous one's GEMV), 8.81 / 11.99 against 8.61 / 11.76 for a bare call: it waited before its first load, so
#   nothing overlapped. The whole-row GEMV (w4a16_gemv, session 25) loads its weights before the wait: 3.56 / 7.01 µs
#   against 6.70 / 9.28 plain (bench gemm of a5009ca). Those PDL figures, and later ones until session 36, were of a
#   racy kernel: ptxas had hoisted its x loads (ld.global.nc) and most of its arithmetic above the wait (docs/moe.md
#   "activations only after the PDL wait"); without the race (H100, session 36) 5.49 / 10.01 µs.
SKIP = frozenset({"mla_decode", "mla_decode_merge", "indexer_scores", "sparse_mla_decode", "sparse_mla_decode_wide"})
# Each program lets the next kernel be scheduled before (True) or after (False) its own wait; before, a chain's
# kernels are scheduled up to two ahead (MLA_QUANT_PDL_EARLY=0: after). Run of 29275a0: the DSA step at 8 heads
# 29.69 µs against 29.78 in the sweep, 29.56 against 30.26 in bench_dsa (on the other GPU); 64 heads 38.01 / 38.15.
EARLY = os.environ.get("MLA_QUANT_PDL_EARLY", "1") != "0"


@functools.lru_cache(maxsize=None)
def _sm90_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(device: torch.device, op: str) -> dict:
    """Keyword arguments for launching ``op``'s kernel (one of ``OPS``; it takes ``PDL: tl.constexpr``):
    ``PDL=1`` (2 with ``EARLY``: signal, then wait) and ``launch_pdl=True`` on an sm_90+ CUDA device while
    ``ENABLED`` (``MLA_QUANT_PDL=0`` turns it off); only ``PDL`` for an op in ``SKIP`` (a plain launch whose
    kernel still signals the next one); ``PDL=False`` otherwise (a plain launch; the interpreter, older GPUs)."""
    if op not in OPS:
        raise ValueError(f"op: {op!r} not in {OPS}")
    if ENABLED and device.type == "cuda" and not triton_interpreted():
        index = device.index if device.index is not None else torch.cuda.current_device()
        if _sm90_or_later(index):
            mode = 2 if EARLY else 1
            return {"PDL": mode} if op in SKIP else {"PDL": mode, "launch_pdl": True}
    return {"PDL": False}
