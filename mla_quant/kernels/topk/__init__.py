"""``topk_indices``: per-row top-k column indices with -1 for masked (-inf) entries. Semantics: ``reference.py``.

Backends (``_backend.use_triton``): the reference (``torch.topk(sorted=False)`` + one ``where``) on CPU tensors;
on CUDA (or ``TRITON_INTERPRET=1``) a Triton radix select (``kernel.py``): histogram rounds over the
order-preserving integer keys of the scores (``radix_bits`` 8: rounds of 8 bits, the default; 11: rounds of 11,
11 and 10 bits, ~2.5x the histogram work per element for one launch fewer), each split over ``rows × chunks``
programs so that one row of 64k–128k spreads over the GPU (torch.topk measured 57 µs at one row of 64k with
k = 2048 on the H200, 40 µs at 8k). Two ways to finish (``finish``):

- ``"rounds"`` (the default at 11 bits): every round (4 at 8 bits, 3 at 11) finds the exact threshold key, then
  one select pass writes the selection. One memset and NR + 1 kernels.
- ``"candidates"`` (the default at 8 bits): two rounds (the threshold's top bits P: 16 at 8 bits, 22 at 11),
  then a compact pass (``rows × chunks`` programs) writes the keys above P and appends the keys in P's bin
  (key, column) to a per-row candidate buffer (int32 [T, 2, N], allocated here: 1 GiB at 2048 rows of 64k,
  which only ``method="radix"`` reaches); then the finish (one program per row) finds the threshold among the
  candidates bit by bit, writes the rest and clears the row's work buffer. The finish runs in the compact pass's
  last program of each row to arrive (an arrival counter; its own one-warp launch with ``fused_finish=False``):
  one memset (none with a kept work buffer: ``radix_topk_from``) and 3 kernels. At one row of 64k it replaces
  rounds 2-3 and the select pass (3.0 + 3.0 + 4.5 µs on the H200, plus a launch gap each) by the compact pass
  (3.8 µs) and the finish (4.9 µs as its own one-warp launch; 15.9 as 4 warps over 4096-candidate tiles) — the
  whole select 16.2 µs against 18.2 for the rounds finish in the same run (08559a3, k = 2048), and at 64 rows of
  64k 92 against 130. Fusing the finish into the compact pass (session 7) took a further 0.9 µs off the DSA
  step (31.30 vs 32.18 µs, interleaved sweep of 84444bd; compact + finish 8.75 µs of kernel).

No host sync either way (CUDA-graph safe). ``radix_topk_from`` continues a select whose first rounds another
kernel counted (``indexer_scores.indexer_topk`` fuses round 0 into the scores kernel).

Length threshold: a row with N ≤ k columns needs no selection (all of it is the answer) and takes one
``where`` over an ``arange``.

Row threshold: under ``method="auto"`` the radix select serves up to ``RADIX_MAX_ROWS`` rows (decode at small
batch) and more while rows · N ≤ ``RADIX_MAX_ELEMENTS``; larger inputs take ``torch.topk`` (the reference). With
8-bit digits (the default since the H200 run of commit 2bed842) and the rounds finish the select took 19.5 µs at
one row of 64k (torch.topk 58), 16 µs at one of 8k (49), 40 µs at 64 rows of 8k (66) but 130 µs at 64 rows of
64k (115); with the candidate finish (08559a3) 16.2 µs at one row of 64k, 33 at 64 rows of 8k (torch.topk 66),
92 at 64 rows of 64k (114) — hence ``RADIX_MAX_ELEMENTS`` = 4M scores, a rule measured for 8-bit digits (11-bit
digits lose to torch.topk from 64 rows of 8k). Measured on the H200 with k = 2048 and 11-bit digits
(``benchmarks/bench_dsa.py``, ``topk_us``): one row of 64k 34 µs (torch.topk 57), of 8k 33 µs (40); 64 rows of
64k 492 µs (113), of 8k 79 µs (65); 2048 rows of 64k (prefill) 13960 µs (1677): the radix cost grows by ~7 µs
per 64k row (its per-element histogram work, docs/dsa.md), torch.topk's by ~1 µs. The bench times 8-bit digits
(``topk_radix8_us``: the default finish; ``topk_radix8_rounds_us``: the rounds finish) at the same shapes.
"""
from __future__ import annotations

import torch

from .._backend import use_triton
from .._checks import check_tensor
from .._gemm_utils import num_sms
from .._host import cdiv, next_power_of_2
from .._pdl import pdl_launch
from .kernel import CAND_ROUNDS, rounds, work_ints
from .reference import topk_indices_reference

