"""The engine: batch invariance under churn, preemption, prefix sharing, page tags under injected faults, the
two-pool hand-off, bad input, and the bookkeeping left behind (no page leaks)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from mla_quant.engine import Engine, SamplingParams, Status
from mla_quant.eval import kl_divergence

PAGE = 4
VOCAB = 512


def run_busy(model, workload, inject=None, **engine_kwargs):
    """Serve ``workload`` = [(arrival step, prompt, SamplingParams)], request i arriving at its step.
    ``inject`` = (step, request id, how) corrupts bookkeeping at that step. Returns (engine, {id: result})."""
    engine = Engine(model, page_size=PAGE, **engine_kwargs)
    order = sorted(range(len(workload)), key=lambda i: workload[i][0])
    results, step = {}, 0
    while order or engine.has_unfinished():
        while order and workload[order[0]][0] <= step:
            i = order.pop(0)
            engine.add_request(workload[i][1], workload[i][2], request_id=i)
        if inject is not None and inject[0] == step:
            inject[2](engine, inject[1])
        for r in engine.step():
            results[r.request_id] = r
        step += 1
        assert step < 500, "the engine does not finish"
    return engine, results


def run_alone(model, prompt, params) -> list[int]:
    engine = Engine(model, page_size=PAGE, num_pages=64, prefix_caching=False)
    return engine.generate([prompt], params)[0].output_ids


def assert_no_leaks(engine: Engine) -> None:
    """Every page is free again once the requests are done and the prefix cache is dropped."""
    for pool in engine.pools:
        if pool.prefix is not None:
            pool.prefix.clear()
        pool.allocator.check_invariants()
        assert pool.allocator.num_free_pages == pool.allocator.num_pages, pool.name


tokens = st.integers(3, VOCAB - 1)


@st.composite
def workloads(draw):
    prefix = draw(st.lists(tokens, min_size=PAGE, max_size=3 * PAGE))
    work = []
    for i in range(draw(st.integers(3, 6))):
        share = draw(st.booleans())
        body = draw(st.lists(tokens, min_size=0 if share else 1, max_size=10))
        sampled = draw(st.sampled_from([False, False, True]))
        params = SamplingParams(max_new_tokens=draw(st.integers(1, 10)), temperature=0.8 if sampled else 0.0,
                                top_p=0.9, seed=i)
        work.append((draw(st.integers(0, 3)), (prefix if share else []) + body, params))
    longest = max(len(p) + sp.max_new_tokens for _, p, sp in work)
    need = -(-longest // PAGE)
    num_pages = draw(st.integers(need, need + 2))                    # tight: forces queueing and preemption
    return work, num_pages, draw(st.integers(3, 24)), draw(st.booleans())


@settings(max_examples=10)
@given(workloads())
def test_batch_invariance(dense_model, workload):
    """Each request's output in a busy engine (random arrivals, shared prefixes, chunked prefill, preemption,
    one or two pools) equals its output alone; greedy and seeded sampling alike; no page leaks."""
    work, num_pages, budget, two_pools = workload
    kwargs = dict(decode_model=dense_model, decode_num_pages=num_pages) if two_pools else {}
    engine, results = run_busy(dense_model, work, num_pages=num_pages, max_num_batched_tokens=budget, **kwargs)
    for i, (_, prompt, params) in enumerate(work):
        assert results[i].finish_reason == "length"
        assert results[i].output_ids == run_alone(dense_model, prompt, params), f"request {i}"
    assert engine.stats.aborts == 0
    event(f"preempted: {engine.stats.preemptions > 0}")
    event(f"shared pages: {engine.stats.shared_pages > 0}")
    assert_no_leaks(engine)


def shared_workload(n: int = 6, new: int = 12):
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, VOCAB, (3 * PAGE,), generator=g).tolist()
    return [(i // 2, (prefix if i % 2 == 0 else []) + torch.randint(3, VOCAB, (5 + i,), generator=g).tolist(),
             SamplingParams(max_new_tokens=new)) for i in range(n)]


@pytest.mark.parametrize("two_pools", [False, True])
def test_preemption_and_sharing_match_alone(moe_model, two_pools):
    """A pool too small for the batch: requests are preempted and recomputed, shared prefix pages are
    forked, and every output still equals the request's output alone (the MoE model)."""
    work = shared_workload()
    kwargs = dict(decode_model=moe_model, decode_num_pages=10) if two_pools else {}
    engine, results = run_busy(moe_model, work, num_pages=12, max_num_batched_tokens=16, **kwargs)
    assert engine.stats.preemptions > 0
    assert engine.stats.shared_pages > 0 and engine.stats.cached_tokens == engine.stats.shared_pages * PAGE
    assert any(r.num_preemptions for r in results.values())
    for i, (_, prompt, params) in enumerate(work):
        assert results[i].output_ids == run_alone(moe_model, prompt, params), f"request {i}"
    if two_pools:
        assert engine.stats.handoffs >= len(work)
    assert_no_leaks(engine)


