"""A research loop: which layers can keep their KV in FP8? Each candidate is a QuantPlan of KV rules (one layer
in FP8, all of them, all but the first, the 656-byte layout ...); the model runs through a paged cache in
that plan's per-layer formats (prefill, then one-token decode steps, as when serving) and its next-token
distributions are compared with the fp32 plain forward: KL, top-1, and the KL of the prompt's first and
second half against the decoded part (error accumulating along the context). Tiny Kimi K2.6-shaped model
with 4 layers; CPU in seconds, GPU when present.

    python examples/09_research_loop.py
"""
import torch

from mla_quant.eval import error_by_position, kl_divergence, paged_logits, top1_agreement
from mla_quant.formats import KVFormat
from mla_quant.formats.plan import QuantPlan
from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_

LAYERS, BATCH, TOKENS, DECODE_FROM, PAGE = 4, 4, 48, 32, 16
FP8, DS_MLA = KVFormat("fp8_e4m3"), KVFormat("fp8_ds_mla")


def attn(i: int) -> str:
    return f"model.layers.{i}.self_attn"


def candidates() -> dict[str, QuantPlan]:
    plans = {"all bf16": QuantPlan({})}
    plans.update({f"layer {i} fp8": QuantPlan({attn(i): FP8}) for i in range(LAYERS)})
    plans["all fp8"] = QuantPlan({r"re:.*self_attn": FP8})
    plans["fp8 but layer 0"] = QuantPlan({attn(0): None, r"re:.*self_attn": FP8})
    plans["all fp8_ds_mla"] = QuantPlan({r"re:.*self_attn": DS_MLA})
    return plans


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)     # tiny ops: threads only contend
    config = KimiK26Config.tiny().replace(num_hidden_layers=LAYERS)
    model = init_random_weights_(KimiK26ForCausalLM(config, dtype=torch.float32, device=device), seed=0).eval()
    ids = torch.randint(3, config.vocab_size, (BATCH, TOKENS), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        reference = model(ids).float()
    names = [attn(i) for i in range(LAYERS)]
    print(f"tiny Kimi K2.6, {LAYERS} layers; {BATCH} x {TOKENS} tokens (prefill {DECODE_FROM}, then decode); "
          "against the fp32 plain forward")
    print(f"{'KV plan':<17} {'B/token':>8} {'KL (nats)':>10} {'top-1':>7}   KL by positions "
          f"[0-{DECODE_FROM // 2}) [{DECODE_FROM // 2}-{DECODE_FROM}) [{DECODE_FROM}-{TOKENS}) (decode)")
    for label, plan in candidates().items():
        formats = plan.kv_formats(names, default="bf16")                 # one KVFormat per layer
        nbytes = sum(f.bytes_per_token(config.kv_lora_rank, config.qk_rope_head_dim) for f in formats)
        logits = paged_logits(model, ids, formats, PAGE, decode_from=DECODE_FROM).to(reference.device)
        edges = (0, DECODE_FROM // 2, DECODE_FROM, TOKENS)
        spans = [error_by_position(reference[:, a:b], logits[:, a:b], bins=1)[0][2] for a, b in zip(edges, edges[1:])]
        print(f"{label:<17} {nbytes:>8} {float(kl_divergence(reference, logits)):10.4f} "
              f"{100 * float(top1_agreement(reference, logits)):6.1f}%   " + "  ".join(f"{x:9.4f}" for x in spans))
    print("(mla_quant.eval.compare adds per-layer SQNR and FidelityReport.plot draws KL against position)")


if __name__ == "__main__":
    main()
