import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels import moe_align as M


def test_layout_by_hand():
    # T=3, k=2, E=4, block 4: expert 0 gets assignments 1, 4; expert 2 gets 0, 3, 5; expert 3 gets 2.
    ids = torch.tensor([[2, 0], [3, 2], [0, 2]], dtype=torch.int32)
    sorted_ids, expert_ids, num_padded = M.moe_align_reference(ids, 4, 4)
    s = 6  # the sentinel = T * k
    assert sorted_ids[:12].tolist() == [1, 4, s, s, 0, 3, 5, s, 2, s, s, s]
    assert expert_ids[:3].tolist() == [0, 2, 3] and num_padded.tolist() == [12]
    cap = M.align_capacity(6, 4, 4)
    assert sorted_ids.numel() == cap and expert_ids.numel() == cap // 4
    assert (sorted_ids[12:] == s).all() and (expert_ids[3:] == -1).all()


def _check_invariants(ids: torch.Tensor, num_experts: int, block_m: int, result) -> None:
    """What the GEMMs rely on, independent of the reference's code."""
    sorted_ids, expert_ids, num_padded = (t.cpu() for t in result)
    flat = ids.reshape(-1).long().cpu()
    a = flat.numel()
    total = int(num_padded)
    assert total % block_m == 0 and total <= sorted_ids.numel() == M.align_capacity(a, num_experts, block_m)
    kept = ((flat >= 0) & (flat < num_experts)).nonzero().flatten()
    real = sorted_ids[sorted_ids < a]
    assert sorted(real.tolist()) == kept.tolist()  # every kept assignment exactly once, dropped ones nowhere
    assert (sorted_ids[total:] == a).all() and (expert_ids[total // block_m:] == -1).all()
    for b in range(total // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < a]
        assert rows.numel() > 0  # no block is pure padding
        assert (flat[rows] == expert_ids[b]).all()  # one expert per block
        assert torch.equal(rows, rows.sort().values)  # increasing assignment order inside an expert
    assert torch.equal(expert_ids[:total // block_m], expert_ids[:total // block_m].sort().values)


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.integers(0, 70), k=st.integers(1, 8), e=st.integers(1, 40), block_m=st.sampled_from([1, 16, 32, 64]),
       drop=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_kernel_and_torch_path_equal_reference(triton_backend, t, k, e, block_m, drop, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1 if drop else 0, e, (t, k), generator=g, dtype=torch.int32)
    ref = M.moe_align_reference(ids, e, block_m)
    _check_invariants(ids, e, block_m, ref)
    ids_dev = ids.to(triton_backend)
    for got in (M.moe_align(ids_dev, e, block_m), M.moe_align_torch(ids_dev, e, block_m)):
        for name, a, b in zip(("sorted_ids", "expert_ids", "num_padded"), got, ref):
            assert a.dtype == torch.int32 and torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("case", ["one_expert", "one_token", "all_dropped", "int64", "out_of_range"])
def test_edge_cases(triton_backend, case):
    ids = {"one_expert": torch.full((63, 4), 5), "one_token": torch.tensor([[3, 0, 7]]),
           "all_dropped": torch.full((5, 2), -1), "int64": torch.randint(0, 9, (17, 3)),
           "out_of_range": torch.tensor([[0, 9], [12, 1]])}[case]
    ids = ids.to(torch.int64 if case == "int64" else torch.int32)
    ref = M.moe_align_reference(ids, 9, 16)
    _check_invariants(ids, 9, 16, ref)
    got = M.moe_align(ids.to(triton_backend), 9, 16)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, ref))


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="topk_ids"):
        M.moe_align(torch.zeros(2, 2), 4, 16)
    with pytest.raises(ValueError, match="topk_ids"):
        M.moe_align(torch.zeros(4, dtype=torch.int32), 4, 16)
    with pytest.raises(ValueError, match="block_m"):
        M.moe_align(torch.zeros(2, 2, dtype=torch.int32), 4, 24)
    with pytest.raises(ValueError, match="num_experts"):
        M.moe_align(torch.zeros(2, 2, dtype=torch.int32), 0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,block_m", [(1, 8, 384, 1), (16, 8, 384, 1), (64, 8, 384, 16), (1024, 8, 384, 32),
                                           (4096, 8, 256, 128), (1000, 8, 384, 64)])
def test_gpu_real_sizes(t, k, e, block_m):
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    ref = M.moe_align_reference(ids, e, block_m)
    got = M.moe_align(ids.cuda(), e, block_m)  # one program up to MAX_ASSIGNMENTS, the torch path beyond
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, ref))
