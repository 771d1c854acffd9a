"""bench ``mla_decode``: absorbed MLA decode over paged latents (one layer, one query token per request).

Case keys (DESIGN.md): ``kv`` (bf16, fp8_e4m3 per token, fp8_ds_mla), ``heads`` (per GPU: 8, 16, 64, 128),
``batch`` (1–128), ``ctx`` (tokens cached per request: 1k–64k), ``page_size`` 64. Dims are Kimi K2.6 / GLM 5.2's
(512 latent + 64 rope). Every request's pages are scattered over one large pool; inputs rotate over several
block tables (distinct pages) until a pass reads more than 3× the L2 cache. Each timed call is one replay of a
CUDA graph holding one ``mla_decode`` per input set (the decode kernel and, when the context is split, the
combine kernel), so the Python launcher's overhead is not timed — as an engine runs decode.

FP8 cases also run with the other FP8 dequantizations (docs/mla.md): ``variant: "gluon"`` (both formats on Hopper: the
Gluon kernel "auto" takes there; above 16 heads in head groups of 16, ``head_groups="auto"``), ``variant: "fp16"``
(fp8_dequant="fp16": fp16 dot operands, its candidates with and without the register prefetch) for both FP8 formats,
and ``variant: "bitcast"`` for fp8_e4m3 (fp8_ds_mla's bitcast measured 0.55-1.0x the conversion and is no longer
timed), and ``"fp8mma"`` / ``"fp8mma_pv"`` / ``"fp8mma_pv_q1"`` for fp8_e4m3 (e4m3 tensor-core score dots, q rounded
to e4m3 in two terms or one; PV in fp16 or e4m3 — lossier, docs/mla.md "fp8 tensor-core dots"; the two e4m3-PV ones
not under ``--quick``); peer = the BF16 case at the same shape, ``vs_convert`` = (convert µs) / (variant µs). Rows
without a ``variant`` key time ``fp8_dequant="convert"``; the default ``"auto"`` picks by these rows
(``mla_decode.BITCAST_MIN_ROWS``).
BF16 rows run ``head_groups="auto"`` (16-head groups above 16 heads on Hopper, docs/mla.md "Head groups"); where
that groups, ``variant: "head_groups=1"`` times the ungrouped call (the default before session 31; ``vs_grouped`` =
grouped µs / ungrouped µs). Every row logs the launch's ``config`` and ``num_splits`` (``mla_decode.last_launch()``,
e.g. ``m16n32w8s2p``, or ``m16n64w8s3-tma`` for the bf16 TMA launch).
BF16 rows at 16 heads, batch ≥ 32 and 4k also run forced split counts (``variant: "splits=N"``, N ≠ the
launcher's ``num_splits``), to see whether the split rule costs the short contexts their bandwidth; there and at
batch 1, ``variant: "combine_only_tiles"`` / ``"combine_only_rows"`` rows time the split merge kernels alone
(``share_of_decode`` = its µs over the whole decode's; "tiles" is the launcher's merge since this commit, "rows"
the first one — compare the batch-1 rows, 28–218 splits, with the previous results file as well). (Rows with
``variant: "combine=fused"`` / ``"kept_counters"`` in the results file time a merge in the decode kernel's
epilogue that was measured no faster and removed: docs/mla.md.) ``MLA_DECODE_KV=bf16`` (comma-separated formats) times only those formats, for a focused run.

``bytes`` = the page bytes actually read (ctx rows per request, per-token scales included) + q + out;
``flops`` = 2·H·ctx·(576 + 512) per request. ``peer``: for FP8 cases the BF16 case at the same shape (same run);
for BF16 cases a torch composition (gather pages, einsum, softmax, einsum), also in a CUDA graph, skipped where
its intermediates would pass 12 GB. Extra fields: ``frac_of_copy`` (achieved TB/s over the copy ceiling of the
run), ``frac_of_matmul`` (TFLOP/s over the bf16 matmul ceiling), ``num_splits``.
"""
from __future__ import annotations

