"""bench ``page_tag_verify``: the per-step page-tag check against one decode step's attention.

Case keys: ``batch`` (1–256), ``ctx`` (1k–64k tokens per request), ``page_size`` 64. The verify is timed as
``PageTagTracker.verify_batch`` runs it on a decode step: every request's pages (shuffled over the pool) against
their recorded tags, plus the step's write slots and the holder counts. ``peer_median_us`` is 61 × the
``mla_decode`` time of one layer at the same batch and context (16 heads per GPU, bf16 pages: Kimi K2.6's
61 layers at TP8), so ``median_us / peer_median_us`` is the fraction of a step's attention spent verifying
(goal ≤ 0.5%; Cloudflare's < 1%). ``bytes`` = table, recorded tags and gathered page tags read once.
"""
from __future__ import annotations

import math

import torch

from mla_quant.kernels.page_tag_verify import page_tag_verify

from .common import Context, case, median_us

BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (1024, 4096, 16384, 65536)
PAGE = 64
LAYERS = 61          # Kimi K2.6
HEADS = 16           # heads per GPU of the peer, as the issue sets it
SOFTMAX_SCALE = 0.1447


def _decode_step_inputs(batch: int, ctx: int, dev: str):
    pages_per_req = ctx // PAGE
    pool = batch * pages_per_req
    table = torch.randperm(pool, device=dev).to(torch.int32).reshape(batch, pages_per_req)
    page_tags = torch.randperm(4 * pool, device=dev)[:pool].to(torch.int64) + 1
    recorded = page_tags[table.long()]
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    last = ctx - 1
    slots = table[:, last // PAGE].long() * PAGE + last % PAGE
    holders = torch.ones(pool, dtype=torch.int64, device=dev)
    return table, seq_lens, recorded, page_tags, cu, slots, holders


def _mla_decode_us(batch: int, ctx: int, table, seq_lens, dev: str):
    """One layer of absorbed MLA decode at this shape (None if the op is not available)."""
    try:
        from mla_quant.kernels.mla_decode import mla_decode
    except ImportError:
        return None
    kv = torch.randn(batch * ctx // PAGE, PAGE, 576, device=dev, dtype=torch.bfloat16)
    q = torch.randn(batch, 1, HEADS, 576, device=dev, dtype=torch.bfloat16)
    fn = lambda: mla_decode(q, kv, None, table, seq_lens, SOFTMAX_SCALE, "bf16", 512,  # noqa: E731
                            max_seq_len=ctx, validate=False)
    t = median_us(fn)
    del kv
    return t


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    batches, contexts = ((1, 64, 256), (1024, 65536)) if ctx.quick else (BATCHES, CONTEXTS)
    cases = []
    for batch in batches:
        for n in contexts:
            table, seq_lens, recorded, tags, cu, slots, holders = _decode_step_inputs(batch, n, dev)
            failed = page_tag_verify(table, seq_lens, recorded, tags, PAGE, cu, slots, holders)
            assert not bool(failed.any()), "a consistent step must pass"
            t = median_us(lambda: page_tag_verify(table, seq_lens, recorded, tags, PAGE, cu, slots, holders))
            t_pages = median_us(lambda: page_tag_verify(table, seq_lens, recorded, tags, PAGE))
            layer = _mla_decode_us(batch, n, table, seq_lens, dev)
            peer = None if layer is None else LAYERS * layer
            pages = batch * math.ceil(n / PAGE)
            moved = pages * (4 + 8 + 8) + batch * (4 + 8 + 8 + 8)
            cases.append(case("page_tag_verify", {"batch": batch, "ctx": n, "page_size": PAGE}, t, bytes=moved,
                              peer=f"{LAYERS}x_mla_decode_bf16_h{HEADS}", peer_median_us=peer,
                              pages_only_us=round(t_pages, 3), mla_decode_layer_us=layer,
                              frac_of_step=None if peer is None else round(t / peer, 5)))
            del table, recorded, tags, holders
    return cases
