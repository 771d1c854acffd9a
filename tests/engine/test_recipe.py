"""Phase recipes in the engine (one instance or a prefill and a decode pool with the KV hand-off), and the
prefix cache's bookkeeping."""
from __future__ import annotations

import copy

import torch

from mla_quant.cache import PageAllocator
from mla_quant.engine import Engine, PrefixCache, SamplingParams, Status
from mla_quant.eval import kl_divergence
from mla_quant.formats import FP8Block, Int4Group, KVFormat
from mla_quant.formats.plan import Phase, PhaseRecipe, QuantPlan
from mla_quant.testing import sqnr_db

PAGE = 4
FP8_PREFILL = QuantPlan({"lm_head": None, "_default": FP8Block()})
INT4_EXPERTS = QuantPlan({r"re:.*mlp\.experts": Int4Group(32)})
SEED_RECIPE = PhaseRecipe(prefill=Phase(FP8_PREFILL, "bf16"), decode=Phase(INT4_EXPERTS, "fp8_e4m3"))


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    return torch.randint(3, 512, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def test_symmetric_recipe_is_one_instance(dense_model):
    model = copy.deepcopy(dense_model)
    recipe = PhaseRecipe(prefill=Phase(FP8_PREFILL, "fp8_e4m3"), decode=Phase(FP8_PREFILL, "fp8_e4m3"))
    engine = Engine.from_recipe(model, recipe, page_size=PAGE, num_pages=32)
    assert not engine.scheduler.two_pools and engine.prefill_pool.model is model
    assert set(engine.prefill_pool.cache.kv.formats) == {KVFormat("fp8_e4m3")}
    assert model.model.layers[0].self_attn.q_a_proj.fmt == FP8Block() and model.lm_head.fmt != FP8Block()
    results = engine.generate(prompts(3, 9), SamplingParams(max_new_tokens=4))
    assert all(len(r.output_ids) == 4 for r in results) and engine.stats.handoffs == 0


def test_seed_recipe_two_pools(moe_model):
    """Prefill FP8 weights + BF16 KV, decode INT4 experts + FP8 KV: two instances, every request handed off,
    the recipe's distributions close to the fp32 model's on the same tokens."""
    engine = Engine.from_recipe(copy.deepcopy(moe_model), SEED_RECIPE, page_size=PAGE, num_pages=32,
                                record_logits=True)
    pre, dec = engine.prefill_pool, engine.decode_pool
    assert engine.scheduler.two_pools
    assert set(pre.cache.kv.formats) == {KVFormat("bf16")} and set(dec.cache.kv.formats) == {KVFormat("fp8_e4m3")}
    assert pre.model.model.layers[1].mlp.experts.fmt == FP8Block()
    assert dec.model.model.layers[1].mlp.experts.fmt == Int4Group(32)
    assert dec.model.model.layers[1].self_attn.q_a_proj.fmt != FP8Block()
    ps = prompts(4, 10, seed=1)
    results = engine.generate(ps, SamplingParams(max_new_tokens=5))
    assert engine.stats.handoffs == 4 and engine.stats.handoff_pages == 4 * 3 and engine.stats.aborts == 0
    for p, r in zip(ps, results):
        with torch.no_grad():
            ref = moe_model(torch.tensor([p + r.output_ids[:-1]], device=moe_model.device))[0, len(p) - 1:]
        assert float(kl_divergence(ref.float().cpu(), r.logits)) < 0.2       # measured ≈ 0.02–0.05
    for pool in engine.pools:
        if pool.prefix is not None:
            pool.prefix.clear()
        pool.allocator.check_invariants()
        assert pool.allocator.num_free_pages == pool.allocator.num_pages


def test_handoff_moves_the_right_rows(dense_model):
    """The rows a request has in the decode pool after the hand-off are its prefill rows, in order, in FP8."""
    recipe = PhaseRecipe(prefill=Phase(None, "bf16"), decode=Phase(None, "fp8_e4m3"))
    engine = Engine.from_recipe(copy.deepcopy(dense_model), recipe, page_size=PAGE, num_pages=16)
    rid = engine.add_request(prompts(1, 11, seed=2)[0], SamplingParams(max_new_tokens=3))
    engine.add_request(prompts(1, 7, seed=3)[0], SamplingParams(max_new_tokens=3))   # another, to share the pools
    while engine.state(rid) is not Status.HANDOFF:
        engine.step()
    pre = engine.prefill_pool
    before = [pre.cache.kv.read(i, pre.allocator.pages(rid), 11) for i in range(len(pre.cache.kv))]
    while engine.state(rid) is Status.HANDOFF:
        engine.step()
    dec = engine.decode_pool
    for i, rows in enumerate(before):
        after = dec.cache.kv.read(i, dec.allocator.pages(rid), 11)
        assert sqnr_db(rows, after) > 25                       # FP8 e4m3 per token: ≈ 30 dB; a wrong page ≈ 0
        assert torch.allclose(after, rows, rtol=0.07, atol=1e-3)


def test_prefix_cache_bookkeeping():
    alloc = PageAllocator(num_pages=8, page_size=PAGE)
    cache = PrefixCache(alloc)
    toks = list(range(10, 22))                                  # 3 full pages
    alloc.add_request("a", 12)
    assert cache.insert("a", toks, 10) == 2                     # only full pages of computed tokens
    assert cache.insert("a", toks, 12) == 1 and cache.insert("a", toks, 12) == 0
    ref, n = cache.match(toks[:8] + [99, 98, 97, 96], max_tokens=12)
    assert n == 8
    alloc.fork(ref, "b", n)
    assert alloc.pages("b") == alloc.pages("a")[:2]
    assert cache.match([99] + toks[1:], 12) == (None, 0)
    assert cache.match(toks, max_tokens=7)[1] == 4              # limited to whole pages within max_tokens
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free_pages == 5                            # the cache still holds the 3 pages
    assert cache.evict()                      # the leaf (third page, its own retained ref) goes first: freed
    assert cache.match(toks, 12)[1] == 8 and alloc.num_free_pages == 6
    assert cache.evict() and alloc.num_free_pages == 6   # the second page's ref is shared with the first's
    while cache.evict():
        pass
    alloc.check_invariants()
    assert alloc.num_free_pages == 8 and len(cache) == 0
