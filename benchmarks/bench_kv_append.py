"""bench ``kv_append``: writing a step's new latent rows into the pages, quantizing on the way.

Case keys (DESIGN.md): ``kv`` (bf16, fp8_e4m3 per token, fp8_ds_mla), ``heads`` (1: the latent is one shared
KV head), ``batch`` (rows appended in one call: a decode batch, or a prefill chunk), ``ctx`` (tokens of the page
pool the rows are scattered into), ``page_size`` 64. Rows are bf16 ``[T, 576]`` (Kimi K2.6 / GLM 5.2) written to
random distinct slots. ``bytes`` = rows read + the stored format written + slots read. The peer is the torch
composition (``kv_append_reference``: quantize with torch ops, then index_put), timed in the same run.
"""
from __future__ import annotations

import torch

from mla_quant.formats import KVFormat
from mla_quant.kernels.kv_append import kv_append, kv_append_reference
from mla_quant.kernels.kv_layout import kv_data_dtype, kv_row_width

from .common import Context, case, median_us

KINDS = ("bf16", "fp8_e4m3", "fp8_ds_mla")
TOKENS = (1, 8, 64, 256, 1024, 8192)
POOL_TOKENS = 1 << 20   # 1M-token pool: scattered writes, as in a full cache
PAGE = 64


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    tokens = (1, 64, 1024) if ctx.quick else TOKENS
    cases = []
    for kind in KINDS:
        width = kv_row_width(kind, 512, 64)
        data = torch.zeros(POOL_TOKENS // PAGE, PAGE, width, dtype=kv_data_dtype(kind), device=dev)
        scales = torch.zeros(POOL_TOKENS // PAGE, PAGE, device=dev) if kind == "fp8_e4m3" else None
        per_token = KVFormat(kind).bytes_per_token(512, 64)
        for t in tokens:
            rows = torch.randn(t, 576, device=dev, dtype=torch.bfloat16)
            slots = torch.randperm(POOL_TOKENS, device=dev)[:t]
            fast = median_us(lambda: kv_append(rows, slots, data, scales, kind, "token", 512, check_slots=False))
            peer = median_us(lambda: kv_append_reference(rows, slots, data, scales, kind, "token", 512))
            moved = t * (576 * 2 + per_token + 8)
            cases.append(case("kv_append", {"kv": kind, "heads": 1, "batch": t, "ctx": POOL_TOKENS, "page_size": PAGE},
                              fast, bytes=moved, peer="torch_reference", peer_median_us=peer,
                              frac_of_copy=round(moved / (fast * 1e-6) / 1e12 / ctx.copy_tbps, 3)
                              if ctx.copy_tbps else None))
        del data, scales
    return cases
