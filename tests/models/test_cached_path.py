"""Prefill then decode through the paged cache equals the full forward's logits.

Two requests of different lengths: step 1 prefills request 0's first chunk and all of request 1's prompt;
step 2 mixes request 0's second chunk with request 1's first decode token (a mixed prefill + decode step);
then plain decode steps. Every logit row of the cached path is compared with the same row of one plain
causal forward over the whole sequences. Pages are NaN-poisoned first, page size 4 (tokens cross pages).

* BF16 pages with an fp32 model: the only difference is the bf16 rounding of the cached latents, so the
  logits agree to < 1e-2 relative (measured ≈ 3e-3) with KL < 1e-4 and the same top-1 everywhere.
* FP8 pages (``fp8_e4m3`` per-token scales, ``fp8_ds_mla``): stated bound on these tiny random models —
  mean KL(full || cached) < 0.05 nats per token, top-1 agreement ≥ 70% (measured: KL ≈ 0.011–0.014,
  top-1 78–91%). A wrong scale or a misplaced row gives KL of order 1.
"""
from __future__ import annotations

import pytest
import torch

from mla_quant.cache import NoopTagTracker, PageAllocator, PagedKVCache
from mla_quant.models import Glm52Config, Glm52ForCausalLM, KimiK26Config, KimiK26ForCausalLM, init_random_weights_

PAGE = 4
TOTAL = 14          # tokens per request at the end (GLM: > index_topk = 8, so sparse attention runs)
PROMPTS = (9, 5)    # request 0 prefills in two chunks of 6 + 3; request 1 prefills 5 at once

MODELS = {"kimi": (KimiK26ForCausalLM, KimiK26Config.tiny), "glm": (Glm52ForCausalLM, Glm52Config.tiny)}


@pytest.fixture(scope="module", params=list(MODELS))
def setup(request):
    cls, make = MODELS[request.param]
    model = cls(make(), dtype=torch.float32)
    init_random_weights_(model, seed=1)
    seqs = torch.randint(0, model.config.vocab_size, (2, TOTAL), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(seqs)
    return model, seqs, full


def run_cached(model, seqs, kv_format) -> torch.Tensor:
    """Logits [2, TOTAL, vocab] of the cached path (schedule in the module docstring)."""
    cache = model.allocate_cache(num_pages=16, page_size=PAGE, kv_format=kv_format).poison_()
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    for r in range(2):
        alloc.add_request(r)
    rows: list[list[torch.Tensor]] = [[], []]
    pos = [0, 0]

    def step(new: dict[int, int]) -> None:
        reqs = list(new)
        batch = alloc.plan(reqs, new_tokens=[new[r] for r in reqs])
        ids = torch.cat([seqs[r, pos[r]:pos[r] + new[r]] for r in reqs])
        with torch.no_grad():
            out = model(ids, batch=batch, cache=cache)
        starts = batch.cu_seqlens_q.tolist()
        for j, r in enumerate(reqs):
            rows[r].append(out[starts[j]:starts[j + 1]])
            pos[r] += new[r]

    step({0: 6, 1: PROMPTS[1]})
    step({0: PROMPTS[0] - 6, 1: 1})
    while min(pos) < TOTAL:
        step({r: 1 for r in range(2) if pos[r] < TOTAL})
    return torch.stack([torch.cat(r) for r in rows])


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    p, q = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def test_bf16_pages_equal_full_forward(setup):
    model, seqs, full = setup
    cached = run_cached(model, seqs, "bf16")
    assert torch.isfinite(cached).all()
    rel = ((cached - full).norm() / full.norm()).item()
    assert rel < 1e-2, rel
    assert kl(full, cached).max() < 1e-4
    assert torch.equal(cached.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_ds_mla"])
def test_fp8_pages_within_stated_kl(setup, kv_format):
    model, seqs, full = setup
    cached = run_cached(model, seqs, kv_format)
    assert torch.isfinite(cached).all()
    assert kl(full, cached).mean() < 0.05
    assert (cached.argmax(-1) == full.argmax(-1)).float().mean() >= 0.7


def test_logits_index_and_errors(setup):
    model, seqs, full = setup
    cache = model.allocate_cache(num_pages=8, page_size=PAGE)
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    alloc.add_request("a")
    alloc.add_request("b")
    batch = alloc.plan(["a", "b"], new_tokens=[3, 2])
    ids = torch.cat([seqs[0, :3], seqs[1, :2]])
    with pytest.raises(ValueError, match="input_ids: 4 tokens, the batch plans 5"):
        model(ids[:4], batch=batch, cache=cache)
    with pytest.raises(ValueError, match="cache: 1 layers"):
        model(ids, batch=batch, cache=PagedKVCache(1, 8, PAGE, model.config.kv_lora_rank,
                                                   model.config.qk_rope_head_dim))
    with pytest.raises(ValueError, match="input_ids"):
        model(seqs[:, :3], batch=batch, cache=cache)
    if isinstance(model.config, Glm52Config):
        with pytest.raises(ValueError, match="indexer key pages"):
            model(ids, batch=batch, cache=cache.kv)
    last = batch.cu_seqlens_q[1:] - 1                      # each request's last token
    with torch.no_grad():
        out = model(ids, batch=batch, cache=cache, logits_index=last)
    assert out.shape == (2, model.config.vocab_size)
    ref = torch.stack([full[0, 2], full[1, 1]])
    assert ((out - ref).norm() / ref.norm()) < 1e-2


def test_prefix_sharing_copies_latent_and_indexer_pages(setup):
    """Request B forks request A's 10-token prefix (its last page is partial and shared); then each decodes
    its own continuation. Copy-on-write must copy the latent pages and, for GLM, the indexer key pages:
    ``PageAllocator(cache=ModelCache)`` does both through ``ModelCache.copy_pages``."""
    model, seqs, _ = setup
    prefix = 10
    seq_b = torch.cat([seqs[0, :prefix], seqs[1, prefix:]])
    both = torch.stack([seqs[0], seq_b])
    with torch.no_grad():
        full = model(both)
    cache = model.allocate_cache(num_pages=16, page_size=PAGE).poison_()
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    alloc.add_request("A")
    with torch.no_grad():
        batch = alloc.plan(["A"], new_tokens=prefix)
        first = model(both[0, :prefix], batch=batch, cache=cache)
        alloc.fork("A", "B")
        rows = []
        for t in range(prefix, TOTAL):
            batch = alloc.plan(["A", "B"], new_tokens=1)
            rows.append(model(both[:, t], batch=batch, cache=cache))
    assert alloc.pages("A")[-1] != alloc.pages("B")[-1] and alloc.pages("A")[0] == alloc.pages("B")[0]
    cached = torch.stack(rows, dim=1)                                         # [2, TOTAL - prefix, vocab]
    assert ((first - full[0, :prefix]).norm() / full[0, :prefix].norm()) < 1e-2
    assert ((cached - full[:, prefix:]).norm() / full[:, prefix:].norm()) < 1e-2
    assert torch.equal(cached.argmax(-1), full[:, prefix:].argmax(-1))
