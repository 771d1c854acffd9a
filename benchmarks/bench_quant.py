"""bench ``quant``: quantization kernels on large tensors, against the copy bandwidth of the same run.

``quant_ops`` is shared with ``benchmarks/sweep_quant.py``, which times the same calls at other launch settings.
Each call is replayed from a CUDA graph (``graph_us``): timed eagerly (``do_bench`` events around a Python launch)
a 45-90 µs kernel also measured the host's launch latency, and the same default setting read 0.46-0.87 of copy
in one H200 session whenever the host's cores were busy (a test run beside it).
"""
from __future__ import annotations

from typing import Callable

import torch

from mla_quant.kernels import fp8_quant as F
from mla_quant.kernels import int4_quant as I

from .common import Context, case, graph_us

ROWS, K = 8192, 7168  # 117 MB of bf16: twice the L2, even in --quick mode (it takes seconds)
KV_WIDTH = 576  # MLA KV rows: 512 latent + 64 rope

QuantOp = tuple[str, Callable[[dict | None], object], int]  # (op, call(config), bytes it must move)


def quant_ops(x: torch.Tensor) -> list[QuantOp]:
    """Each kernel at the bench's shape: x [ROWS, K] bf16 (block / int4 weights, act rows, KV rows)."""
    numel = x.numel()
    q8, s8 = F.block_quant_fp8(x)
    packed, s4 = I.int4_quantize(x, 32)
    kv = x.reshape(-1)[: numel // KV_WIDTH * KV_WIDTH].view(-1, KV_WIDTH)
    act_bytes = numel * 2 + numel + numel // 128 * 4
    int4_bytes = numel * 2 + numel // 2 + s4.numel() * 2
    return [
        ("act_quant_fp8", lambda c=None: F.act_quant_fp8(x, 128, config=c), act_bytes),
        ("act_quant_fp8_ue8m0", lambda c=None: F.act_quant_fp8(x, 128, True, config=c), act_bytes),
        ("block_quant_fp8", lambda c=None: F.block_quant_fp8(x, config=c), numel * 2 + numel + s8.numel() * 4),
        ("block_dequant_fp8", lambda c=None: F.block_dequant_fp8(q8, s8, config=c),
         numel + numel * 2 + s8.numel() * 4),
        ("int4_quantize_g32", lambda c=None: I.int4_quantize(x, 32, config=c), int4_bytes),
        ("int4_dequantize_g32", lambda c=None: I.int4_dequantize(packed, s4, 32, config=c), int4_bytes),
        ("kv_quant_fp8_token", lambda c=None: F.kv_quant_fp8(kv, config=c), kv.numel() * 3 + kv.shape[0] * 4),
    ]


def run(ctx: Context) -> list[dict]:
    x = torch.randn(ROWS, K, device=ctx.device, dtype=torch.bfloat16)
    cases = []
    for op, call, bytes_moved in quant_ops(x):
        t, captured = graph_us(call)
        cases.append(case("quant", {"op": op, "numel": x.numel()}, t, bytes=bytes_moved, cuda_graph=captured,
                          frac_of_copy=round(bytes_moved / (t * 1e-6) / 1e12 / ctx.copy_tbps, 3)))
    return cases
