"""Paged FP8 decode with a whole (tiny) Kimi K2.6-shaped model: the same KV memory budget holds about twice
the tokens in FP8 e4m3 as in BF16, at a small cost in fidelity. Serves the same requests through the engine
with each KV format and compares every sampled position's distribution with the fp32 model's plain forward
on the same tokens; then the capacity of the real model on 8×H200. CPU in seconds, GPU when present.

    python examples/04_paged_fp8_decode.py
"""
import torch

from mla_quant.cache import kv_capacity_tokens
from mla_quant.engine import Engine, SamplingParams, Status
from mla_quant.eval import kl_divergence, top1_agreement
from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_

PAGE, BUDGET_BYTES, REQUESTS, PROMPT, NEW = 16, 256 * 1024, 8, 32, 12


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)     # tiny ops: threads only contend
    config = KimiK26Config.tiny()
    model = init_random_weights_(KimiK26ForCausalLM(config, dtype=torch.float32, device=device), seed=0)
    prompts = torch.randint(3, config.vocab_size, (REQUESTS, PROMPT), generator=torch.Generator().manual_seed(1))
    print(f"tiny Kimi K2.6 ({config.num_hidden_layers} layers, latent {config.kv_lora_rank}+{config.qk_rope_head_dim}),"
          f" {REQUESTS} requests x ({PROMPT} prompt + {NEW} new) tokens, KV budget {BUDGET_BYTES // 1024} KiB")
    print(f"{'KV format':<11} {'B/token':>8} {'pages':>6} {'tokens':>7} {'max decoding':>13} {'preempt':>8} "
          f"{'KL (nats)':>10} {'top-1':>7}")
    for kv in ("bf16", "fp8_e4m3", "fp8_ds_mla"):
        probe = model.allocate_cache(1, PAGE, kv).kv
        pages = BUDGET_BYTES // probe.bytes_per_page()                    # the same bytes for every format
        engine = Engine(model, kv_format=kv, num_pages=pages, page_size=PAGE, record_logits=True)
        peak = []
        results = engine.generate(prompts.tolist(), SamplingParams(max_new_tokens=NEW),
                                  on_step=lambda e: peak.append(len(e.scheduler.in_state(Status.DECODE))))
        kls, agree = [], []
        with torch.no_grad():
            for p, r in zip(prompts.tolist(), results):
                ref = model(torch.tensor([p + r.output_ids[:-1]], device=device))[0, len(p) - 1:].float().cpu()
                kls.append(kl_divergence(ref, r.logits, "none"))
                agree.append(top1_agreement(ref, r.logits, "none"))
        print(f"{kv:<11} {probe.bytes_per_token():>8} {pages:>6} {pages * PAGE:>7} {max(peak):>13} "
              f"{engine.stats.preemptions:>8} {float(torch.cat(kls).mean()):10.4f} "
              f"{100 * float(torch.cat(agree).double().mean()):6.1f}%")
    real = KimiK26Config.full()
    print("Kimi K2.6 on 8xH200, TP8 (kv_capacity_tokens, its stated assumptions): " + ", ".join(
        f"{kv} {kv_capacity_tokens(real, kv):,} tokens" for kv in ("bf16", "fp8_e4m3", "fp8_ds_mla")))


if __name__ == "__main__":
    main()
