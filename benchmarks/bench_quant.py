"""bench ``quant``: quantization kernels on large tensors, against the copy bandwidth of the same run."""
from __future__ import annotations

import torch

from mla_quant.kernels import fp8_quant as F
from mla_quant.kernels import int4_quant as I

from .common import Context, case, median_us


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    rows, k = 8192, 7168  # 117 MB of bf16: twice the L2, even in --quick mode (it takes seconds)
    numel = rows * k
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    q8, s8 = F.block_quant_fp8(x)
    packed, s4 = I.int4_quantize(x, 32)
    cases = []

    def add(op, fn, bytes_moved):
        t = median_us(fn)
        cases.append(case("quant", {"op": op, "numel": numel}, t, bytes=bytes_moved,
                          frac_of_copy=round(bytes_moved / (t * 1e-6) / 1e12 / ctx.copy_tbps, 3)))

    add("act_quant_fp8", lambda: F.act_quant_fp8(x, 128), numel * 2 + numel + numel // 128 * 4)
    add("act_quant_fp8_ue8m0", lambda: F.act_quant_fp8(x, 128, True), numel * 2 + numel + numel // 128 * 4)
    add("block_quant_fp8", lambda: F.block_quant_fp8(x), numel * 2 + numel + s8.numel() * 4)
    add("block_dequant_fp8", lambda: F.block_dequant_fp8(q8, s8), numel + numel * 2 + s8.numel() * 4)
    add("int4_quantize_g32", lambda: I.int4_quantize(x, 32), numel * 2 + numel // 2 + s4.numel() * 2)
    add("int4_dequantize_g32", lambda: I.int4_dequantize(packed, s4, 32), numel // 2 + s4.numel() * 2 + numel * 2)
    kv = x.reshape(-1)[: numel // 576 * 576].view(-1, 576)  # MLA KV rows: 512 latent + 64 rope
    add("kv_quant_fp8_token", lambda: F.kv_quant_fp8(kv), kv.numel() * 3 + kv.shape[0] * 4)
    return cases