@pytest.mark.parametrize("two_pools", [False, True])
def test_dsa_model(two_pools):
    """GLM 5.2's structure (DSA: indexer key pages beside the latents, sparse past index_topk = 8 tokens):
    busy equals alone; the hand-off copies the indexer keys too."""
    from mla_quant.models import Glm52Config, Glm52ForCausalLM, init_random_weights_
    from tests.conftest import DEVICE

    model = init_random_weights_(Glm52ForCausalLM(Glm52Config.tiny(), dtype=torch.float32, device=DEVICE), 0)
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(0, VOCAB, (2 * PAGE,), generator=g).tolist()
    work = [(i, prefix + torch.randint(0, VOCAB, (3 + 4 * i,), generator=g).tolist(), SamplingParams(max_new_tokens=6))
            for i in range(3)]
    kwargs = dict(decode_model=model, decode_num_pages=10) if two_pools else {}
    engine, results = run_busy(model, work, num_pages=10, max_num_batched_tokens=8, **kwargs)
    for i, (_, prompt, params) in enumerate(work):
        assert results[i].output_ids == run_alone(model, prompt, params), f"request {i}"
    assert engine.stats.shared_pages > 0
    assert_no_leaks(engine)


def test_queueing_when_the_batch_exceeds_the_cache(dense_model):
    """Twelve requests into a pool that holds about two at a time: they queue and all finish."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (9,), generator=g).tolist() for _ in range(12)]
    engine = Engine(dense_model, page_size=PAGE, num_pages=8, prefix_caching=False)
    seen = []
    results = engine.generate(prompts, SamplingParams(max_new_tokens=4),
                              on_step=lambda e: seen.append(len(e.scheduler.running)))
    assert all(r.finish_reason == "length" and len(r.output_ids) == 4 for r in results)
    assert max(seen) <= 2 and engine.stats.steps > 12
    assert_no_leaks(engine)


def test_matches_plain_forward(dense_model):
    """The engine's recorded logits at every sampled position agree with one plain causal forward over the
    generated sequence (BF16 pages: the latents' bf16 rounding is the only difference)."""
    prompt = torch.randint(3, VOCAB, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(dense_model, page_size=PAGE, num_pages=16, max_num_batched_tokens=4, record_logits=True)
    r = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    with torch.no_grad():
        full = dense_model(torch.tensor([prompt + r.output_ids[:-1]], device=dense_model.device))[0]
    ref = full[len(prompt) - 1:].float().cpu()
    assert r.logits.shape == ref.shape
    assert float(kl_divergence(ref, r.logits)) < 1e-4
    assert r.output_ids == ref.argmax(-1).tolist()


def test_stop_tokens_and_context_limit(dense_model):
    prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(6)).tolist()
    free = run_alone(dense_model, prompt, SamplingParams(max_new_tokens=6))
    engine = Engine(dense_model, page_size=PAGE, num_pages=16)
    stop = engine.generate([prompt], SamplingParams(max_new_tokens=6, stop_token_ids=[free[2]]))[0]
    assert stop.finish_reason == "stop" and stop.output_ids == free[:free.index(free[2]) + 1]
    short = Engine(dense_model, page_size=PAGE, num_pages=16, max_model_len=len(prompt) + 3)
    r = short.generate([prompt], SamplingParams(max_new_tokens=6))[0]
    assert r.finish_reason == "length" and r.output_ids == free[:3]


def test_timings(dense_model):
    engine = Engine(dense_model, page_size=PAGE, num_pages=16)
    r = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4))[0]
    assert len(r.token_s) == 4 and r.token_s == sorted(r.token_s)
    assert 0 < r.ttft_s <= r.latency_s and r.tpot_s > 0
    s = engine.stats
    assert s.prefill_tokens == 3 and s.decode_tokens == 3 and s.prefill_tokens_per_s > 0 and s.tag_checks == 4


