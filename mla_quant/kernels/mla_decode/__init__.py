"""Absorbed MLA decode over paged latent KV (BF16, FP8 e4m3 per token / per tensor, FP8 ds_mla).

``mla_decode(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind, d_latent)`` returns the
latent-space attention output ``[B, S, H, d_latent]`` and its log-sum-exp ``[B, S, H]`` (docs/mla.md).
The Triton path splits long contexts over several programs (flash-decoding) and merges them with a
log-sum-exp combine kernel; the reference (``reference.py``) gathers rows and attends in fp32.
"""
from __future__ import annotations

import math

import torch

from .._backend import gluon_available as _gluon_available
from .._backend import is_hopper as _is_hopper
from .._backend import triton_interpreted, use_triton
from .._checks import check_same_device, check_tensor
from .._host import cdiv, next_power_of_2
from .._outputs import output_buffer
from .._pdl import pdl_launch
from ..kv_layout import DS_MLA_TILE, check_kv_pages, kv_data_dtype, kv_row_width
from .reference import gather_kv_rows, mla_decode_reference

__all__ = ["mla_decode", "mla_decode_reference", "check_kv_pages", "choose_num_splits", "plan_num_splits",
           "plan_head_groups", "last_launch", "takes_tma_launch", "gather_kv_rows", "tuned_config", "combine_splits",
           "COMBINES"]

Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_SPLITS = 256
# how FP8 tiles become dot operands (docs/mla.md, "FP8 fast dequant", "fp16 dot operands", "fp8 tensor-core dots")
FP8_DEQUANTS = ("auto", "convert", "bitcast", "fp16", "fp8mma", "fp8mma_pv", "fp8mma_q1", "fp8mma_pv_q1", "gluon")
# the kernel's FP8_MMA constexpr per choice: e4m3 score dots with q as two e4m3 terms (hi + lo/16, 3 and 4) or one
# (q1: 1 and 2) per row scale; the PV dot in fp16 (odd) or e4m3 (even)
FP8_MMA_LEVELS = {"fp8mma": 3, "fp8mma_pv": 4, "fp8mma_q1": 1, "fp8mma_pv_q1": 2}
# "auto" takes the bitcast for fp8_e4m3 pages once a request has this many query rows (s_q * heads): measured on
# the H200 (benchmarks/results/h200.json, mla_decode rows with variant "bitcast"), 1.30-1.35x faster than the
# conversion at 128 heads, 0.92-1.03x at 16 heads; slower for fp8_ds_mla (0.55-1.0x), which keeps the conversion
# (at <= 16 query rows fp8_ds_mla runs the Gluon kernel since session 21).
BITCAST_MIN_ROWS = 64
# ... and the fp8 tensor-core dots ("fp8mma") for fp8_e4m3 pages and bf16 / fp16 queries once a call covers this
# many cached tokens (batch x max_seq_len): measured on the H200 (run of 71d17aa, mla_decode rows with variant
# "fp8mma"), 1.27x the conversion at 16 heads x batch 64 x 4k, 1.26x at 64k, 1.23x at batch 1 x 64k, 1.40x the
# bitcast at 128 heads x batch 64; slower at batch 1 x 4k (0.88x the conversion at 16 heads, 0.64x the bitcast at 128)
FP8_MMA_MIN_TOKENS = 32768
COMBINES = ("auto", "rows", "tiles")  # mla_decode(combine=...): the kernel that merges the KV splits
# bf16 pages and queries, ≤ 16 query rows per request, 64-token tiles within a page and rows TMA can address
# (takes_tma_launch): the launcher runs TMA_CONFIG (whole tiles by TMA, two in flight, 164 KB of shared memory:
# one program per SM) with the KV split planned for one program per SM. H200, 16 heads x batch 64 x 4k
# (results/sweep_mla_decode_h200.json, session 11): 2 splits 90.5 µs = 0.797 of copy, against 98.6 (0.731) for the
# autotuned pointer-load kernel at its 4 splits; the TMA config at 4 splits (two waves) 101.0. TMA_LAUNCH False:
# the autotuner as before (sweeps).
TMA_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, QK_SPLIT_LOAD=False, TMA=True, num_warps=8, num_stages=3)
TMA_LAUNCH = True
# fp8_e4m3 pages read by the bitcast (fp8_dequant="bitcast", which "auto" takes where this applies), bf16 queries,
# ≤ 16 query rows: the launcher runs FP8_TMA_CONFIG (the int32 words of whole 32-token tiles staged by TMA, two in
# flight; 231 registers, 89 KB: two programs per SM). H200, 16 heads, session 12 (bench mla_decode of 825d320, the
# launcher's own split counts): batch 1 x 4k 22.0 µs against 23.2 for the conversion ("auto" before); batch 1 x 64k
# 56.7 against 61.8 for the fp8 tensor-core dots ("auto" before); batch 64 x 4k 118.4 against 126.8; batch 64 x 64k
# 1679.9 against 1688.3; the autotuned bitcast with pointer-loaded words took 155.8 at batch 64 x 4k (sweep).
FP8_TMA_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, QK_SPLIT_LOAD=False, TMA=True, num_warps=4, num_stages=3)
# head_groups="auto" (the default): one query token and more than GROUP_ROWS heads (a multiple of it) decode as
# heads / GROUP_ROWS groups of GROUP_ROWS heads where each group takes a 16-row kernel: the Gluon kernel for fp8
# pages, TMA_CONFIG for bf16 pages (plan_head_groups). H100, session 31 (results/sweep_mla_gluon_h200.json, docs/mla.md
# "Head groups"), 64 / 128 heads: fp8_e4m3 pages 1.6-2.8x faster than ungrouped at batch 1 to 128, fp8_ds_mla
# 2.4-4.2x; bf16 pages 1.4-2.2x up to batch 8, 1.6x at 128 heads x 32 x 4k, even (0.97x) at 64 heads x 32 x 4k and
# 1.07-1.08x slower at 128 x 1k, where the ungrouped grid already fills the GPU: HEAD_GROUPS_MAX_BATCH_BF16.
GROUP_ROWS = 16
HEAD_GROUPS_MAX_BATCH_BF16 = 32


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _validate_tables(block_table: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int,
                     min_len: int) -> None:
    """Data-dependent checks (one device sync): lengths fit their pages, used page ids exist."""
    max_pages = block_table.shape[1]
    need = (seq_lens.long() + page_size - 1) // page_size
    used = torch.arange(max_pages, device=block_table.device)[None, :] < need[:, None]
    bad_id = used & ((block_table < 0) | (block_table >= num_pages))
    flags = torch.stack([(seq_lens < min_len).any(), (need > max_pages).any(), bad_id.any()]).tolist()
    if flags[0]:
        b = int((seq_lens < min_len).nonzero()[0])
        raise ValueError(f"seq_lens: request {b} has {int(seq_lens[b])} cached tokens, fewer than its "
                         f"{min_len} query tokens")
    if flags[1]:
        b = int((need > max_pages).nonzero()[0])
        raise ValueError(f"seq_lens: request {b} has {int(seq_lens[b])} tokens, longer than its "
                         f"{max_pages} pages of {page_size} in block_table")
    if flags[2]:
        b, j = (int(v) for v in bad_id.nonzero()[0])
        raise ValueError(f"block_table: page id {int(block_table[b, j])} of request {b} (entry {j}) is out "
                         f"of range [0, {num_pages})")


