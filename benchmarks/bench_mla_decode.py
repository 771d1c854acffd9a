"""bench ``mla_decode``: absorbed MLA decode over paged latents (one layer, one query token per request).

Case keys (DESIGN.md): ``kv`` (bf16, fp8_e4m3 per token, fp8_ds_mla), ``heads`` (per GPU: 8, 16, 64, 128),
``batch`` (1–128), ``ctx`` (tokens cached per request: 1k–64k), ``page_size`` 64. Dims are Kimi K2.6 / GLM 5.2's
(512 latent + 64 rope). Every request's pages are scattered over one large pool; inputs rotate over several
block tables (distinct pages) until a pass reads more than 3× the L2 cache. Each timed call is one replay of a
CUDA graph holding one ``mla_decode`` per input set (the decode kernel and, when the context is split, the
combine kernel), so the Python launcher's overhead is not timed — as an engine runs decode.

FP8 cases also run with ``fp8_dequant="bitcast"`` (the kernel's FP8_BITCAST switch, docs/mla.md "FP8 fast
dequant"): same case keys plus ``variant: "bitcast"``, peer = the BF16 case at the same shape, and
``vs_convert`` = (convert µs) / (bitcast µs). Rows without a ``variant`` key time ``fp8_dequant="convert"``;
the library's default ``"auto"`` picks between the two by these rows (``mla_decode.BITCAST_MIN_ROWS``).

``bytes`` = the page bytes actually read (ctx rows per request, per-token scales included) + q + out;
``flops`` = 2·H·ctx·(576 + 512) per request. ``peer``: for FP8 cases the BF16 case at the same shape (same run);
for BF16 cases a torch composition (gather pages, einsum, softmax, einsum), also in a CUDA graph, skipped where
its intermediates would pass 12 GB. Extra fields: ``frac_of_copy`` (achieved TB/s over the copy ceiling of the
run), ``frac_of_matmul`` (TFLOP/s over the bf16 matmul ceiling), ``num_splits``.
"""
from __future__ import annotations

import itertools
import math
import sys

import torch

from mla_quant.formats import KVFormat
from mla_quant.kernels.mla_decode import mla_decode, plan_num_splits

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


def _input_sets(batch: int, ctx: int, heads: int, kind: str, num_pages: int, dev: str):
    """Block tables over distinct pages of the pool (and queries), enough that one pass exceeds 3× L2."""
    pages = ctx // PAGE
    case_bytes = batch * ctx * _row_bytes(kind)
    n_sets = max(1, min(16, math.ceil(3 * L2_BYTES / case_bytes), num_pages // (batch * pages)))
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


def _try_variant(kind: str, fn) -> tuple[bool, object]:
    """(True, fn()) for the fp8_dequant="bitcast" rows; if fn raises (e.g. a compile error on this Triton), the
    error is reported on stderr and (False, None) ends that variant's rows for this format instead of costing
    the default rows."""
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - any failure of the optional variant
        print(f"bench mla_decode: fp8_dequant='bitcast' failed for kv={kind}, its rows are skipped: {e!r}",
              file=sys.stderr)
        return False, None


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    heads_list, batches, contexts = ((16, 128), (1, 64), (4096, 65536)) if ctx.quick else (HEADS, BATCHES, CONTEXTS)
    num_pages = max(batches) * max(contexts) // PAGE
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cases, bf16_us = [], {}
    for kind in KINDS:
        pool, scales = _fill_pool(kind, num_pages, dev)
        _tune_on_target_shapes(pool, scales, kind, heads_list, num_pages, dev)
        bitcast = kind != "bf16"
        if bitcast:
            bitcast, _ = _try_variant(kind, lambda: _tune_on_target_shapes(pool, scales, kind, heads_list, num_pages,
                                                                           dev, fp8_dequant="bitcast"))
        for heads, batch, n in itertools.product(heads_list, batches, contexts):
            sets = _input_sets(batch, n, heads, kind, num_pages, dev)
            seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)

            def call(q, table, dequant="convert"):
                return mla_decode(q, pool, scales, table, seq_lens, SCALE, kind, D_LATENT, max_seq_len=n,
                                  validate=False, fp8_dequant=dequant)

            t = _graph_us(lambda: [call(q, tb) for q, tb in sets], len(sets))
            moved = batch * n * _row_bytes(kind) + batch * heads * (2 * (D_LATENT + D_ROPE) + 2 * D_LATENT)
            flops = 2 * batch * heads * n * (D_LATENT + D_ROPE + D_LATENT)
            if kind == "bf16":
                bf16_us[(heads, batch, n)] = t
                peer, peer_t = "torch_composition", None
                if batch * n * (2 * (D_LATENT + D_ROPE) + 6 * heads) <= PEER_BYTES_LIMIT:
                    peer_t = _graph_us(lambda: [_torch_composition(q, pool, tb, n) for q, tb in sets], len(sets))
            else:
                peer, peer_t = "mla_decode_bf16", bf16_us.get((heads, batch, n))
            tbps = moved / (t * 1e-6) / 1e12
            tflops = flops / (t * 1e-6) / 1e12
            cases.append(case(
                "mla_decode", {"kv": kind, "heads": heads, "batch": batch, "ctx": n, "page_size": PAGE}, t,
                bytes=moved, flops=flops, peer=peer, peer_median_us=peer_t,
                frac_of_copy=round(tbps / ctx.copy_tbps, 3) if ctx.copy_tbps else None,
                frac_of_matmul=round(tflops / ctx.bf16_tflops, 3) if ctx.bf16_tflops else None,
                num_splits=plan_num_splits(batch, 1, heads, n, kind, D_LATENT, D_ROPE, sms),
                input_sets=len(sets)))
            if bitcast:  # the same shape with the FP8 fast-dequant switch, side by side
                bitcast, t_bc = _try_variant(kind, lambda: _graph_us(
                    lambda: [call(q, tb, "bitcast") for q, tb in sets], len(sets)))
            if bitcast:
                cases.append(case(
                    "mla_decode", {"kv": kind, "heads": heads, "batch": batch, "ctx": n, "page_size": PAGE,
                                   "variant": "bitcast"}, t_bc,
                    bytes=moved, flops=flops, peer=peer, peer_median_us=peer_t,
                    frac_of_copy=round(moved / (t_bc * 1e-6) / 1e12 / ctx.copy_tbps, 3) if ctx.copy_tbps else None,
                    frac_of_matmul=round(flops / (t_bc * 1e-6) / 1e12 / ctx.bf16_tflops, 3) if ctx.bf16_tflops else None,
                    num_splits=plan_num_splits(batch, 1, heads, n, kind, D_LATENT, D_ROPE, sms),
                    input_sets=len(sets), vs_convert=round(t / t_bc, 3)))
            del sets
        del pool, scales
        torch.cuda.empty_cache()
    return cases

