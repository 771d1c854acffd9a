"""The models on the GPU (Triton kernels): loading onto CUDA, the plain forward and the cached path agree
with the CPU fp32 reference path. Run on the H200 (``pytest -m gpu``)."""
from __future__ import annotations

import pytest
import torch

from mla_quant.cache import NoopTagTracker, PageAllocator
from mla_quant.models import (Glm52Config, Glm52ForCausalLM, KimiK26Config, KimiK26ForCausalLM, from_pretrained,
                              init_random_weights_, save_pretrained)

pytestmark = pytest.mark.gpu

MODELS = {"kimi": (KimiK26ForCausalLM, KimiK26Config.tiny), "glm": (Glm52ForCausalLM, Glm52Config.tiny)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_formats_on_cuda_match_cpu_reference(name, tmp_path):
    cls, make = MODELS[name]
    model = cls(make(), dtype=torch.bfloat16, formats="checkpoint")
    init_random_weights_(model, seed=5)
    save_pretrained(model, tmp_path)
    ref = from_pretrained(tmp_path, dtype=torch.float32)                   # CPU, exact mode
    gpu = from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    assert all(t.is_cuda for t in gpu.state_dict().values())
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    with torch.no_grad():
        want = ref(ids)
        got = gpu(ids.cuda()).cpu()
    assert _rel(got, want) < 3e-2


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3", "fp8_ds_mla"])
@pytest.mark.parametrize("name", list(MODELS))
def test_cached_decode_on_cuda(name, kv_format):
    cls, make = MODELS[name]
    model = cls(make(), dtype=torch.bfloat16, formats="checkpoint", device="cuda")
    init_random_weights_(model, seed=6)
    total, prompt = 20, 12
    seqs = torch.randint(0, model.config.vocab_size, (3, total), device="cuda")
    with torch.no_grad():
        full = model(seqs).float()
    cache = model.allocate_cache(num_pages=32, page_size=4, kv_format=kv_format).poison_()
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    for r in range(3):
        alloc.add_request(r)
    outs = []
    with torch.no_grad():
        batch = alloc.plan([0, 1, 2], new_tokens=prompt)
        out = model(seqs[:, :prompt].reshape(-1), batch=batch, cache=cache)
        outs.append(out.view(3, prompt, -1))
        for t in range(prompt, total):
            batch = alloc.plan([0, 1, 2], new_tokens=1)
            outs.append(model(seqs[:, t], batch=batch, cache=cache)[:, None])
    cached = torch.cat(outs, dim=1).float()
    assert torch.isfinite(cached).all()
    p, q = full.log_softmax(-1), cached.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    if kv_format == "bf16":
        assert _rel(cached, full) < 3e-2 and kl < 1e-3
    else:
        assert kl < 0.05
