"""Per-layer formats in one line: a QuantPlan on a small MoE-shaped stack of QuantLinear layers — routed
experts in INT4, attention in FP8, the first layer and the lm_head left alone, FP8 KV everywhere but
layer 0 — then the bytes, the output error against the unquantized stack, and the plan saved in (and
read back from) the safetensors metadata. CPU, a few seconds.

    python examples/05_per_layer_plan.py
"""
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import mla_quant as mq
from mla_quant.formats import FP8Block, Int4Group, KVFormat
from mla_quant.modules import QuantLinear
from mla_quant.testing import sqnr_db

H, F, EXPERTS, LAYERS = 512, 256, 4, 3


def linear(k, n):
    lin = QuantLinear(k, n, dtype=torch.float32)
    lin.set_weight(torch.randn(n, k) * k ** -0.5)
    return lin


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj, self.self_attn.o_proj = linear(H, H), linear(H, H)
        self.self_attn.kv_format = KVFormat("bf16")  # an attention module declares the KV it writes
        self.mlp = nn.Module()
        self.mlp.experts = nn.ModuleList(nn.ModuleDict({"gate_proj": linear(H, F), "up_proj": linear(H, F),
                                                        "down_proj": linear(F, H)}) for _ in range(EXPERTS))

    def forward(self, x):
        x = x + self.self_attn.o_proj(torch.tanh(self.self_attn.q_proj(x)))
        for e in self.mlp.experts:  # every expert on every token: a dense stand-in for routing
            x = x + e["down_proj"](nn.functional.silu(e["gate_proj"](x)) * e["up_proj"](x)) / EXPERTS
        return x


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.lm_head = nn.Linear(H, 1000, bias=False)  # a plain nn.Linear: a plan may replace it

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def nbytes(model):
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def main():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(8, H)
    expected = model(x)
    before = nbytes(model)

    plan = mq.QuantPlan({
        "re:layers\\.0\\..*": None,                                 # keep the first layer as it is
        "re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj": Int4Group(32),
        "re:.*self_attn\\.(q|o)_proj": FP8Block(),
        "re:.*self_attn": KVFormat("fp8_e4m3"),                     # KV rules go to attention modules
        "_default": None,                                           # lm_head and the rest: untouched
    })
    changes = plan.matched(model)
    print(f"the plan changes {len(changes)} modules, e.g.")
    for name in list(changes)[:3] + list(changes)[-2:]:
        print(f"  {name:32} -> {changes[name]!r}")
    mq.quantize_(model, plan)

    print(f"KV format per layer: {[f.kind for f in plan.kv_formats(model)]}")
    print(f"weights: {before / 1e6:.2f} MB -> {nbytes(model) / 1e6:.2f} MB")
    print(f"logits SQNR against the unquantized stack: {sqnr_db(expected, model(x)):.1f} dB")

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path), metadata=plan.to_metadata())
        restored = mq.QuantPlan.from_checkpoint(path)
    assert restored == plan
    print(f"plan restored from the checkpoint metadata: {restored == plan}")
    print(f"repr round-trips: {eval(repr(plan), vars(mq.formats) | {'QuantPlan': mq.QuantPlan}) == plan}")


if __name__ == "__main__":
    main()