__all__ = ["topk_indices", "topk_indices_reference", "radix_topk_from", "RADIX_MAX_ROWS", "RADIX_MAX_ELEMENTS",
           "RADIX_BITS", "FINISHES"]

RADIX_MAX_ROWS = 4  # rows always served by the radix select under "auto" (measured, docstring)
# ... and more rows while rows · N stays within this: 64 rows of 64k, where the 8-bit candidate select took 92 µs
# against torch.topk's 114 (H200, 08559a3; the rounds finish 130); 2048 rows of 64k (prefill) stay with torch.topk
RADIX_MAX_ELEMENTS = 1 << 22
RADIX_BITS = 8      # default digit width: rounds of 256 bins beat rounds of 2048 at every measured shape
RADIX_CHOICES = (8, 11)
METHODS = ("auto", "radix", "torch")
FINISHES = ("candidates", "rounds")
# candidates the finish kernel (one warp) searches in registers, more are re-read in tiles of this size; its first
# form (4096 over 4 warps: 16 block-wide sums in a row, each a barrier) took 15.9 µs of a 36.5 µs DSA step (H200)
CAND_BLOCK = 1024


def default_finish(radix_bits: int) -> str:
    """The candidate finish for 8-bit digits, the rounds + select pass for 11 (kept as measured)."""
    return "candidates" if radix_bits == 8 else "rounds"


def _check_finish(finish: str | None, rounds_done: int = 0) -> None:
    if finish is not None and finish not in FINISHES:
        raise ValueError(f"finish: {finish!r} not in {FINISHES} (or None: the default of the digit width)")
    if finish == "candidates" and rounds_done > CAND_ROUNDS:
        raise ValueError(f"finish: 'candidates' follows {CAND_ROUNDS} rounds, {rounds_done} already done")


def topk_indices(scores: torch.Tensor, k: int, method: str = "auto", radix_bits: int = RADIX_BITS,
                 finish: str | None = None) -> torch.Tensor:
    """scores [T, N] float -> int32 [T, min(k, N)] (unordered; -1 where the score is -inf). ``method``:
    ``"auto"`` (on the Triton backend the radix select for ≤ ``RADIX_MAX_ROWS`` rows or ≤ ``RADIX_MAX_ELEMENTS``
    scores, else torch.topk),
    ``"radix"`` (the Triton radix select whenever the backend is Triton) or ``"torch"``; ``radix_bits``: the
    radix select's digit width (8: four histogram rounds of 256 bins; 11: three of 2048/2048/1024); ``finish``:
    how the radix select ends (``"candidates"``: two rounds, then the candidate compact and finish kernels;
    ``"rounds"``: every round, then the select pass; None: ``default_finish(radix_bits)``)."""
    check_tensor("scores", scores, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=2)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: {k!r} must be a positive int")
    if scores.shape[-1] == 0:
        raise ValueError("scores: needs at least one column")
    if method not in METHODS:
        raise ValueError(f"method: {method!r} not in {METHODS}")
    if radix_bits not in RADIX_CHOICES:
        raise ValueError(f"radix_bits: {radix_bits!r} not in {RADIX_CHOICES}")
    _check_finish(finish)
    rows, n = scores.shape
    radix = method == "radix" or (method == "auto" and (rows <= RADIX_MAX_ROWS or rows * n <= RADIX_MAX_ELEMENTS))
    if not use_triton(scores) or not radix:
        return topk_indices_reference(scores, k)
    return _radix_topk(scores, k, radix_bits=radix_bits, finish=finish)


def radix_block(rows: int, n: int, device: torch.device) -> int:
    """Columns per radix tile: 1024, or 256 when 1024-column tiles would give fewer than ~4 programs per SM (one
    row of 64k: 256 programs of 256 columns instead of 64 of 1024 — each round is then mostly latency, and a
    program's histogram work shrinks with its tile)."""
    return 1024 if rows * cdiv(n, 1024) >= 4 * num_sms(device) else 256


