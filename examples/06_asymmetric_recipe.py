"""The asymmetric per-phase recipe, disaggregated in one process: prefill with FP8 weights into a BF16 KV
cache, hand the requests' pages over to the decode pool (converted to FP8 e4m3 on the way), decode with INT4
weights. Then the same with ONE model instance that holds both weight formats (``recipe.apply``), which
must give the very same tokens. A tiny 2-layer MLA decoder (MLAttention + an MLP) on the CPU, in seconds.

    python examples/06_asymmetric_recipe.py
"""
import torch
from torch import nn

import mla_quant as mq
from mla_quant.cache import PagedKVCache
from mla_quant.cache.allocator import PageAllocator
from mla_quant.cache.tags import NoopTagTracker
from mla_quant.formats import FP8Block, Int4Group
from mla_quant.formats.plan import build_pools, handoff_kv
from mla_quant.modules import QuantLinear, RMSNorm
from mla_quant.modules.attention import MLAttention
from mla_quant.testing import sqnr_db

HIDDEN, LAYERS, KV_RANK, ROPE, PAGE = 256, 2, 128, 32, 16


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN, dtype=torch.float32)
        self.self_attn = MLAttention(HIDDEN, num_heads=4, q_lora_rank=128, kv_lora_rank=KV_RANK,
                                     qk_nope_head_dim=32, qk_rope_head_dim=ROPE, v_head_dim=32, dtype=torch.float32)
        self.post_attention_layernorm = RMSNorm(HIDDEN, dtype=torch.float32)
        self.mlp = nn.Module()
        for name, (k, n) in {"gate_proj": (HIDDEN, 512), "up_proj": (HIDDEN, 512), "down_proj": (512, HIDDEN)}.items():
            setattr(self.mlp, name, QuantLinear(k, n, dtype=torch.float32))

    def forward_paged(self, x, batch, kv):
        x = x + self.self_attn.forward_paged(self.input_layernorm(x), batch, kv)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(torch.nn.functional.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def step(self, x, batch, cache):  # x [T, HIDDEN]: the step's tokens (embeddings), request after request
        for i, layer in enumerate(self.layers):
            x = layer.forward_paged(x, batch, cache.layer(i))
        return x


def build_model() -> TinyDecoder:
    torch.manual_seed(0)
    model = TinyDecoder()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.set_weight(torch.randn(m.out_features, m.in_features) * m.in_features ** -0.5)
    return model


PROJ = r"re:.*(self_attn\.(q_a|q_b|kv_a|kv_b|o)_proj\w*|mlp\.\w+_proj)"
RECIPE = mq.PhaseRecipe(prefill=mq.Phase(weights={PROJ: FP8Block()}, kv="bf16"),
                        decode=mq.Phase(weights={PROJ: Int4Group(32)}, kv="fp8_e4m3"))


def new_pool(kv_formats, num_pages=32):
    cache = PagedKVCache(LAYERS, num_pages, PAGE, KV_RANK, ROPE, kv_format=kv_formats)
    return cache, PageAllocator(cache=cache, tracker=NoopTagTracker())


def serve(prefill_step, decode_step, kv_formats, prompts, steps=4):
    """Prefill every prompt in the prefill pool, hand the pages over, decode ``steps`` tokens.
    ``*_step(x, batch, cache)`` run the model of each pool; ``kv_formats``: {phase: formats per layer}.
    Returns the decode outputs [steps, B, HIDDEN] and the two caches."""
    p_cache, p_alloc = new_pool(kv_formats["prefill"])
    d_cache, d_alloc = new_pool(kv_formats["decode"])
    rids = list(range(len(prompts)))
    with torch.no_grad():
        for r in rids:
            p_alloc.add_request(r)
        batch = p_alloc.plan(rids, [len(p) for p in prompts])
        h = prefill_step(torch.cat(prompts), batch, p_cache)
        last = h[batch.cu_seqlens_q[1:].long() - 1]                       # each prompt's last hidden state
        for r, p in zip(rids, prompts):                                     # the hand-off, request by request
            d_alloc.add_request(r, len(p))
            handoff_kv(p_cache, d_cache, p_alloc.pages(r), d_alloc.pages(r))
            p_alloc.free(r)
        outs = []
        for _ in range(steps):  # feed each output back as the next token's embedding (a stand-in for sampling)
            x = last / last.norm(dim=-1, keepdim=True) * HIDDEN ** 0.5
            last = decode_step(x, d_alloc.plan(rids, 1), d_cache)
            outs.append(last)
    return torch.stack(outs), p_cache, d_cache


def main():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randn(n, HIDDEN, generator=g) for n in (37, 20, 5)]
    kv = {ph: RECIPE.phase(ph).kv_formats(build_model()) for ph in ("prefill", "decode")}
    plain = build_model()  # fp32 weights, the recipe's KV formats: the reference for the weight formats
    reference, _, _ = serve(plain.step, plain.step, kv, prompts)

    # 1) two pools: two instances, each quantized with its phase's plan
    prefill_model, decode_model = build_pools(build_model(), RECIPE)
    two_pools, p_cache, d_cache = serve(prefill_model.step, decode_model.step, kv, prompts)
    for name, m, cache in (("prefill", prefill_model, p_cache), ("decode", decode_model, d_cache)):
        print(f"{name} pool: {m.layers[0].mlp.up_proj.fmt!r}\n    KV {cache.formats[0].kind}: "
              f"{cache.bytes_per_token()} bytes per token over {LAYERS} layers")
    steps = ", ".join(f"{sqnr_db(r, q):.1f}" for r, q in zip(reference, two_pools))
    print(f"decode outputs vs unquantized weights, SQNR per step (dB; errors feed back): {steps}")

    # 2) one instance holding both weight formats, switched before each phase's step
    model = build_model()
    RECIPE.apply(model, "prefill")
    switch = model.phase_switch
    print(f"one instance: {len(switch.variants)} modules hold two formats "
          f"(+{switch.extra_bytes() / 1e6:.2f} MB for the inactive phase)")
    one_instance, _, _ = serve(lambda *a: RECIPE.apply(model, "prefill").step(*a),
                               lambda *a: RECIPE.apply(model, "decode").step(*a), kv, prompts)
    assert torch.equal(one_instance, two_pools), "one instance must match the two pools bit for bit"
    print("one instance == two pools, bit for bit")


if __name__ == "__main__":
    main()
