import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.modules import Router
from mla_quant.modules.router import noaux_tc_route


def plain_route(logits, bias, k, n_group, topk_group, norm, scale):
    """Token by token, from the spec (model_specs.md §7), with Python sorts (ties: lower index first)."""
    experts = logits.shape[1]
    size = experts // n_group
    ids, weights = [], []
    for row in logits:
        s = torch.sigmoid(row.float())
        c = (s + bias).tolist()
        allowed = range(experts)
        if n_group > 1:
            group_score = [sum(sorted(c[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
            groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
            allowed = [e for e in range(experts) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: -c[e])[:k]
        w = s[chosen].double()
        if norm:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        weights.append((w * scale).tolist())
    return torch.tensor(weights), torch.tensor(ids)


def hf_route(logits, bias, k, n_group, topk_group, norm, scale):
    """transformers 5.24 ``DeepseekV3MoE.route_tokens_to_experts`` (masked groups -inf), transcribed."""
    n_experts = logits.shape[1]
    router_logits = logits.sigmoid()
    for_choice = router_logits + bias
    group_scores = for_choice.view(-1, n_group, n_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, n_experts // n_group).reshape(-1, n_experts)
    for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(for_choice, k=k, dim=-1, sorted=False)[1]
    topk_weights = router_logits.gather(1, topk_indices)
    if norm:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    return topk_weights * scale, topk_indices


def sort_by_id(weights, ids):
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


routing_configs = st.sampled_from([(8, 1, 1, 2), (16, 4, 2, 4), (64, 8, 4, 8), (12, 3, 3, 5), (32, 1, 1, 8),
                                   (6, 2, 1, 3)])  # (E, n_group, topk_group, k)


@given(cfg=routing_configs, t=st.integers(1, 40), norm=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_routing_equals_plain_reference(cfg, t, norm, seed):
    e, n_group, topk_group, k = cfg
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    bias = torch.randn(e, generator=g) * 0.1
    w, ids = noaux_tc_route(logits, bias, k, n_group, topk_group, norm, 2.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (t, k)
    pw, pids = plain_route(logits, bias, k, n_group, topk_group, norm, 2.5)
    w, ids = sort_by_id(w, ids)
    pw, pids = sort_by_id(pw, pids)
    assert torch.equal(ids, pids)
    torch.testing.assert_close(w, pw.float(), rtol=1e-6, atol=1e-7)


def _assert_valid_topk(logits, bias, w, ids, k, n_group, topk_group, norm, scale):
    """What must hold whichever of several equal scores torch.topk picks."""
    s = logits.sigmoid()
    c = s + bias
    e = logits.shape[1]
    size = e // n_group
    group_scores = c.view(-1, n_group, size).topk(2, dim=-1).values.sum(-1)
    for t in range(logits.shape[0]):
        chosen = ids[t].tolist()
        assert len(set(chosen)) == k
        groups = {x // size for x in chosen}
        assert len(groups) <= topk_group
        kth_group = group_scores[t].sort(descending=True).values[topk_group - 1]
        assert all(group_scores[t, gi] >= kth_group for gi in groups)  # each used group is a valid top group
        others = [x for x in range(e) if x // size in groups and x not in chosen]
        if others:  # inside the groups it used, no expert left out beats one taken
            assert c[t, chosen].min() >= c[t, others].max()
    expect = s.gather(1, ids)
    if norm:
        expect = expect / (expect.sum(-1, keepdim=True) + 1e-20)
    assert torch.equal(w, expect * scale)  # the weights belong to the chosen ids, unbiased


@pytest.mark.parametrize("cfg", [(8, 1, 1, 2), (16, 4, 2, 3), (64, 8, 4, 8), (32, 1, 1, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_ties_follow_torch_topk_as_hugging_face(cfg, with_bias):
    e, n_group, topk_group, k = cfg
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randint(-2, 3, (50, e), generator=g).float()  # five values: ties everywhere
    logits[:5] = 30.0  # sigmoid saturates to exactly 1.0: every expert ties
    bias = (torch.randint(0, 2, (e,), generator=g).float() * 0.5) if with_bias else torch.zeros(e)
    router = Router(7, e, k, n_group, topk_group, routed_scaling_factor=2.827)
    w, ids = noaux_tc_route(logits, bias, k, n_group, topk_group, True, 2.827)
    hw, hids = hf_route(logits, bias, k, n_group, topk_group, True, 2.827)
    assert torch.equal(ids, hids) and torch.equal(w, hw)  # same device, same torch.topk calls: same picks
    _assert_valid_topk(logits, bias, w, ids, k, n_group, topk_group, True, 2.827)
    assert router.top_k == k


def test_bias_selects_but_does_not_weigh():
    logits = torch.tensor([[2.0, 1.0, -1.0, -3.0]])
    bias = torch.tensor([0.0, 0.5, 0.0, 0.0])  # s = [.88, .73, .27, .05] -> biased expert 1 wins
    w, ids = noaux_tc_route(logits, bias, 1, norm_topk_prob=False, routed_scaling_factor=2.0)
    assert ids.tolist() == [[1]]
    assert torch.equal(w, torch.sigmoid(logits[:, 1:2]) * 2.0)
    w, ids = noaux_tc_route(logits, bias, 2, norm_topk_prob=True, routed_scaling_factor=2.0)
    s = torch.sigmoid(logits[0, [0, 1]])
    torch.testing.assert_close(sort_by_id(w, ids)[0][0], s / s.sum() * 2.0)


def test_masked_groups_are_minus_infinity():
    # Every biased score is negative; the group step keeps group 0 only. Filling the other group with 0.0
    # (transformers <= 5.2) would pick its experts; -inf (DeepSeek, transformers 5.24) never does.
    logits = torch.tensor([[3.0, 2.0, -4.0, -5.0, 1.0, 1.0, 1.0, 1.0]])
    bias = torch.full((8,), -10.0)
    bias[:4] = -1.0
    _, ids = noaux_tc_route(logits, bias, 3, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [0, 1, 2]


def test_group_score_is_sum_of_top_two():
    # group 0: one strong expert (max 0.99, top-2 sum 1.0); group 1: two good ones (max 0.9, sum 1.8)
    s = torch.tensor([[0.99, 0.01, 0.01, 0.01, 0.9, 0.9, 0.01, 0.01]])
    _, ids = noaux_tc_route(torch.logit(s), torch.zeros(8), 2, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [4, 5]


def test_router_module_computes_logits_in_fp32():
    router = Router(32, 8, 2, router_dtype=torch.bfloat16)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_()
    x = torch.randn(3, 4, 32).to(torch.bfloat16)
    assert torch.equal(router.logits(x), F.linear(x.reshape(-1, 32).float(), router.weight.float()))
    w, ids = router(x)
    w2, ids2 = noaux_tc_route(router.logits(x), router.e_score_correction_bias, 2, routed_scaling_factor=1.0)
    assert torch.equal(w, w2) and torch.equal(ids, ids2) and w.shape == (12, 2)
    sd = router.state_dict()
    assert list(sd) == ["weight", "e_score_correction_bias"]
    assert sd["weight"].dtype == torch.bfloat16 and sd["e_score_correction_bias"].dtype == torch.float32
    assert Router(32, 8, 2).weight.dtype == torch.float32  # the default, as Hugging Face keeps it


def test_router_is_differentiable_through_the_weights():
    router = Router(16, 8, 3)
    with torch.no_grad():
        router.weight.normal_()
    w, _ = router(torch.randn(5, 16))
    (w * torch.arange(3.0)).sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_bad_configs_raise():
    with pytest.raises(ValueError, match="n_group"):
        Router(8, 10, 2, n_group=3)
    with pytest.raises(ValueError, match="n_group"):
        Router(8, 4, 1, n_group=4)  # one expert per group
    with pytest.raises(ValueError, match="topk_group"):
        Router(8, 16, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Router(8, 16, 9, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="features"):
        Router(8, 16, 2)(torch.randn(2, 9))