import itertools
import math
import os
import sys

import torch

from mla_quant.formats import KVFormat
from mla_quant.kernels.mla_decode import combine_splits, gluon_fits, last_launch, mla_decode, plan_head_groups

from .common import L2_BYTES, Context, case, graph_us, random_kv_pool

KINDS = ("bf16", "fp8_e4m3", "fp8_ds_mla")
HEADS = (8, 16, 64, 128)
BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (1024, 4096, 16384, 65536)
PAGE = 64
D_LATENT, D_ROPE = 512, 64
SCALE = 0.1447            # Kimi K2.6 (192^-0.5 · mscale²)
PEER_BYTES_LIMIT = 12e9   # skip the torch composition where its gathered KV + scores would pass this


def _fill_pool(kind: str, num_pages: int, dev: str):
    return random_kv_pool(kind, num_pages, PAGE, D_LATENT, D_ROPE, dev)


def _row_bytes(kind: str) -> int:
    return KVFormat(kind).bytes_per_token(D_LATENT, D_ROPE)


def rotation_sets(batch: int, ctx: int, kind: str) -> int:
    """Input sets a timed graph rotates over so that one pass reads more than 3× L2 (at most 16)."""
    return max(1, min(16, math.ceil(3 * L2_BYTES / (batch * ctx * _row_bytes(kind)))))