def choose_num_splits(work_items: int, max_len: int, min_tokens: int, slots: int) -> int:
    """KV splits per (request, head block) so the grid fills ``slots`` concurrent programs (flash-attn's
    wave-efficiency heuristic), with at least ``min_tokens`` tokens per split."""
    if work_items >= 0.8 * slots or max_len <= min_tokens:
        return 1
    cap = max(1, min(MAX_SPLITS, max_len // min_tokens, slots))
    eff = [(n := work_items * s / slots) / math.ceil(n) for s in range(1, cap + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, start=1) if e >= 0.85 * best)


def _block_m(m_rows: int) -> int:
    """Query rows (S·H) per program: the M of the tensor-core dots (16 minimum)."""
    return 16 if m_rows <= 16 else 32 if m_rows <= 32 else 64


def plan_num_splits(batch: int, s_q: int, heads: int, max_len: int, kind: str, d_latent: int, d_rope: int,
                    num_sms: int, per_sm: int | None = None) -> int:
    """The launcher's KV-split count for a shape: fill ``per_sm`` programs per SM (default ~2; 1 for 64-row head
    blocks, which use most of the registers, and for TMA_CONFIG's shared memory); a split reads at least 128
    tokens and at least the bytes its fp32 partial output costs (written, then read by the combine — mostly
    from L2)."""
    block_m = _block_m(s_q * heads)
    row_bytes = kv_row_width(kind, d_latent, d_rope) * kv_data_dtype(kind).itemsize + (4 if kind == "fp8_e4m3" else 0)
    min_tokens = max(128, block_m * d_latent * 8 // row_bytes)
    slots = num_sms * (per_sm or (2 if block_m <= 32 else 1))
    return choose_num_splits(batch * cdiv(s_q * heads, block_m), max_len, min_tokens, slots)


def _word_aligned(kv_data: torch.Tensor) -> bool:
    """Whether the pages can be read as 4-byte words (row stride, page stride and offset multiples of 4 bytes)."""
    return not (kv_data.stride(0) % 4 or kv_data.stride(1) % 4 or kv_data.storage_offset() % 4)


def _check_config(config: dict) -> None:
    unknown = set(config) - {"BLOCK_M", "BLOCK_N", "QK_SPLIT_LOAD", "PREFETCH", "TMA", "num_warps", "num_stages"}
    if unknown or not {"BLOCK_M", "BLOCK_N", "QK_SPLIT_LOAD"} <= set(config):
        raise ValueError("config: needs BLOCK_M, BLOCK_N, QK_SPLIT_LOAD (+ PREFETCH, TMA, num_warps, num_stages), "
                         f"got {sorted(config)}")
    if config["BLOCK_M"] not in (16, 32, 64) or config["BLOCK_N"] < 16 or not _is_pow2(config["BLOCK_N"]):
        raise ValueError(f"config: BLOCK_M {config['BLOCK_M']} must be 16/32/64 and BLOCK_N "
                         f"{config['BLOCK_N']} a power of two ≥ 16")


def _scale_mode(kind: str, kv_scales: torch.Tensor | None) -> int:
    if kind == "bf16":
        return 0
    if kind == "fp8_ds_mla":
        return 3
    return 1 if kv_scales.numel() > 1 else 2


def _page_views(kv_data: torch.Tensor, kv_scales: torch.Tensor | None, kind: str, d_latent: int):
    """(latent view, rope view, scale view) of the pages with their (page, row) strides in elements."""
    if kind in ("bf16", "fp8_e4m3"):
        lat, rope = kv_data[..., :d_latent], kv_data[..., d_latent:]
        sc = kv_scales if kv_scales is not None and kv_scales.numel() > 1 else None
        sc_strides = (sc.stride(0), sc.stride(1)) if sc is not None else (0, 0)
        return lat, rope, (kv_scales if kv_scales is not None else kv_data), sc_strides
    # fp8_ds_mla: one uint8 row = [e4m3 latent | fp32 tile scales | bf16 rope]
    n_tiles = d_latent // DS_MLA_TILE
    if not _word_aligned(kv_data):
        raise ValueError("kv_data: fp8_ds_mla pages must be 4-byte aligned (row stride, page stride, offset)")
    lat = kv_data.view(torch.float8_e4m3fn)[..., :d_latent]
    sc = kv_data.view(torch.float32)[..., d_latent // 4: d_latent // 4 + n_tiles]
    rope = kv_data.view(torch.bfloat16)[..., (d_latent + 4 * n_tiles) // 2:]
    return lat, rope, sc, (sc.stride(0), sc.stride(1))


def mla_decode(q: torch.Tensor, kv_data: torch.Tensor, kv_scales: torch.Tensor | None, block_table: torch.Tensor,
               seq_lens: torch.Tensor, softmax_scale: float, kind: str, d_latent: int, *,
               num_splits: int | None = None, max_seq_len: int | None = None, validate: bool = True,
               out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
               config: dict | None = None, fp8_dequant: str = "auto",
               combine: str = "auto", head_groups: int | str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: ``q`` [B, S, H, d_latent + d_rope] over paged latents -> (out [B, S, H, d_latent]
    in q.dtype, lse fp32 [B, S, H]). See ``reference.mla_decode_reference`` for the exact semantics.

    ``num_splits``: KV splits per request (None: chosen from the grid size and ``max_seq_len``, a host-side
    upper bound of seq_lens defaulting to the block table's capacity). ``validate``: check seq_lens and
    page ids against the tables (one device sync; engines that build the tables themselves may skip it).
    ``out`` / ``lse``: optional preallocated outputs (contiguous, the shapes and dtypes above).
    ``config``: force one kernel configuration instead of the autotuner — ``BLOCK_M`` (16/32/64 query rows),
    ``BLOCK_N`` (tokens per tile), ``QK_SPLIT_LOAD``, optionally ``PREFETCH`` (load the next tile's bytes one
    iteration ahead), ``TMA`` (bf16 / fp8_e4m3 pages: read whole tiles through TMA descriptors where the pages
    allow it, see ``_tma_rows``), ``num_warps`` / ``num_stages`` (tests, tuning). Without it, bf16 pages and
    queries with ≤ 16 query rows run ``TMA_CONFIG`` where TMA can read them (:func:`takes_tma_launch`), the
    bitcast of fp8_e4m3 pages likewise ``FP8_TMA_CONFIG``, everything else the autotuner;
    :func:`tuned_config` names the autotuner's choice of the last tuned launch.
    ``fp8_dequant``: ``"convert"`` (Triton's e4m3 conversion, ds_mla tile scales multiplied into the tile),
    ``"bitcast"`` (integer bit manipulation, all scales applied to scores and p; same results within rounding;
    docs/mla.md), ``"fp16"`` (the conversion to fp16 dot operands, q and p pre-scaled by powers of two; bf16 /
    fp16 queries only, fp32 queries keep the conversion), ``"fp8mma"`` (fp8_e4m3 pages: the score dots take the
    e4m3 bytes unconverted, q rounded to e4m3 with a per-row scale; the PV dot as ``"fp16"``), ``"fp8mma_pv"`` (also
    the PV dot in e4m3, p·scale rounded to e4m3; fp8_ds_mla pages keep the conversion under both; lossier than the
    others: docs/mla.md, "fp8 tensor-core dots"), ``"gluon"`` (fp8_e4m3 pages of 512 + 64 with 16-bit q, or
    fp8_ds_mla pages with bf16 q; at most 16 query rows, a Hopper GPU: kernel_gluon.py, mma.sync in fp16 on the e4m3
    bytes read from TMA-staged tiles; raises naming the reason where :func:`gluon_fits` says it cannot run) or
    ``"auto"`` (default: "gluon" wherever it fits; for fp8_e4m3 pages else the bitcast where it takes
    ``FP8_TMA_CONFIG`` (:func:`takes_tma_launch`);
    else "fp8mma" when q is bf16 / fp16 and batch × max_seq_len (the block table's capacity when not given) ≥
    ``FP8_MMA_MIN_TOKENS``;
    else the bitcast with ≥ ``BITCAST_MIN_ROWS`` query rows per request and 4-byte aligned pages; else the
    conversion). Only the Triton path of FP8 pages is affected. (A kernel on ``mma.sync`` fragments built in
    registers, ``"fragments"``, measured 1.4-2x the bitcast's time and was removed: docs/mla.md.)
    ``combine`` (Triton path, with more than one KV split): the kernel that merges the splits' partials,
    ``"rows"`` or ``"tiles"`` (:func:`combine_splits`), or ``"auto"`` (default: rows up to ``ROWS_MAX_SPLITS``
    splits, tiles above). A merge in the decode kernel's epilogue (the last split program of each row block merges,
    arrival counters) was measured no faster and removed: docs/mla.md.
    ``head_groups`` (G, dividing H): run the heads as G groups of H / G, each group a request of its own over the
    same pages and length (:func:`_decode_head_groups`): G times the programs, and the pages read G times (mostly
    from L2 when the groups run together); same results up to fp32 rounding (another split plan). ``"auto"``
    (default): :func:`plan_head_groups` — H / 16 groups at one query token and 32 or more heads on a Hopper GPU
    where each group then runs a 16-row kernel (the Gluon kernel for fp8 pages; ``TMA_CONFIG`` for bf16 pages, up to
    ``HEAD_GROUPS_MAX_BATCH_BF16`` requests), 1 elsewhere and whenever ``config`` is given or ``fp8_dequant`` names
    another FP8 path (docs/mla.md "Head groups").
    """
    if fp8_dequant not in FP8_DEQUANTS:
        raise ValueError(f"fp8_dequant: {fp8_dequant!r} not in {FP8_DEQUANTS}")
    if combine not in COMBINES:
        raise ValueError(f"combine: {combine!r} not in {COMBINES}")
    check_tensor("q", q, dtype=Q_DTYPES, ndim=4)
    if q.stride(-1) != 1:
        raise ValueError("q: the last dimension must be contiguous")
    bsz, s_q, heads, d = q.shape
    d_rope = d - d_latent
    if d_latent <= 0 or d_rope <= 0:
        raise ValueError(f"d_latent: {d_latent} must lie strictly inside q's last dimension {d}")
    check_kv_pages(kv_data, kv_scales, kind, d_latent, d_rope)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    if block_table.shape[0] != bsz or seq_lens.shape[0] != bsz:
        raise ValueError(f"block_table {tuple(block_table.shape)} / seq_lens {tuple(seq_lens.shape)}: "
                         f"need one row per request ({bsz})")
    if block_table.stride(1) != 1:
        raise ValueError("block_table: rows must be contiguous")
    check_same_device(q=q, kv_data=kv_data, kv_scales=kv_scales, block_table=block_table, seq_lens=seq_lens)
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: {softmax_scale} must be a positive finite number")
    num_pages, page_size = kv_data.shape[:2]
    if validate and bsz:
        _validate_tables(block_table, seq_lens, num_pages, page_size, s_q)
    if head_groups == "auto":  # (the reference backend, forced on a GPU, runs ungrouped)
        head_groups = plan_head_groups(q, kv_data, kind, d_latent, config, fp8_dequant) \
            if use_triton(q, kv_data, block_table, seq_lens) else 1
    elif isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1 \
            or heads % head_groups:
        raise ValueError(f"head_groups: {head_groups!r} must be 'auto' or a positive integer dividing the {heads} "
                         "heads")
    out = output_buffer("out", out, (bsz, s_q, heads, d_latent), q.dtype, q.device)
    lse = output_buffer("lse", lse, (bsz, s_q, heads), torch.float32, q.device)
    if head_groups > 1:
        return _decode_head_groups(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind, d_latent,
                                   head_groups, out, lse, num_splits=num_splits, max_seq_len=max_seq_len,
                                   config=config, fp8_dequant=fp8_dequant, combine=combine)
    if not use_triton(q, kv_data, block_table, seq_lens):
        o_ref, lse_ref = mla_decode_reference(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind,
                                              d_latent)
        return out.copy_(o_ref), lse.copy_(lse_ref)
    if not (_is_pow2(d_latent) and _is_pow2(d_rope) and d_latent >= 16 and d_rope >= 16):
        raise ValueError(f"d_latent, d_rope: the Triton kernel needs powers of two ≥ 16, got {d_latent}, {d_rope}")
    if fp8_dequant == "auto":
        max_len = max_seq_len if max_seq_len is not None else block_table.shape[1] * page_size
        fp8_dequant = _auto_fp8_dequant(kind, q, kv_data, bsz, max_len, d_latent)
    fp8 = kind != "bf16"
    if fp8 and fp8_dequant == "gluon":
        return _mla_decode_gluon(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind, d_latent,
                                 num_splits, max_seq_len, out, lse, combine)
    return _mla_decode_triton(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind, d_latent,
                              num_splits, max_seq_len, out, lse, config, fp8 and fp8_dequant == "bitcast",
                              fp8 and fp8_dequant == "fp16",
                              FP8_MMA_LEVELS.get(fp8_dequant, 0) if kind == "fp8_e4m3" else 0, combine)


def _decode_head_groups(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind, d_latent, groups, out, lse,
                        **options):
    """:func:`mla_decode` with ``head_groups=groups`` (checked inputs, allocated outputs): q [B, S, H, D] as
    [B·G, S, H/G, D], group g of request b the row b·G + g with b's block table row and length. With one query token
    the grouped q, out and lse are views of the caller's; with more, q is copied and the outputs copied back."""
    bsz, s_q, heads, d = q.shape
    per, d_out = heads // groups, out.shape[-1]  # (explicit sizes: views of an empty batch cannot infer -1)
    grouped_q = q.reshape(bsz, s_q, groups, per, d).transpose(1, 2).reshape(bsz * groups, s_q, per, d)
    tables = block_table.repeat_interleave(groups, dim=0)
    lens = seq_lens.repeat_interleave(groups)
    if s_q == 1:  # [B, 1, G·per, ...] and [B·G, 1, per, ...] are the same memory
        mla_decode(grouped_q, kv_data, kv_scales, tables, lens, softmax_scale, kind, d_latent, validate=False,
                   out=out.view(bsz * groups, 1, per, d_out), lse=lse.view(bsz * groups, 1, per), head_groups=1,
                   **options)
        return out, lse
    o, l = mla_decode(grouped_q, kv_data, kv_scales, tables, lens, softmax_scale, kind, d_latent, validate=False,
                      head_groups=1, **options)
    out.view(bsz, s_q, groups, per, d_out).copy_(o.view(bsz, groups, s_q, per, d_out).transpose(1, 2))
    lse.view(bsz, s_q, groups, per).copy_(l.view(bsz, groups, s_q, per).transpose(1, 2))
    return out, lse


def plan_head_groups(q: torch.Tensor, kv_data: torch.Tensor, kind: str, d_latent: int, config: dict | None = None,
                     fp8_dequant: str = "auto") -> int:
    """What ``head_groups="auto"`` runs for a call with q [B, S, H, D]: ``H / GROUP_ROWS`` groups when S is 1, H a
    multiple of ``GROUP_ROWS`` above it, no ``config`` and, for one group's query, the 16-row kernel can run: the
    Gluon kernel for fp8 pages (:func:`gluon_fits`; ``fp8_dequant`` "auto" or "gluon") or, for bf16 pages on a Hopper
    GPU and B ≤ ``HEAD_GROUPS_MAX_BATCH_BF16``, ``TMA_CONFIG`` (:func:`takes_tma_launch`); else 1."""
    bsz, s_q, heads, _ = q.shape
    if s_q != 1 or heads <= GROUP_ROWS or heads % GROUP_ROWS or config is not None:
        return 1
    one_group = q[:, :, :GROUP_ROWS]
    if kind == "bf16":
        fits = bsz <= HEAD_GROUPS_MAX_BATCH_BF16 and _hopper_gpu(q) \
            and _tma_launch(one_group, kv_data, kind, False) is not None
    else:
        fits = fp8_dequant in ("auto", "gluon") and gluon_fits(one_group, kv_data, kind, d_latent) is None
    return heads // GROUP_ROWS if fits else 1


def _hopper_gpu(q: torch.Tensor) -> bool:
    """Whether q lives on a Hopper GPU that runs compiled kernels (not the interpreter)."""
    return not triton_interpreted() and _is_hopper(q.device)


def _auto_fp8_dequant(kind: str, q: torch.Tensor, kv_data: torch.Tensor, batch: int, max_len: int,
                      d_latent: int = 512) -> str:
    """What ``fp8_dequant="auto"`` runs for one call (see :func:`mla_decode`): q [B, S, H, D], ``batch`` requests of
    at most ``max_len`` cached tokens."""
    if gluon_fits(q, kv_data, kind, d_latent) is None:
        return "gluon"
    if kind != "fp8_e4m3":
        return "convert"
    if _tma_launch(q, kv_data, kind, fp8_bitcast=True) is not None:
        return "bitcast"
    if q.dtype != torch.float32 and batch * max_len >= FP8_MMA_MIN_TOKENS:
        return "fp8mma"
    return "bitcast" if q.shape[1] * q.shape[2] >= BITCAST_MIN_ROWS and _word_aligned(kv_data) else "convert"


def tuned_config() -> str | None:
    """The configuration the autotuner used for the last tuned launch, e.g. ``"m16n32w4s2p"`` (BLOCK_M 16,
    BLOCK_N 32, 4 warps, 2 stages; ``t``: QK_SPLIT_LOAD, ``p``: PREFETCH), None before any (benchmarks)."""
    from .kernel import _mla_decode_kernel_tuned

    c = getattr(_mla_decode_kernel_tuned, "best_config", None)
    return None if c is None else _config_name({**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages})


def _config_name(kw: dict) -> str:
    return (f"m{kw['BLOCK_M']}n{kw['BLOCK_N']}w{kw.get('num_warps', 4)}s{kw.get('num_stages', 3)}"
            + ("t" if kw["QK_SPLIT_LOAD"] else "") + ("p" if kw.get("PREFETCH") else "")
            + ("-tma" if kw.get("TMA") else ""))


_LAST_LAUNCH: tuple[int, str | None] | None = None
# diagnostics (benchmarks/probe_mla_fixed.py): an int64 CUDA tensor here makes the Triton decode kernel store each
# program's timeline into it (16 values per program: kernel.py, ``PROBE``); None (default) compiles no probe
PROBE_BUFFER: torch.Tensor | None = None


def last_launch() -> tuple[int, str | None] | None:
    """(KV splits, kernel configuration) of the last Triton launch of :func:`mla_decode`, e.g. ``(2,
    "m16n64w8s3-tma")`` for ``TMA_CONFIG`` (``-tma``: whole tiles through TMA descriptors); None before any
    (benchmarks log it per row)."""
    return _LAST_LAUNCH


def _checked_splits(num_splits, q, block_table, page_size, max_seq_len, sms, plan) -> int:
    """``num_splits`` as given (checked against ``MAX_SPLITS``) or, when None, ``plan(batch, s_q, heads, max_len,
    sms)`` for the call (``max_len``: ``max_seq_len`` or the block table's capacity; ``sms`` None: the device's SM
    count)."""
    if num_splits is None:
        bsz, s_q, heads, _ = q.shape
        max_len = max_seq_len if max_seq_len is not None else block_table.shape[1] * page_size
        sms = sms or torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = plan(bsz, s_q, heads, max_len, sms)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: {num_splits} not in [1, {MAX_SPLITS}]")
    return num_splits


def _split_outputs(num_splits, bsz, m_rows, d_latent, out, lse):
    """Where a decode kernel writes: the final ``out`` / ``lse`` with one split, else the partials for
    :func:`combine_splits` (o [B, splits, M, d_latent] in ``PARTIAL_DTYPE``, lse fp32 [B, splits, M])."""
    if num_splits == 1:
        return out, lse
    return (torch.empty(bsz, num_splits, m_rows, d_latent, dtype=PARTIAL_DTYPE, device=out.device),
            torch.empty(bsz, num_splits, m_rows, dtype=torch.float32, device=out.device))


def _mla_decode_triton(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind, d_latent,
                       num_splits, max_seq_len, out, lse, config, fp8_bitcast, f16_dots, fp8_mma=0, combine="auto"):
    from .kernel import _mla_decode_kernel, _mla_decode_kernel_tuned

    bsz, s_q, heads, d = q.shape
    page_size = kv_data.shape[1]
    m_rows = s_q * heads
    if bsz == 0 or m_rows == 0:
        return out, lse
    interpreted = triton_interpreted()
    tma_launch = None if config is not None or interpreted else _tma_launch(q, kv_data, kind, fp8_bitcast)
    if tma_launch is not None:
        config = tma_launch[0]
    per_sm = tma_launch[1] if tma_launch is not None else None
    num_splits = _checked_splits(
        num_splits, q, block_table, page_size, max_seq_len, 4 if interpreted else None,
        lambda b, s, h, n, sms: plan_num_splits(b, s, h, n, kind, d_latent, d - d_latent, sms, per_sm=per_sm))

    lat, rope, sc, (sc_page, sc_row) = _page_views(kv_data, kv_scales, kind, d_latent)
    if fp8_bitcast and not _word_aligned(kv_data):
        raise ValueError("kv_data: fp8_dequant='bitcast' reads 4-byte words: pages must be 4-byte aligned "
                         "(row stride, page stride, offset)")
    split = num_splits > 1
    o_dst, lse_dst = _split_outputs(num_splits, bsz, m_rows, d_latent, out, lse)
    descs = (None, None)
    if config is not None and config.get("TMA"):
        descs = _page_descriptors(kv_data, kind, d_latent, config["BLOCK_N"], words=fp8_bitcast)
        config = {**config, "TMA": descs[0] is not None}
    args = (q, lat, rope, sc, block_table, seq_lens, o_dst, lse_dst, *descs,
            softmax_scale * math.log2(math.e), s_q, heads, num_splits,
            q.stride(0), q.stride(1), q.stride(2),
            lat.stride(0), lat.stride(1), rope.stride(0), rope.stride(1), sc_page, sc_row,
            block_table.stride(0))
    meta = dict(D_LAT=d_latent, D_ROPE=d - d_latent, PAGE_SIZE=page_size, SCALE_MODE=_scale_mode(kind, kv_scales),
                TILE=DS_MLA_TILE, SPLIT_OUT=split, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                INTERPRET=interpreted, FP8_BITCAST=fp8_bitcast, F16_DOTS=f16_dots, FP8_MMA=fp8_mma,
                **pdl_launch(q.device, "mla_decode"))
    if PROBE_BUFFER is not None and not interpreted:  # diagnostics: each program's timeline (kernel.py, PROBE)
        if config is None:
            raise ValueError("PROBE_BUFFER: the timeline needs a launch of known tiles (TMA_CONFIG or a config)")
        grid_size = cdiv(m_rows, config["BLOCK_M"]) * num_splits * bsz
        if PROBE_BUFFER.numel() < 16 * grid_size or PROBE_BUFFER.dtype != torch.int64:
            raise ValueError(f"PROBE_BUFFER: needs ≥ {16 * grid_size} int64 values for this launch")
        meta.update(PROBE=True, probe_ptr=PROBE_BUFFER)

    def grid(m):
        return (cdiv(m_rows, m["BLOCK_M"]), num_splits, bsz)

    if config is None and interpreted:
        config = dict(BLOCK_M=_block_m(m_rows), BLOCK_N=16, QK_SPLIT_LOAD=False)
    global _LAST_LAUNCH
    if config is not None:
        _check_config(config)
        _mla_decode_kernel[grid](*args, **meta, **config)
        _LAST_LAUNCH = (num_splits, _config_name(config))
    else:
        _mla_decode_kernel_tuned[grid](*args, **meta)
        _LAST_LAUNCH = (num_splits, tuned_config())
    if split:
        combine_splits(o_dst, lse_dst, out, lse, combine)
    return out, lse


# fp8_dequant="gluon" (kernel_gluon.py): 64-token tiles, a ring of GLUON_STAGES TMA slots (37 KB each)
GLUON_BLOCK_N, GLUON_STAGES, GLUON_WARPS = 64, 2, 4
# a TMA warp issues the copies (warp specialization) instead of the attention warps: H200, 16 heads (session 18,
# interleaved CUDA-graph rounds, scratch sweep): 812.7 against 878.6 µs at batch 64 x 64k, 79.1 / 80.5 at 64 x 4k,
# 57.8 / 58.9 at 32 x 4k, 23.2 / 23.9 at 1 x 4k, 54.8 / 54.5 at 1 x 64k
GLUON_WS = True
# WS: registers per thread at launch (the TMA warp's group of 4 keeps 48, the attention warps get the rest: 208), so
# that two programs share an SM
GLUON_WS_MAXNREG = 128
# the score dot as S^T = K·q^T (tokens on M, q^T read in place as the B operand, no register shuffles for q): fewer
# instructions (sm_90 static count of the WS loop 1403 -> 1320 per warp and 64-token tile) but slower on the H200
# (session 18, interleaved rounds: 878.4 against 814.4 µs at batch 64 x 64k, 82.2 / 79.1 at 64 x 4k; the scores'
# transposition is one more trip through shared memory and a barrier per tile), so off
GLUON_SWAP_QK = False
# q in shared memory with each lane's score-dot A fragment as 16 contiguous bytes in mma.sync's register order
# (kernel_gluon.q_fragment_layout) instead of the 128-byte-swizzled row layout: one LDS.128 per fragment and no
# register moves (sm_90 static count 1383 -> 1133 instructions per warp and tile). H200, 16 heads, interleaved
# rounds (session 19, call 7), µs row / fragment layout: 64 x 64k 746.0 / 660.9, 128 x 4k 111.4 / 98.6, 64 x 4k
# 65.7 / 60.2, 8 x 16k 45.1 / 41.3, 32 x 4k 44.8 / 41.6, 1 x 64k 33.8 / 31.7, 1 x 4k 16.6 / 15.8
GLUON_Q_FRAG = True
# P' likewise staged per tile in a fragment-ordered buffer (2 KB) for the PV dot instead of Gluon's layout conversion,
# whose loads ptxas reorders with ~130 register moves: sm_90 static count 1133 -> 997 per warp and tile. H200, 16
# heads, interleaved rounds (session 20, call 1), µs conversion / buffer: 128 x 4k 98.7 / 96.4, 32 x 4k 41.6 / 40.5,
# 8 x 16k 41.6 / 40.9, 16 x 8k 42.5 / 41.9, 64 x 4k 60.0 / 59.1, 1 x 4k 16.4 / 16.0, 1 x 64k 31.9 / 31.1 (64 x 64k
# 643 / 653, within that shape's noise)
GLUON_P_FRAG = True


def gluon_fits(q: torch.Tensor, kv_data: torch.Tensor, kind: str, d_latent: int) -> str | None:
    """Why ``fp8_dequant="gluon"`` cannot run this call (None: it can): fp8_e4m3 or fp8_ds_mla pages of 512 + 64
    values that TMA reads in 64-token tiles, 16-bit queries (bf16 for fp8_ds_mla, whose rope dot runs in bf16), at
    most 16 query rows per request, a Hopper GPU with Gluon."""
    if kind not in ("fp8_e4m3", "fp8_ds_mla"):
        return f"kind {kind!r} (the kernel reads fp8_e4m3 and fp8_ds_mla pages)"
    if q.dtype not in (torch.bfloat16, torch.float16) or kind == "fp8_ds_mla" and q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} ({'bf16' if kind == 'fp8_ds_mla' else 'bf16 or fp16'})"
    if q.shape[1] * q.shape[2] > 16:
        return f"{q.shape[1] * q.shape[2]} query rows per request (at most 16)"
    if d_latent != 512 or q.shape[3] != 576:
        return f"rows of {d_latent} + {q.shape[3] - d_latent} values (512 + 64)"
    if not _tma_rows(kv_data, "fp8_e4m3", GLUON_BLOCK_N):  # (the same alignment rules for ds_mla's byte rows)
        return ("pages TMA cannot read in 64-token tiles (page size a multiple of 64, contiguous pages, 16-byte "
                "aligned rows)")
    if not _hopper_gpu(q) or not _gluon_available():
        return "no Hopper GPU with Triton's Gluon (the interpreter cannot run it)"
    return None


def _mla_decode_gluon(q, kv_data, kv_scales, block_table, seq_lens, softmax_scale, kind, d_latent, num_splits,
                      max_seq_len, out, lse, combine):
    """The Gluon kernel (kernel_gluon.py) for :func:`mla_decode` with ``fp8_dequant="gluon"``."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .kernel_gluon import _mla_decode_fp8_gluon_kernel

    why = gluon_fits(q, kv_data, kind, d_latent)
    if why is not None:
        raise ValueError(f"fp8_dequant='gluon' cannot run: {why}")
    bsz, s_q, heads, d = q.shape
    page_size = kv_data.shape[1]
    m_rows = s_q * heads
    if bsz == 0 or m_rows == 0:
        return out, lse
    num_splits = _checked_splits(num_splits, q, block_table, page_size, max_seq_len, None,
                                 lambda b, s, h, n, sms: plan_gluon_splits(b, s, h, n, d_latent, d - d_latent, sms))
    split = num_splits > 1
    o_dst, lse_dst = _split_outputs(num_splits, bsz, m_rows, d_latent, out, lse)
    pages, _, width = kv_data.shape
    rows = kv_data.view(torch.float8_e4m3fn)
    shape, strides = [pages * page_size, width], [kv_data.stride(1), 1]
    half, d_rope = d_latent // 2, d - d_latent
    lat_desc = TensorDescriptor(rows, shape, strides, [GLUON_BLOCK_N, half],
                                gl.NVMMASharedLayout.get_default_for([GLUON_BLOCK_N, half], gl.float8e4nv))
    mode = _scale_mode(kind, kv_scales)
    warps, swap_qk = GLUON_WARPS, GLUON_SWAP_QK
    if kind == "fp8_ds_mla":  # rows of [e4m3 latent | fp32 tile scales | bf16 rope]: the rope by a bf16 descriptor
        rope_col = (d_latent + 4 * (d_latent // DS_MLA_TILE)) // 2
        rope_desc = TensorDescriptor(kv_data.view(torch.bfloat16), [pages * page_size, width // 2],
                                     [kv_data.stride(1) // 2, 1], [GLUON_BLOCK_N, d_rope],
                                     gl.NVMMASharedLayout.get_default_for([GLUON_BLOCK_N, d_rope], gl.bfloat16))
        _, _, scales, sc_strides = _page_views(kv_data, kv_scales, kind, d_latent)
        warps, swap_qk = 4, False  # (one output accumulator per latent tile; the scores not transposed)
    else:
        rope_col = d_latent
        rope_desc = TensorDescriptor(rows, shape, strides, [GLUON_BLOCK_N, d_rope],
                                     gl.NVMMASharedLayout.get_default_for([GLUON_BLOCK_N, d_rope], gl.float8e4nv))
        scales = kv_scales
        sc_strides = (kv_scales.stride(0), kv_scales.stride(1)) if mode == 1 else (0, 0)
    _mla_decode_fp8_gluon_kernel[(num_splits, bsz)](
        q, lat_desc, rope_desc, scales, block_table, seq_lens, o_dst, lse_dst,
        softmax_scale * math.log2(math.e), s_q, heads, num_splits, q.stride(0), q.stride(1), q.stride(2),
        *sc_strides, block_table.stride(0),
        D_LAT=d_latent, D_ROPE=d - d_latent, PAGE_SIZE=page_size, SCALE_MODE=mode, SPLIT_OUT=split,
        BLOCK_N=GLUON_BLOCK_N, STAGES=GLUON_STAGES,
        WS=GLUON_WS, SWAP_QK=swap_qk, Q_FRAG=GLUON_Q_FRAG,
        P_FRAG=GLUON_P_FRAG, ROPE_COL=rope_col, num_warps=warps,
        **({"maxnreg": GLUON_WS_MAXNREG} if GLUON_WS else {}))
    global _LAST_LAUNCH
    _LAST_LAUNCH = (num_splits, f"gluon-n{GLUON_BLOCK_N}w{warps}s{GLUON_STAGES}" + ("-ws" if GLUON_WS else ""))
    if split:
        combine_splits(o_dst, lse_dst, out, lse, combine)
    return out, lse


# programs per SM the split plan assumes: two (96 KB of shared memory each), or GLUON_PER_SM_SHORT (one) where the
# splits of two would be short (< GLUON_SPLIT_TILES tiles) and one needs fewer dependent merge steps
# (_merge_steps): H200, 16 heads, interleaved CUDA-graph rounds, session 19 (results/sweep_mla_gluon_h200.json),
# µs planned for two / one per SM (splits): 8 x 16k 45.0 / 48.9 (29 / 15: one merge step each), 16 x 8k 46.0 / 45.9
# (15 / 8), 32 x 4k 47.8 / 44.7 (7 / 4: the row merge walks them), 1 x 64k 34.2 / 33.5 (218 / 113); from 16 tiles per
# split on, the same splits or two per SM: 64 x 64k 772 / 948, 128 x 4k 122 / 131, 64 x 4k 77.5 / 80.9 (session 19,
# call 1, before the coalesced output stores).
GLUON_PER_SM, GLUON_PER_SM_SHORT, GLUON_SPLIT_TILES = 2, 1, 16


def _merge_steps(num_splits: int) -> int:
    """Dependent load steps of :func:`combine_splits` ("auto") for ``num_splits`` splits: none for one, one per split
    for the row merge, one per ``COMBINE_CHUNK`` splits for the tiles merge."""
    if num_splits == 1:
        return 0
    return num_splits if num_splits <= ROWS_MAX_SPLITS else cdiv(num_splits, COMBINE_CHUNK)


def plan_gluon_splits(batch: int, s_q: int, heads: int, max_len: int, d_latent: int, d_rope: int,
                      num_sms: int) -> int:
    """The Gluon launcher's KV-split count: :func:`plan_num_splits` for ``GLUON_PER_SM`` programs per SM, or for
    ``GLUON_PER_SM_SHORT`` where that plan's splits would read fewer than ``GLUON_SPLIT_TILES`` tiles and the
    shorter plan merges in fewer dependent steps (:func:`_merge_steps`)."""
    def plan(per_sm):
        return plan_num_splits(batch, s_q, heads, max_len, "fp8_e4m3", d_latent, d_rope, num_sms, per_sm=per_sm)

    two = plan(GLUON_PER_SM)
    if cdiv(max_len, two * GLUON_BLOCK_N) < GLUON_SPLIT_TILES:
        short = plan(GLUON_PER_SM_SHORT)
        if _merge_steps(short) < _merge_steps(two):
            return short
    return two


def takes_tma_launch(q: torch.Tensor, kv_data: torch.Tensor, kind: str, fp8_bitcast: bool = False) -> bool:
    """Whether a launch without ``config`` on the GPU runs a TMA configuration instead of the autotuner:
    ``TMA_CONFIG`` for bf16 pages TMA can read in 64-token tiles (:func:`_tma_rows`), ``FP8_TMA_CONFIG`` for
    fp8_e4m3 pages read by the bitcast (``fp8_bitcast``) whose int32 words TMA can read in 32-token tiles; both with
    bf16 queries (fp32 queries would need 324 KB of shared memory; fp16 ones were not timed), at most 16 query rows
    per request and rows of at most 576 values (TMA_CONFIG's 164 KB of shared memory at 512 + 64)."""
    return _tma_launch(q, kv_data, kind, fp8_bitcast) is not None


def _tma_launch(q: torch.Tensor, kv_data: torch.Tensor, kind: str, fp8_bitcast: bool) -> tuple[dict, int] | None:
    """(configuration, programs per SM for the split plan) of :func:`takes_tma_launch`'s TMA launch, or None."""
    if not TMA_LAUNCH or q.dtype != torch.bfloat16 or q.shape[1] * q.shape[2] > 16 or q.shape[3] > 576:
        return None
    if kind == "bf16" and _tma_rows(kv_data, kind, TMA_CONFIG["BLOCK_N"]):
        return TMA_CONFIG, 1
    if kind == "fp8_e4m3" and fp8_bitcast and kv_data.shape[-1] % 4 == 0 and _tma_rows(
            kv_data, kind, FP8_TMA_CONFIG["BLOCK_N"]):
        return FP8_TMA_CONFIG, 2
    return None


def _tma_rows(kv_data: torch.Tensor, kind: str, block_n: int) -> bool:
    """Whether TMA can read the pages as tiles of ``block_n`` rows: bf16 / fp8_e4m3 pages whose page stride is
    page_size rows, 16-byte aligned rows, tiles within a page."""
    page_size = kv_data.shape[1]
    row_bytes = kv_data.stride(1) * kv_data.element_size()
    return (kind in ("bf16", "fp8_e4m3") and kv_data.stride(2) == 1 and page_size % block_n == 0
            and kv_data.stride(0) == page_size * kv_data.stride(1) and row_bytes % 16 == 0
            and kv_data.data_ptr() % 16 == 0)


def _page_descriptors(kv_data: torch.Tensor, kind: str, d_latent: int, block_n: int, words: bool = False):
    """TMA descriptors (latent, rope) over bf16 / fp8_e4m3 pages as [pages·page_size, row width] rows, blocks
    [block_n, d_latent] and [block_n, d_rope]; ``words`` (fp8_e4m3, the bitcast path): over the pages as int32
    words, blocks [block_n, d_latent / 4] and [block_n, d_rope / 4]. (None, None) where TMA cannot read them
    (:func:`_tma_rows`)."""
    if not _tma_rows(kv_data, kind, block_n) or words and (kind != "fp8_e4m3" or kv_data.shape[-1] % 4):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    pages, page_size, width = kv_data.shape
    data, unit = (kv_data.view(torch.int32), 4) if words else (kv_data, 1)
    shape, strides = [pages * page_size, width // unit], [data.stride(1), 1]
    return (TensorDescriptor(data, shape, strides, [block_n, d_latent // unit]),
            TensorDescriptor(data, shape, strides, [block_n, (width - d_latent) // unit]))


# the splits' partial outputs (their lse stay fp32): bf16 halves the bytes they move (8 MB written and read at
# 16 heads × 64 requests × 4 splits, beside 302 MB of bf16 pages at 4k) for one more rounding; a sweep setting
PARTIAL_DTYPE = torch.float32
ROWS_MAX_SPLITS = 8  # combine_splits("auto"): the row kernel up to this many splits (measured, docstring)
# the row merge's query rows per program and warps: 16 heads × 64 requests × 4 splits at 4k, 4 rows 99.34 µs for
# the whole decode against 99.86 at 8 (H200, sweep_mla_decode, interleaved rounds, 84444bd; 2 rows 99.42)
ROWS_BLOCK_R, ROWS_WARPS = 4, 4
COMBINE_CHUNK = 64  # combine_splits("tiles"): splits per load step (a sweep setting)


def combine_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   kernel: str = "auto") -> None:
    """The split-K merge (Triton): partials ``o_part`` fp32 (or bf16) [B, splits, M, D] and ``lse_part`` fp32 (log2)
    [B, splits, M] -> ``out`` [B, M, D] (any float dtype, contiguous, e.g. [B, S, H, D]) and ``lse`` (natural
    log) [B, M]. ``kernel``: ``"tiles"`` (programs over (row, request, column block), ``COMBINE_CHUNK`` splits per
    step), ``"rows"`` (programs over ``ROWS_BLOCK_R``-row blocks walking the splits one by one) or ``"auto"``: rows up
    to ``ROWS_MAX_SPLITS`` splits, tiles above (H200, 16 heads, when the tiles merge took 16 splits per step: 4 splits
    × 64 requests rows 9.5 µs / tiles 17.7; 28 splits × 1 tiles 9.5 / rows 21.8; 218 splits tiles 25.9 / rows 129)."""
    from .kernel import _mla_decode_combine_kernel, _mla_decode_combine_tiles_kernel

    bsz, num_splits, m_rows, d_latent = o_part.shape
    splits_p2 = next_power_of_2(num_splits)
    if kernel == "auto":
        kernel = "rows" if num_splits <= ROWS_MAX_SPLITS else "tiles"
    pdl = pdl_launch(o_part.device, "mla_decode_merge")
    if kernel == "rows":
        _mla_decode_combine_kernel[(cdiv(m_rows, ROWS_BLOCK_R), bsz)](
            o_part, lse_part, out, lse, m_rows, num_splits, D_LAT=d_latent, BLOCK_R=ROWS_BLOCK_R,
            SPLITS_P2=splits_p2, num_warps=ROWS_WARPS, **pdl)
        return
    if kernel != "tiles":
        raise ValueError(f"kernel: {kernel!r} not in ('auto', 'tiles', 'rows')")
    # up to COMBINE_CHUNK splits per load step (each step waits for its loads: 132 splits in steps of 16 took 8.7 µs at
    # batch 1), the columns per program narrowed to keep [chunk, columns] at 2048 values
    chunk = min(splits_p2, COMBINE_CHUNK)
    block_d = min(128, d_latent, max(16, 2048 // chunk))
    _mla_decode_combine_tiles_kernel[(m_rows, bsz, d_latent // block_d)](
        o_part, lse_part, out, lse, m_rows, num_splits, D_LAT=d_latent, BLOCK_R=1, BLOCK_D=block_d,
        SPLITS_P2=splits_p2, CHUNK_S=chunk, num_warps=4, **pdl)
