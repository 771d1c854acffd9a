"""bench ``prefill``: the asymmetry behind the per-phase recipe, on a real-width stack of linear layers.

One Kimi K2.6 dense decoder layer's projections as ``QuantLinear`` (attention: q_a 7168→1536,
q_b 1536→12288, kv_a 7168→576, kv_b 512→16384, o 8192→7168; MLP: gate/up 7168→18432, down 18432→7168 —
497 M weights), all in one format, each fed its own activations. Case keys: ``format`` (bf16, fp8_block =
W8A8 with its activation quantization, int4_g32 = W4A16), ``tokens``, ``phase`` (prefill: 2048 / 8192
tokens, compute-bound; decode: 1 / 16 / 64 tokens, weight-bandwidth-bound). The peer of fp8_block is
int4_g32 and the other way round (``speedup_vs_peer`` > 1: this format is faster). Expected: FP8 wins
prefill (INT4 dequantizes each weight once, then multiplies at the bf16 rate — in the main loop of the tiles
before session 41; Cloudflare's GLM 5.2 prefill 10,160 tok/s in FP8 against 8,660 in INT4), INT4 wins decode
(half the bytes of FP8).

The stack's eight calls are timed as one CUDA-graph replay (``graph_us``; ``graph`` in the row says whether the
capture worked). Timed eagerly (before session 17) the FP8 rows measured the host's launch overhead: one token
took 960-1770 µs in three runs (its 497 MB of weights read once: 117 µs; bf16's 994 MB: 290 µs, near its 234),
and the 2048-token FP8 row read 2186 µs in one run and 3310 in another on the same kernels.
"""
from __future__ import annotations

import torch

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.modules import QuantLinear

from .common import Context, case, graph_us

# (name, in_features, out_features) of one Kimi K2.6 dense layer (layer 0)
KIMI_DENSE_LAYER = (("q_a_proj", 7168, 1536), ("q_b_proj", 1536, 12288), ("kv_a_proj_with_mqa", 7168, 576),
                    ("kv_b_proj", 512, 16384), ("o_proj", 8192, 7168), ("gate_proj", 7168, 18432),
                    ("up_proj", 7168, 18432), ("down_proj", 18432, 7168))
FORMATS = {"bf16": BF16(), "fp8_block": FP8Block(), "int4_g32": Int4Group(32)}
PEER = {"fp8_block": "int4_g32", "int4_g32": "fp8_block"}
PHASE_TOKENS = {"prefill": (2048, 8192), "decode": (1, 16, 64)}


def _stack(fmt, device) -> list[QuantLinear]:
    layers = []
    for _, k, n in KIMI_DENSE_LAYER:
        lin = QuantLinear(k, n, fmt=fmt, dtype=torch.bfloat16, device=device)
        lin.set_weight(torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5)
        layers.append(lin)
    return layers


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    phases = {"prefill": (2048,), "decode": (1, 64)} if ctx.quick else PHASE_TOKENS
    times: dict[tuple[str, int], float] = {}
    meta: dict[tuple[str, int], dict] = {}
    n_weights = sum(k * n for _, k, n in KIMI_DENSE_LAYER)
    n_act = sum(k + n for _, k, n in KIMI_DENSE_LAYER)  # bf16 inputs read + outputs written, per token
    for name, fmt in FORMATS.items():
        stack = _stack(fmt, dev)
        nbytes = sum(sum(t.numel() * t.element_size() for t in lin.tensors.values()) for lin in stack)
        for phase, tokens in phases.items():
            for t in tokens:
                xs = [torch.randn(t, lin.in_features, device=dev, dtype=torch.bfloat16) for lin in stack]

                def forward():
                    for lin, x in zip(stack, xs):
                        lin(x)

                with torch.no_grad():
                    times[name, t], captured = graph_us(forward)
                meta[name, t] = {"phase": phase, "weight_bytes": nbytes, "graph": captured}
        del stack
        torch.cuda.empty_cache()
    rows = []
    for (name, t), us in times.items():
        peer = PEER.get(name)
        rows.append(case("prefill", {"format": name, "tokens": t, "phase": meta[name, t]["phase"],
                                     "stack": "kimi_k26_dense_layer"}, us,
                         bytes=meta[name, t]["weight_bytes"] + 2 * t * n_act, flops=2 * t * n_weights,
                         peer=peer, peer_median_us=times.get((peer, t)) if peer else None,
                         tokens_per_s=round(t / (us * 1e-6), 1), bf16_us=round(times["bf16", t], 3),
                         graph=meta[name, t]["graph"]))
    return rows
