"""Save tiny Kimi K2.6 and GLM 5.2 checkpoints in the real on-disk layouts, load them back with
``from_pretrained`` and run them: the plain forward, then prefill + decode through an FP8 paged cache.
Runs on the CPU in seconds.

    python examples/07_load_checkpoint.py
"""
import json
import tempfile
from pathlib import Path

import torch

import mla_quant as mq
from mla_quant.cache import NoopTagTracker, PageAllocator


def show_layout(path: Path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    qc = text.get("quantization_config") or {}
    print(f"  config.json: model_type={cfg['model_type']}" + (f" (text_config: {text['model_type']})"
                                                             if "text_config" in cfg else "")
          + f", quant_method={qc.get('quant_method')}")
    print(f"  {len(weight_map)} tensors in {len(set(weight_map.values()))} shards, e.g.")
    for key in sorted(weight_map):
        if ".experts.0.gate_proj." in key and ".layers.1." in key:
            print(f"    {key}")


def main() -> None:
    torch.manual_seed(0)
    for cls, config in [(mq.models.KimiK26ForCausalLM, mq.models.KimiK26Config.tiny()),
                        (mq.models.Glm52ForCausalLM, mq.models.Glm52Config.tiny())]:
        print(f"{cls.__name__} (tiny: {config.num_hidden_layers} layers, {config.n_routed_experts} experts)")
        model = cls(config, dtype=torch.bfloat16, formats="checkpoint")   # the release's formats
        mq.models.init_random_weights_(model, seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp)
            mq.models.save_pretrained(model, path, max_shard_bytes=1 << 20)
            show_layout(path)
            loaded = mq.models.from_pretrained(path, dtype=torch.float32)   # exact reference mode
        ids = torch.randint(0, config.vocab_size, (1, 16))
        with torch.no_grad():
            logits = loaded(ids)                                             # [1, 16, vocab]
        print(f"  plain forward: logits {tuple(logits.shape)}, next token {int(logits[0, -1].argmax())}")

        # the cached path: prefill the first 12 tokens, then decode 4, through FP8 pages
        cache = loaded.allocate_cache(num_pages=8, page_size=4, kv_format="fp8_e4m3")
        alloc = PageAllocator(cache=cache.kv, tracker=NoopTagTracker())
        alloc.add_request("r0")
        steps = [(0, 12)] + [(t, 1) for t in range(12, 16)]
        cached = []
        with torch.no_grad():
            for start, n in steps:
                batch = alloc.plan(["r0"], new_tokens=n)
                cached.append(loaded(ids[0, start:start + n], batch=batch, cache=cache))
        cached = torch.cat(cached)
        kl = (logits[0].log_softmax(-1).exp() * (logits[0].log_softmax(-1) - cached.log_softmax(-1))).sum(-1)
        agree = (cached.argmax(-1) == logits[0].argmax(-1)).float().mean()
        print(f"  FP8 paged cache vs plain forward: mean KL {kl.mean():.4f} nats, top-1 agreement {agree:.0%}")


if __name__ == "__main__":
    main()
