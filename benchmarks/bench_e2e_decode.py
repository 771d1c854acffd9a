"""bench ``e2e_decode``: decode steps of a real-width, reduced-depth Kimi K2.6 on one H200.

The model is ``KimiK26ForCausalLM`` at the real width (hidden 7168, 64 heads, MLA 1536/512, vocab 163840)
with 3 layers: layer 0 dense (MLP 18432), layers 1–2 MoE with all 384 routed experts (+ the BF16 shared
expert), random weights made in place (``init_random_weights_``). The routed experts are held in
``case.format`` — ``int4_g32`` (the release: compressed-tensors INT4, W4A16) or ``fp8_block`` (128×128
blocks, W8A8) — everything else in BF16 as Kimi K2.6 ships it. The KV pages are ``case.kv`` (``bf16`` or
``fp8_e4m3``), filled with ``ctx`` tokens per request before timing.

One decode step = ``model(ids [B], batch=PagedBatch, cache=...)``: embedding, 3 layers (KV append +
absorbed MLA decode over the pages + MLP/MoE), final norm, LM head over the B new tokens. Timed as a CUDA
graph replay when capture works (``cuda_graph``), else eagerly. Case keys: ``format``, ``kv``,
``concurrency`` (B = 1, 8, 32, 64), ``ctx``; peer = the other expert format at the same kv and concurrency.
Extra fields: ``layer_us`` (dense layer, one MoE layer, the LM head + norm, each timed alone),
``projected_61_layer_ms`` (dense + 60 × MoE + head: the full model's step on one GPU if it fit — it does not,
the full model needs 8 GPUs; this is the per-layer cost that TP/EP divide), ``tokens_per_s``.

``bytes`` = the least the step reads: every BF16 weight of the 3 layers, the experts the batch can touch
(expected number of distinct experts for B·8 uniform picks out of 384, per MoE layer) in the case's format,
the LM head, and the KV pages of the B requests (ctx + 1 tokens, 3 layers).
"""
from __future__ import annotations

import gc

import torch

from mla_quant.cache import NoopTagTracker, PageAllocator
from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_

from .common import Context, case, median_us

FORMATS = {"int4_g32": Int4Group(32), "fp8_block": FP8Block()}
PEER = {"int4_g32": "fp8_block", "fp8_block": "int4_g32"}
KV_FORMATS = ("bf16", "fp8_e4m3")
CONCURRENCY = (1, 8, 32, 64)
CTX = 2048
PAGE = 64
LAYERS = 3  # 1 dense + 2 MoE


def _config() -> KimiK26Config:
    return KimiK26Config.full().replace(num_hidden_layers=LAYERS)


def _build(expert_fmt, device) -> KimiK26ForCausalLM:
    def formats(name: str):
        return expert_fmt if ".mlp.experts." in name else BF16()

    model = KimiK26ForCausalLM(_config(), dtype=torch.bfloat16, formats=formats, device=device).eval()
    init_random_weights_(model, seed=0)
    model.validate_inputs = False
    for layer in model.model.layers:
        layer.self_attn.validate_tables = False
    return model


def _fill(model, kv: str, batch_size: int, device):
    """A cache holding CTX random tokens for each of ``batch_size`` requests; the PagedBatch of one decode
    step for all of them (planned once, replayed: every replay rewrites the same slots)."""
    cfg = model.config
    pages_per_req = -(-(CTX + 1) // PAGE)
    cache = model.allocate_cache(batch_size * pages_per_req, PAGE, kv, device=device)
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    gen = torch.Generator(device=device).manual_seed(0)
    for r in range(batch_size):
        slots = alloc.add_request(r, CTX).to(device)
        for i in range(cfg.num_hidden_layers):
            rows = torch.randn(CTX, cfg.kv_cache_dim, device=device, generator=gen, dtype=torch.float32)
            cache.kv.layer(i).append(rows.to(torch.bfloat16), slots)
    batch = alloc.plan(list(range(batch_size)), new_tokens=1, device=device)
    return cache, batch


def _timed(fn) -> tuple[float, bool]:
    """Median µs of ``fn`` from a CUDA graph replay (eager if capture fails)."""
    with torch.no_grad():
        fn()
        torch.cuda.synchronize()
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            t = median_us(graph.replay)
            del graph
            return t, True
        except Exception:  # a host sync inside the step: time it eagerly
            torch.cuda.synchronize()
            return median_us(fn), False


def _expected_distinct(batch_size: int, top_k: int, experts: int) -> float:
    return experts * (1 - (1 - top_k / experts) ** batch_size)


def _weight_bytes(model, batch_size: int) -> int:
    """Bytes of the weights one step must read (experts: the expected distinct ones of each MoE layer)."""
    cfg = model.config
    total = 0
    for name, t in model.state_dict().items():
        if name.startswith("model.embed_tokens"):
            total += batch_size * cfg.hidden_size * t.element_size()   # B embedding rows
        elif ".mlp.experts." not in name:
            total += t.numel() * t.element_size()
    per_expert = 0
    experts = model.model.layers[LAYERS - 1].mlp.experts
    for proj in ("gate_proj", "up_proj", "down_proj"):
        per_expert += sum(t[0].numel() * t.element_size() for t in experts.tensors(proj).values())
    active = _expected_distinct(batch_size, cfg.num_experts_per_tok, cfg.n_routed_experts)
    return int(total + (LAYERS - cfg.first_k_dense_replace) * active * per_expert)


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    concurrency = (1, 64) if ctx.quick else CONCURRENCY
    times: dict[tuple[str, str, int], float] = {}
    rows: dict[tuple[str, str, int], dict] = {}
    for fmt_name, fmt in FORMATS.items():
        model = _build(fmt, dev)
        cfg = model.config
        for kv in KV_FORMATS:
            for b in concurrency:
                cache, batch = _fill(model, kv, b, dev)
                ids = torch.randint(0, cfg.vocab_size, (b,), device=dev)
                x = torch.randn(b, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
                step_us, graphed = _timed(lambda: model(ids, batch=batch, cache=cache))
                layer_us = {}
                for label, i in (("dense", 0), ("moe", LAYERS - 1)):
                    layer = model.model.layers[i]
                    layer_us[label] = round(_timed(lambda: layer.forward_paged(x, batch, cache))[0], 2)
                layer_us["norm_lm_head"] = round(_timed(lambda: model.lm_head(model.model.norm(x)))[0], 2)
                kv_bytes = b * (CTX + 1) * cache.kv.bytes_per_token()
                times[fmt_name, kv, b] = step_us
                projected = (layer_us["dense"] * cfg.first_k_dense_replace
                             + layer_us["moe"] * (61 - cfg.first_k_dense_replace) + layer_us["norm_lm_head"])
                rows[fmt_name, kv, b] = dict(
                    bytes=_weight_bytes(model, b) + kv_bytes, cuda_graph=graphed, layer_us=layer_us,
                    projected_61_layer_ms=round(projected / 1e3, 3), tokens_per_s=round(b / (step_us * 1e-6), 1))
                del cache, batch
                torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    out = []
    for (fmt_name, kv, b), us in times.items():
        peer = PEER[fmt_name]
        extra = rows[fmt_name, kv, b]
        out.append(case("e2e_decode", {"format": fmt_name, "kv": kv, "concurrency": b, "ctx": CTX,
                                       "model": f"kimi_k26_{LAYERS}_layers_real_width"}, us,
                        bytes=extra.pop("bytes"), peer=peer, peer_median_us=times.get((peer, kv, b)), **extra))
    return out