def _input_sets(batch: int, ctx: int, heads: int, kind: str, num_pages: int, dev: str, n_sets: int | None = None):
    """Block tables over distinct pages of the pool (and queries): ``n_sets`` of them, by default enough that one
    pass exceeds 3× L2 (:func:`rotation_sets`), at most as many as the pool holds."""
    pages = ctx // PAGE
    n_sets = max(1, min(n_sets or rotation_sets(batch, ctx, kind), num_pages // (batch * pages)))
    perm = torch.randperm(num_pages, device=dev).to(torch.int32)
    sets = []
    for i in range(n_sets):
        table = perm[i * batch * pages:(i + 1) * batch * pages].reshape(batch, pages).contiguous()
        q = torch.randn(batch, 1, heads, D_LATENT + D_ROPE, device=dev, dtype=torch.bfloat16)
        sets.append((q, table))
    return sets


def _graph_us(fn, reps: int) -> float:
    """Median µs of one of ``reps`` calls replayed from a CUDA graph (eager if capture fails)."""
    return graph_us(fn, reps)[0]


def _torch_composition(q, pool, table, ctx):
    """The peer: gather each request's pages, then einsum / softmax / einsum (bf16, fp32 softmax)."""
    b = q.shape[0]
    kv = pool[table.long()].reshape(b, ctx, D_LATENT + D_ROPE)
    scores = torch.einsum("bshd,bnd->bshn", q, kv).float() * SCALE
    p = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    return torch.einsum("bshn,bnc->bshc", p, kv[..., :D_LATENT])


def _tune_on_target_shapes(pool, scales, kind, heads_list, num_pages, dev, fp8_dequant="convert") -> None:
    """The autotuner keeps the config it finds on the first call of a key (format, heads, split or not): make
    that call at the shapes the goals are about (64 × 4k split, 8 × 16k split; 256 × 4k runs unsplit), not at
    the first, smallest case of the grid."""
    for heads in heads_list:
        for batch, n in ((64, 4096), (8, 16384), (256, 4096)):
            if batch * n // PAGE > num_pages:
                continue
            (q, table), = _input_sets(batch, n, heads, kind, batch * n // PAGE, dev)
            seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
            mla_decode(q, pool, scales, table, seq_lens, SCALE, kind, D_LATENT, max_seq_len=n, validate=False,
                       fp8_dequant=fp8_dequant)
    torch.cuda.synchronize()


def _try_variant(kind: str, variant: str, fn) -> tuple[bool, object]:
    """(True, fn()) for an optional variant's rows; if fn raises (e.g. a compile error on this Triton), the
    error is reported on stderr and (False, None) ends that variant's rows for this format instead of costing
    the default rows."""
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - any failure of the optional variant
        print(f"bench mla_decode: variant {variant!r} failed for kv={kind}, its rows are skipped: {e!r}",
              file=sys.stderr)
        return False, None


def _variants(kind: str, quick: bool = False) -> list[str]:
    """The fp8_dequant values timed besides "convert" for a KV format. ``quick`` leaves out the e4m3 PV dots
    (fp8mma_pv, fp8mma_pv_q1: 2-8x slower in every run since 71d17aa), each one more autotuning per shape: a
    quick run outlasted a 495 s GPU stage twice in session 5, beside test workers."""
    slow = ("fp8mma_pv", "fp8mma_pv_q1") if quick else ()
    return [v for v in {"bf16": [], "fp8_e4m3": ["gluon", "bitcast", "fp16", "fp8mma", "fp8mma_pv", "fp8mma_pv_q1"],
                        "fp8_ds_mla": ["gluon", "fp16"]}[kind] if v not in slow]


def _kinds() -> tuple[str, ...]:
    """The KV formats to time: all of KINDS, or those named in ``MLA_DECODE_KV`` (comma-separated) for a focused
    run (the BF16 rows are the FP8 rows' peer, so an FP8 format alone has no peer)."""
    names = tuple(k for k in os.environ.get("MLA_DECODE_KV", "").split(",") if k)
    unknown = set(names) - set(KINDS)
    if unknown:
        raise ValueError(f"MLA_DECODE_KV: {sorted(unknown)} not in {KINDS}")
    return names or KINDS


SPLIT_VARIANTS = (2, 8, 16)  # forced split counts for the BF16 short-context rows


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    heads_list, batches, contexts = ((16, 128), (1, 64), (4096, 65536)) if ctx.quick else (HEADS, BATCHES, CONTEXTS)
    num_pages = max(batches) * max(contexts) // PAGE
    cases, bf16_us = [], {}
    for kind in _kinds():
        pool, scales = _fill_pool(kind, num_pages, dev)
        _tune_on_target_shapes(pool, scales, kind, heads_list, num_pages, dev)
        live = {}
        for variant in _variants(kind, ctx.quick):  # (the Gluon kernel has no autotuner, and only 16-row shapes)
            live[variant], _ = (True, None) if variant == "gluon" else _try_variant(
                kind, variant, lambda: _tune_on_target_shapes(pool, scales, kind, heads_list, num_pages, dev,
                                                              fp8_dequant=variant))
        for heads, batch, n in itertools.product(heads_list, batches, contexts):
            sets = _input_sets(batch, n, heads, kind, num_pages, dev)
            seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
            moved = batch * n * _row_bytes(kind) + batch * heads * (2 * (D_LATENT + D_ROPE) + 2 * D_LATENT)
            flops = 2 * batch * heads * n * (D_LATENT + D_ROPE + D_LATENT)
            keys = {"kv": kind, "heads": heads, "batch": batch, "ctx": n, "page_size": PAGE}

            def call(q, table, dequant="convert", num_splits=None, head_groups="auto"):
                return mla_decode(q, pool, scales, table, seq_lens, SCALE, kind, D_LATENT, max_seq_len=n,
                                  validate=False, fp8_dequant=dequant, num_splits=num_splits, head_groups=head_groups)

            def row(extra_keys, t, peer, peer_t, **fields):
                return case("mla_decode", {**keys, **extra_keys}, t, bytes=moved, flops=flops, peer=peer,
                            peer_median_us=peer_t,
                            frac_of_copy=round(moved / (t * 1e-6) / 1e12 / ctx.copy_tbps, 3) if ctx.copy_tbps else None,
                            frac_of_matmul=(round(flops / (t * 1e-6) / 1e12 / ctx.bf16_tflops, 3)
                                            if ctx.bf16_tflops else None),
                            input_sets=len(sets), **fields)

            t = _graph_us(lambda: [call(q, tb) for q, tb in sets], len(sets))
            splits, config = last_launch()  # the launcher's split count and kernel configuration
            if kind == "bf16":
                bf16_us[(heads, batch, n)] = t
                peer, peer_t = "torch_composition", None
                if batch * n * (2 * (D_LATENT + D_ROPE) + 6 * heads) <= PEER_BYTES_LIMIT:
                    peer_t = _graph_us(lambda: [_torch_composition(q, pool, tb, n) for q, tb in sets], len(sets))
            else:
                peer, peer_t = "mla_decode_bf16", bf16_us.get((heads, batch, n))
            cases.append(row({}, t, peer, peer_t, num_splits=splits, config=config))
            for variant in _variants(kind, ctx.quick):  # the same shape with the other dequantizations, side by side
                q0 = sets[0][0]
                if variant == "gluon" and gluon_fits(q0, pool, kind, D_LATENT) is not None \
                        and plan_head_groups(q0, pool, kind, D_LATENT, fp8_dequant="gluon") == 1:
                    continue  # (no Hopper GPU with Gluon, or more than 16 heads that do not split into groups of 16)
                if live[variant]:
                    live[variant], t_v = _try_variant(kind, variant, lambda: _graph_us(
                        lambda: [call(q, tb, variant) for q, tb in sets], len(sets)))
                if live[variant]:
                    v_splits, v_config = last_launch()
                    cases.append(row({"variant": variant}, t_v, peer, peer_t, num_splits=v_splits, config=v_config,
                                     vs_convert=round(t / t_v, 3)))
            if kind == "bf16" and plan_head_groups(sets[0][0], pool, kind, D_LATENT) > 1:  # the default before
                t_1 = _graph_us(lambda: [call(q, tb, head_groups=1) for q, tb in sets], len(sets))
                cases.append(row({"variant": "head_groups=1"}, t_1, peer, peer_t, num_splits=last_launch()[0],
                                 config=last_launch()[1], vs_grouped=round(t / t_1, 3)))
            short = batch >= 32 and n == 4096  # the short-context bandwidth goal's rows
            if kind == "bf16" and heads <= 16 and (short or batch == 1):
                if splits > 1:  # the merge kernel alone, on partials of this shape (fp32, as the kernel writes)
                    o_part = torch.randn(batch, splits, heads, D_LATENT, device=dev)
                    lse_part = torch.randn(batch, splits, heads, device=dev)
                    o_fin = torch.empty(batch, heads, D_LATENT, device=dev, dtype=torch.bfloat16)
                    lse_fin = torch.empty(batch, heads, device=dev)
                    part_bytes = o_part.numel() * 4 + lse_part.numel() * 4 + o_fin.numel() * 2 + lse_fin.numel() * 4
                    for merge in ("tiles", "rows"):
                        t_c = _graph_us(lambda: combine_splits(o_part, lse_part, o_fin, lse_fin, kernel=merge), 1)
                        cases.append(case("mla_decode", {**keys, "variant": f"combine_only_{merge}"}, t_c,
                                          bytes=part_bytes, num_splits=splits, share_of_decode=round(t_c / t, 3)))
                    del o_part, lse_part, o_fin, lse_fin
                for forced in (f for f in SPLIT_VARIANTS if f != splits and short):
                    t_s = _graph_us(lambda: [call(q, tb, num_splits=forced) for q, tb in sets], len(sets))
                    cases.append(row({"variant": f"splits={forced}"}, t_s, peer, peer_t, num_splits=forced,
                                     config=last_launch()[1], vs_planned=round(t / t_s, 3)))
            del sets
        del pool, scales
        torch.cuda.empty_cache()
    return cases