def radix_topk_from(scores: torch.Tensor, k: int, work: torch.Tensor, rounds_done: int,
                    finish: str | None = None) -> torch.Tensor:
    """The radix select (``RADIX_BITS`` digits, ``finish`` as in topk_indices) of rows of N > k scores whose
    first ``rounds_done`` histogram rounds another kernel already counted into ``work`` (int32
    [T, kernel.work_ints(RADIX_BITS)], zeroed before it counted; ``indexer_topk`` fuses round 0 into the scores
    kernel). The candidate finish leaves ``work`` zero again (its kernel, the last to read a row, clears it), so
    a caller may keep one buffer for every call (no memset launch). Triton backend only."""
    _check_finish(finish, rounds_done)
    rows, n = scores.shape
    if n <= k or tuple(work.shape) != (rows, work_ints(RADIX_BITS)) or work.dtype != torch.int32:
        raise ValueError(f"work: int32 {(rows, work_ints(RADIX_BITS))} for N > k expected, got "
                         f"{work.dtype} {tuple(work.shape)} at N={n}, k={k}")
    if not work.is_contiguous() or work.data_ptr() % 8:
        raise ValueError("work: must be contiguous and 8-byte aligned (the finish reads two counters as one int64)")
    return _radix_topk(scores, k, work=work, rounds_done=rounds_done, finish=finish)


def _radix_topk(scores: torch.Tensor, k: int, block: int | None = None, chunks: int | None = None,
                out: torch.Tensor | None = None, radix_bits: int = RADIX_BITS, work: torch.Tensor | None = None,
                rounds_done: int = 0, finish: str | None = None, cand_block: int = CAND_BLOCK,
                fused_finish: bool = True, compact_warps: int = 4, warp_search: bool = True) -> torch.Tensor:
    """The Triton path. ``block`` (columns per tile, a power of two; default ``radix_block``), ``chunks``
    (programs per row), ``out`` (int32 [T, min(k, N)], contiguous), ``cand_block`` (the finish's candidate tile,
    a power of two), ``warp_search`` (up to 128 candidates searched by every warp on its own copy),
    ``fused_finish`` (the candidate finish in the compact pass's last program of each row, or its own launch) and
    ``compact_warps`` are exposed for tests and the bench; ``work``/``rounds_done``/``finish``: see
    radix_topk_from."""
    rows, n = scores.shape
    kk = min(k, n)
    if out is None:
        out = torch.empty(rows, kk, dtype=torch.int32, device=scores.device)
    if n <= k:                                   # every column is selected
        cols = torch.arange(n, dtype=torch.int32, device=scores.device)
        return out.copy_(torch.where(scores == float("-inf"), -1, cols))
    if rows == 0:
        return out
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    from .kernel import _radix_compact_kernel, _radix_finish_kernel, _radix_histogram_kernel, _radix_select_kernel

    finish = finish or default_finish(radix_bits)
    block = block or radix_block(rows, n, scores.device)
    tiles = cdiv(n, block)
    if chunks is None:                           # about four programs per SM over all rows
        chunks = cdiv(4 * num_sms(scores.device), rows)
    tiles_per_chunk = cdiv(tiles, max(1, min(chunks, tiles)))
    grid = (rows, cdiv(tiles, tiles_per_chunk))
    digits = rounds(radix_bits)
    width = work_ints(radix_bits)
    pdl = pdl_launch(scores.device, "topk")
    if work is None:
        work = torch.zeros(rows, width, dtype=torch.int32, device=scores.device)
    counted = CAND_ROUNDS if finish == "candidates" else len(digits)
    for r, (shift, bits) in list(enumerate(digits))[rounds_done:counted]:
        _radix_histogram_kernel[grid](scores, scores.stride(0), work, n, kk, tiles_per_chunk, ROUND=r,
                                      SHIFT=shift, BITS=bits, RADIX=radix_bits, NR=len(digits), BLOCK=block,
                                      WORK=width, num_warps=4, **pdl)
    if finish == "rounds":
        _radix_select_kernel[grid](scores, scores.stride(0), work, out, out.stride(0), n, kk, tiles_per_chunk,
                                   RADIX=radix_bits, NR=len(digits), BLOCK=block, WORK=width, num_warps=4, **pdl)
        return out
    cand = torch.empty(rows, 2, n, dtype=torch.int32, device=scores.device)   # per row: keys, then columns
    finish_args = dict(ROUNDS=CAND_ROUNDS, RADIX=radix_bits, WORK=width, WORK_P2=next_power_of_2(width),
                       CAND_BLOCK=cand_block, WARP_SEARCH=warp_search)
    _radix_compact_kernel[grid](scores, scores.stride(0), work, out, out.stride(0), cand, n, kk, tiles_per_chunk,
                                NR=len(digits), BLOCK=block, FUSED=fused_finish, **finish_args,
                                WARPS=compact_warps, num_warps=compact_warps, **pdl)
    if not fused_finish:
        _radix_finish_kernel[(rows,)](work, out, out.stride(0), cand, n, kk, NR=len(digits), **finish_args,
                                      WARPS=1, num_warps=1, **pdl)
    return out