# --------------------------------------------------------------------------------------------- faults
def corrupt_table(engine: Engine, rid) -> None:
    engine.inject_fault(rid)


def swap_last_pages(engine: Engine, rid) -> None:
    """A real bookkeeping bug: request ``rid``'s last page and the next decoding request's last page cross
    in the allocator's own lists (as a buggy free/alloc would leave them)."""
    pool = engine.decode_pool
    other = next(r.id for r in engine.scheduler.running if r.id != rid and r.pool is pool)
    mine, theirs = pool.allocator._requests[rid].pages, pool.allocator._requests[other].pages
    mine[-1], theirs[-1] = theirs[-1], mine[-1]
    engine._swapped = (rid, other)


def fault_workload():
    g = torch.Generator().manual_seed(7)
    return [(0, torch.randint(3, VOCAB, (6 + 2 * i,), generator=g).tolist(), SamplingParams(max_new_tokens=8))
            for i in range(4)]


@pytest.mark.parametrize("how", [corrupt_table, swap_last_pages])
def test_fault_aborts_only_the_affected_requests(dense_model, how):
    work = fault_workload()
    _, clean = run_busy(dense_model, work, num_pages=32)
    engine, faulty = run_busy(dense_model, work, inject=(5, 1, how), num_pages=32)
    hit = set(getattr(engine, "_swapped", (1,)))
    for i in range(len(work)):
        if i in hit:
            assert faulty[i].finish_reason == "aborted" and faulty[i].abort_reason.startswith("page tag mismatch")
            assert faulty[i].output_ids == clean[i].output_ids[:len(faulty[i].output_ids)]
        else:
            assert faulty[i].finish_reason == "length" and faulty[i].output_ids == clean[i].output_ids, i
    assert engine.stats.aborts == len(hit)
    if how is corrupt_table:            # only the step's table was wrong: the allocator is intact
        assert_no_leaks(engine)
    else:                               # each aborted request leaves the page it no longer owns alone
        assert all("left to their current owners" in faulty[i].abort_reason for i in hit)


def test_without_tags_the_fault_goes_unnoticed(dense_model):
    """The control: with page tags off the corrupted entry is read — the victim's next distribution changes
    and nothing is aborted."""
    work = fault_workload()
    _, clean = run_busy(dense_model, work, num_pages=32, page_tags=False, record_logits=True)
    engine, faulty = run_busy(dense_model, work, inject=(5, 1, corrupt_table), num_pages=32, page_tags=False,
                              record_logits=True)
    assert engine.stats.aborts == 0 and engine.stats.tag_checks == 0
    assert faulty[1].finish_reason == "length"
    n = len(faulty[1].logits)
    assert not torch.allclose(faulty[1].logits, clean[1].logits[:n], atol=1e-3)


# --------------------------------------------------------------------------------------------- bad input
def test_bad_input(dense_model):
    engine = Engine(dense_model, page_size=PAGE, num_pages=8, max_model_len=64)
    with pytest.raises(ValueError, match="prompt_ids: empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="token id 512 outside"):
        engine.add_request([1, 512])
    with pytest.raises(ValueError, match="token id -1 outside"):
        engine.add_request([-1])
    with pytest.raises(ValueError, match="64 tokens leave no room"):
        engine.add_request([3] * 64)
    with pytest.raises(ValueError, match="prompt_ids: expected a 1-D integer tensor"):
        engine.add_request(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="need 10 pages of 4; the prefill pool has 8"):
        engine.add_request([3] * 30, SamplingParams(max_new_tokens=10))
    with pytest.raises(TypeError, match="params"):
        engine.add_request([3], {"max_new_tokens": 3})
    engine.add_request([3, 4], request_id="a")
    with pytest.raises(ValueError, match="request_id: 'a' is already"):
        engine.add_request([3, 4], request_id="a")
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(dense_model, max_model_len=10**9)
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert engine.state("a") is Status.WAITING
    r = engine.abort_request("a")
    assert r.finish_reason == "aborted" and not engine.has_unfinished()
