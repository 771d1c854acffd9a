"""topk_indices: the Triton radix select against the torch.topk reference, compared as selections (sets of
columns whose values are the k largest, ties in any order), on random rows, exact ties, -inf tails, NaN,
lengths around k, tiny tiles with many programs per row (the atomics), and real sizes on the GPU; both
finishes of the 8-bit select (the candidate compact + finish kernels, the rounds + select pass), the candidate
finish also with more candidates than its tile (tiny ``cand_block``)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.topk import FINISHES, _radix_topk, topk_indices, topk_indices_reference
from tests.conftest import HAS_CUDA

NEG_INF = float("-inf")
POISON = torch.iinfo(torch.int32).min


def selection_is_valid(scores, idx, k):
    """idx selects min(k, N) entries of each row: all finite entries when there are ≤ k of them (-1 for the
    rest), else k distinct entries whose values are the k largest (as a multiset: ties may pick any).
    NaN counts as the largest value (torch.topk's order); -inf entries must come out as -1."""
    n = scores.shape[-1]
    assert idx.dtype == torch.int32 and idx.shape == (scores.shape[0], min(k, n))
    assert not (idx == POISON).any(), "a slot was not written"
    scores, idx = scores.float().cpu(), idx.cpu()
    for row, sel in zip(scores, idx):
        row = row.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=NEG_INF)   # NaN ranks above everything
        finite = row > NEG_INF
        picked = sel[sel >= 0].long()
        assert ((sel >= 0) | (sel == -1)).all() and (sel < n).all()
        assert picked.unique().numel() == picked.numel()
        assert (row[picked] > NEG_INF).all(), "a -inf column must come out as -1"
        if int(finite.sum()) <= k:
            assert set(picked.tolist()) == set(finite.nonzero().flatten().tolist())
        else:
            assert picked.numel() == min(k, n)
            assert torch.equal(row[picked].sort().values, row.topk(min(k, n)).values.sort().values)


def assert_selects_the_largest(scores, idx, k):
    """A valid selection whose selected values equal the reference's, exactly (as sorted multisets)."""
    selection_is_valid(scores, idx, k)
    ref = topk_indices_reference(scores, k)
    got_vals = torch.where(idx >= 0, scores.gather(1, idx.clamp(min=0).long()), NEG_INF).sort(1).values
    want_vals = torch.where(ref >= 0, scores.gather(1, ref.clamp(min=0).long()), NEG_INF).sort(1).values
    assert torch.equal(got_vals, want_vals)


def radix(scores, k, **kw):
    """The Triton path into an output poisoned with int32 min, so a slot left unwritten fails the check."""
    out = torch.full((scores.shape[0], min(k, scores.shape[1])), POISON, dtype=torch.int32, device=scores.device)
    return _radix_topk(scores, k, out=out, **kw)


def test_fewer_valid_than_k_pads_with_minus_one():
    scores = torch.tensor([[3.0, NEG_INF, 1.0, NEG_INF, 2.0]])
    idx = topk_indices(scores, 4)
    assert sorted(idx[0].tolist()) == [-1, 0, 2, 4]
    assert topk_indices(scores, 9).shape == (1, 5)


def test_ties_are_any_valid_choice():
    scores = torch.tensor([[1.0, 5.0, 5.0, 5.0, 0.0]])
    selection_is_valid(scores, topk_indices(scores, 2), 2)


@given(k=st.integers(1, 20), n=st.integers(1, 40), rows=st.integers(1, 6), seed=st.integers(0, 2**16),
       causal=st.booleans(), ties=st.booleans())
def test_reference_selection_around_k(k, n, rows, seed, causal, ties):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, n, generator=g)
    if ties:
        scores = scores.round()
    if causal:  # row r sees a prefix whose length straddles k: k-1, k, k+1, ...
        visible = torch.tensor([max(1, min(n, k - 1 + r)) for r in range(rows)])
        scores = scores.masked_fill(torch.arange(n)[None, :] >= visible[:, None], NEG_INF)
    selection_is_valid(scores, topk_indices_reference(scores, k), k)


@pytest.mark.parametrize("rows, n, k", [(3, 5000, 300), (2, 3001, 2048), (1, 2049, 2048), (4, 1025, 7)])
def test_kernel_random_rows(triton_backend, rows, n, k):
    """Default tiles (1024 columns), several programs per row; odd lengths and k = 2048 near the row length."""
    scores = torch.randn(rows, n, device=triton_backend)
    selection_is_valid(scores, radix(scores, k), k)                            # 8-bit digits, candidates
    selection_is_valid(scores, radix(scores, k, finish="rounds"), k)


def rows_of_kind(kind: str, rows: int, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, n, generator=g)
    if kind == "binary":            # scores in {0, 1}: the threshold is an exact tie
        return torch.randint(0, 2, (rows, n), generator=g).float()
    if kind == "equal":
        return torch.full((rows, n), 0.5)
    if kind == "few_levels":        # ties at many values, negatives and zeros of both signs
        return (x * 2).round() * torch.where(torch.rand(rows, n, generator=g) < 0.5, -1.0, 1.0)
    if kind == "inf_tail":          # causal rows: k-1, k, k+1 and n visible columns
        visible = torch.tensor([k - 1, k, k + 1, n])[:rows, None]
        return x.masked_fill(torch.arange(n)[None, :] >= visible, NEG_INF)
    if kind == "all_masked":
        return torch.full((rows, n), NEG_INF)
    if kind == "specials":          # NaN (torch.topk: the largest), ±inf, -0.0 ties +0.0, denormals
        x[:, 3], x[:, 5], x[:, 7] = float("nan"), float("inf"), NEG_INF
        x[:, 10:30], x[:, 30:50] = 0.0, -0.0
        x[:, 50:60] = 1e-40
        return x
    if kind == "narrow":            # every key shares its top 22 bits: only the last radix round separates them
        return 1.0 + torch.randint(0, 1024, (rows, n), generator=g).float() * 2.0 ** -23
    if kind == "narrow_ties":       # the same in 8 levels: ties at the threshold below candidates above it
        return 1.0 + torch.randint(0, 8, (rows, n), generator=g).float() * 2.0 ** -23
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["binary", "equal", "few_levels", "inf_tail", "all_masked", "specials", "narrow",
                                  "narrow_ties"])
def test_kernel_hard_rows(triton_backend, kind):
    """Small tiles and many programs per row, so the histogram atomics and the slot counters are contended."""
    g = torch.Generator().manual_seed(1)
    k, n = 100, 777
    scores = rows_of_kind(kind, 4, n, k, g).to(triton_backend)
    selection_is_valid(scores, radix(scores, k, block=64, chunks=5, finish="rounds"), k)          # 8-bit digits
    selection_is_valid(scores, radix(scores, k, block=64, chunks=5, cand_block=256), k)  # > 256 candidates: tiles
    selection_is_valid(scores, radix(scores, k, block=128, chunks=1, radix_bits=11), k)


@pytest.mark.parametrize("finish", FINISHES)
@pytest.mark.parametrize("n", [99, 100, 101])
def test_kernel_lengths_around_k(triton_backend, n, finish):
    """N = k - 1 and k take the no-selection path (every column); k + 1 the radix select."""
    scores = torch.randn(3, n, device=triton_backend)
    scores[1, 50:] = NEG_INF
    idx = radix(scores, 100, block=32, chunks=3, finish=finish)
    assert idx.shape == (3, min(100, n))
    selection_is_valid(scores, idx, 100)


def test_kernel_half_precision_strided_rows(triton_backend):
    """bf16/fp16 scores (exact in fp32) and rows that are a view of a wider buffer (row stride != N)."""
    wide = torch.randn(3, 900, device=triton_backend)
    view = wide[:, :700]
    selection_is_valid(view, radix(view, 64, block=64, chunks=4), 64)
    for dtype in (torch.bfloat16, torch.float16):
        scores = wide.to(dtype)
        selection_is_valid(scores, topk_indices(scores, 64), 64)
    transposed = torch.randn(500, 2, device=triton_backend).t()          # column stride 2
    selection_is_valid(transposed, topk_indices(transposed, 50), 50)


def test_kernel_empty_batch(triton_backend):
    assert topk_indices(torch.randn(0, 300, device=triton_backend), 10).shape == (0, 10)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # the fixture only sets the backend
@given(k=st.integers(1, 40), n=st.integers(1, 300), rows=st.integers(1, 4), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["randn", "binary", "few_levels", "inf_tail", "narrow", "narrow_ties"]),
       block=st.sampled_from([16, 64, 256]), chunks=st.integers(1, 9), bits=st.sampled_from([8, 11]),
       finish=st.sampled_from(FINISHES), cand_block=st.sampled_from([16, 64, 4096]), fused=st.booleans(),
       warps=st.sampled_from([1, 4]), warp_search=st.booleans())
def test_kernel_hypothesis(triton_backend, k, n, rows, seed, kind, block, chunks, bits, finish, cand_block, fused,
                           warps, warp_search):
    """Both finishes at both digit widths (the candidate finish after two 11-bit rounds searches 10 low bits),
    candidate tiles from 16 (many re-read tiles) to 4096 (one tile in registers), up to 128 candidates searched
    by each warp on its own copy or block-wide, the candidate finish fused into the compact pass's last program
    or launched on its own, compact programs of 1 or 4 warps."""
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        scores = torch.randn(rows, n, generator=g)
    else:
        scores = rows_of_kind(kind, min(rows, 4) if kind == "inf_tail" else rows, n, k, g)
    scores = scores.to(triton_backend)
    selection_is_valid(scores, radix(scores, k, block=block, chunks=chunks, radix_bits=bits, finish=finish,
                                     cand_block=cand_block, fused_finish=fused, compact_warps=warps,
                                     warp_search=warp_search), k)


def test_bad_inputs():
    with pytest.raises(ValueError, match="k"):
        topk_indices(torch.randn(2, 4), 0)
    with pytest.raises(ValueError, match="scores"):
        topk_indices(torch.randn(2, 0), 3)
    with pytest.raises(ValueError, match="scores"):
        topk_indices(torch.randn(4), 3)
    with pytest.raises(TypeError, match="scores"):
        topk_indices(torch.randn(2, 4).double(), 3)
    with pytest.raises(ValueError, match="method"):
        topk_indices(torch.randn(2, 4), 3, method="sort")
    with pytest.raises(ValueError, match="radix_bits"):
        topk_indices(torch.randn(2, 4), 3, radix_bits=5)
    with pytest.raises(ValueError, match="finish"):
        topk_indices(torch.randn(2, 4), 3, finish="sort")


# ------------------------------------------------------------------------------------------------ GPU only
def realistic_scores(rows: int, n: int, seed: int) -> torch.Tensor:
    """Indexer-like scores: Σ_h w_h·ReLU(·) is ≥ 0 with a long right tail; the last row is causal-masked."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, 32, n, device="cuda", generator=g).relu_().mul_(torch.rand(rows, 32, 1, device="cuda"))
    s = x.sum(1)
    s[-1, n // 3:] = NEG_INF
    return s


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("n", [8192, 65536, 131072])
@pytest.mark.parametrize("bits", [8, 11])
def test_gpu_real_sizes(rows, n, bits):
    k = 2048
    scores = realistic_scores(rows, n, seed=n + rows)
    assert_selects_the_largest(scores, radix(scores, k, radix_bits=bits), k)


@pytest.mark.gpu
@pytest.mark.parametrize("finish", FINISHES)
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_decode_rows_both_finishes(rows, finish):
    """DSA decode at batch 1-4 (rows of 64k, k = 2048), through topk_indices: the selected values are the
    2048 largest."""
    k = 2048
    scores = realistic_scores(rows, 65536, seed=rows)
    assert_selects_the_largest(scores, topk_indices(scores, k, finish=finish), k)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [1, 4])
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_gpu_fused_finish_matches_unfused(rows, warps):
    """The candidate finish run by the compact pass's last program of each row (acq_rel arrival, candidates
    read through L2) selects the same values as its own launch, call after call on a kept work buffer."""
    from mla_quant.kernels.topk.kernel import work_ints
    k = 2048
    work = torch.zeros(rows, work_ints(8), dtype=torch.int32, device="cuda")
    for seed in range(3):
        scores = realistic_scores(rows, 65536, seed=100 + seed)
        fused = radix(scores, k, work=work, compact_warps=warps)
        assert_selects_the_largest(scores, fused, k)
        assert not work.any()
        unfused = radix(scores, k, fused_finish=False)
        assert torch.equal(scores.gather(1, fused.long()).sort(1).values,
                           scores.gather(1, unfused.long()).sort(1).values)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("n", [8192, 65536, 131072])
def test_gpu_warp_search_matches_block_search(rows, n):
    """Decode sizes (k = 2048): the finish's per-warp search of ≤ 128 candidates (the default) and the block-wide
    search select the 2048 largest, fused into the compact pass and in its own one-warp launch."""
    k = 2048
    scores = realistic_scores(rows, n, seed=5 * n + rows)
    for warp_search in (True, False):
        for fused in (True, False):
            assert_selects_the_largest(scores, radix(scores, k, warp_search=warp_search, fused_finish=fused), k)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["binary", "equal", "few_levels", "specials", "narrow", "narrow_ties"])
@pytest.mark.parametrize("bits, finish", [(8, "candidates"), (8, "rounds"), (11, "rounds")])
def test_gpu_hard_rows_long(kind, bits, finish):
    """Ties (equal, binary, narrow, narrow_ties: 64k candidates, re-read in tiles by the candidate finish), NaN,
    ±inf."""
    g = torch.Generator().manual_seed(2)
    scores = rows_of_kind(kind, 3, 65536, 2048, g).cuda()
    selection_is_valid(scores, radix(scores, 2048, radix_bits=bits, finish=finish), 2048)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """The op captures in a CUDA graph (no host sync) and selects correctly for new data on replay."""
    scores = realistic_scores(2, 65536, seed=0)
    topk_indices(scores, 2048)                          # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx = topk_indices(scores, 2048)
    for seed in (1, 2):
        scores.copy_(realistic_scores(2, 65536, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        selection_is_valid(scores, idx, 2048)


@pytest.mark.skipif(HAS_CUDA, reason="CPU only: the default backend there is the reference")
def test_cpu_default_is_reference():
    scores = torch.randn(2, 50)
    assert torch.equal(topk_indices(scores, 7), topk_indices_reference(scores, 7))


def test_many_rows_take_torch_topk(triton_backend, monkeypatch):
    """Above RADIX_MAX_ROWS rows and RADIX_MAX_ELEMENTS scores the op is torch.topk (faster there on the H200);
    within either bound, the radix select."""
    from mla_quant.kernels import topk as topk_mod

    calls = []
    monkeypatch.setattr(topk_mod, "_radix_topk",
                        lambda s, k, **kw: calls.append(s.shape[0]) or topk_indices_reference(s, k))
    monkeypatch.setattr(topk_mod, "RADIX_MAX_ELEMENTS", 1000)
    max_rows = topk_mod.RADIX_MAX_ROWS
    for rows, n in ((1, 300), (max_rows, 300), (max_rows + 1, 300), (64, 300), (max_rows + 4, 100)):
        scores = torch.randn(rows, n, device=triton_backend)
        selection_is_valid(scores, topk_mod.topk_indices(scores, 40), 40)
    assert calls == [1, max_rows, max_rows + 4]                          # 8 x 100 <= 1000 scores: radix
    scores = torch.randn(9, 300, device=triton_backend)                  # forced methods
    selection_is_valid(scores, topk_mod.topk_indices(scores, 40, method="radix"), 40)
    selection_is_valid(scores, topk_mod.topk_indices(scores, 40, method="torch"), 40)
    assert calls == [1, max_rows, max_rows + 4, 9]


def test_radix_many_rows_both_digit_widths(triton_backend):
    """The radix select forced on more rows than RADIX_MAX_ROWS (several programs per row), 8- and 11-bit."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(9, 1500, generator=g).to(triton_backend)
    scores[2, 700:] = NEG_INF
    for bits in (8, 11):
        selection_is_valid(scores, radix(scores, 130, block=256, chunks=3, radix_bits=bits), 130)
        selection_is_valid(scores, topk_indices(scores, 130, method="radix", radix_bits=bits), 130)


def test_radix_topk_from_checks_the_work_buffer():
    from mla_quant.kernels.topk import RADIX_BITS, radix_topk_from
    from mla_quant.kernels.topk.kernel import work_ints

    scores = torch.randn(2, 300)
    with pytest.raises(ValueError, match="work"):
        radix_topk_from(scores, 10, torch.zeros(2, 7, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="work"):
        radix_topk_from(scores, 300, torch.zeros(2, work_ints(RADIX_BITS), dtype=torch.int32), 1)   # N <= k
    shifted = torch.zeros(2 * work_ints(RADIX_BITS) + 1, dtype=torch.int32)[1:].view(2, -1)   # 4-byte aligned only
    with pytest.raises(ValueError, match="aligned"):
        radix_topk_from(scores, 10, shifted, 1)


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """kernel._order_key in torch, as the unsigned bit pattern (int64): the order of the scores, NaN largest."""
    b = scores.float().view(torch.int32).masked_fill(scores.isnan(), 2**31 - 1).long()
    return torch.where(b < 0, b ^ (2**31 - 1), b) + 2**31


@pytest.mark.parametrize("kind", ["randn", "equal", "inf_tail", "specials"])
@pytest.mark.parametrize("finish", [*FINISHES, "candidates_fused"])
def test_radix_topk_from_candidate_count(triton_backend, monkeypatch, kind, finish):
    """With a work buffer given (rounds_done = 0): the unfused candidate finish's kernel receives in count_cand
    (work[:, -3]) exactly the finite keys whose top 16 bits equal the threshold's (-inf keys are never listed,
    so a causally masked row whose threshold is -inf lists none of its masked columns), after no histogram round
    past the second; both candidate forms leave the work buffer zero — so a kept buffer serves the next call
    (radix_topk_from, the fused form: no finish launch); the rounds finish leaves count_cand at 0."""
    from mla_quant.kernels.topk import kernel, radix_topk_from
    from mla_quant.kernels.topk.kernel import work_ints

    seen, launch_finish = [], kernel._radix_finish_kernel

    class Spy:  # the finish kernel's launch, with a copy of the work buffer it is handed
        def __getitem__(self, grid):
            def launch(work, *args, **kwargs):
                seen.append(work.cpu().clone())
                return launch_finish[grid](work, *args, **kwargs)
            return launch

    monkeypatch.setattr(kernel, "_radix_finish_kernel", Spy())
    g = torch.Generator().manual_seed(4)
    k, n = 50, 400
    scores = (torch.randn(4, n, generator=g) if kind == "randn" else rows_of_kind(kind, 4, n, k, g))
    scores = scores.to(triton_backend)
    work = torch.zeros(4, work_ints(8), dtype=torch.int32, device=triton_backend)
    if finish == "candidates_fused":
        for _ in range(2):   # the second call on the kept buffer
            selection_is_valid(scores, radix_topk_from(scores, k, work, rounds_done=0, finish="candidates"), k)
            assert not seen and not work.cpu().any(), "the fused finish clears the work buffer"
        return
    selection_is_valid(scores, _radix_topk(scores, k, work=work, finish=finish, fused_finish=False), k)
    top16 = order_keys(scores.cpu()) >> 16
    thr16 = top16.topk(k, dim=1).values[:, -1:]
    if finish == "candidates":
        counts = seen[0][:, -3]
        assert torch.equal(counts, ((top16 == thr16) & (scores.cpu() > NEG_INF)).sum(1).int())
        if kind == "inf_tail":  # the row of k - 1 visible scores: threshold -inf, no candidate
            assert counts[0] == 0
        assert not seen[0][:, 2 * 256:4 * 256].any()
        assert not work.cpu().any(), "the finish kernel clears the work buffer"
        selection_is_valid(scores, _radix_topk(scores, k, work=work, fused_finish=False), k)  # kept
    else:
        assert not seen and not work.cpu()[:, -3].any()


@pytest.mark.parametrize("kind", ["equal", "narrow_ties", "narrow"])
@pytest.mark.parametrize("n", [63, 64, 65, 127, 128, 129])
def test_candidate_tile_boundary(triton_backend, kind, n):
    """Every key is a candidate (equal: one value; narrow_ties: the top 22 bits shared, 8 values below; narrow:
    1024 values below): c = N below, at and above a 64-candidate tile (registers vs tiles re-read per bit) and
    the 128 candidates of the per-warp search (on or off), several k."""
    g = torch.Generator().manual_seed(n)
    scores = rows_of_kind(kind, 3, n, 10, g).to(triton_backend)
    for k in (1, 10, n - 1):
        for warp_search in (True, False):   # ≤ 128 candidates: the per-warp search, or the block-wide one
            selection_is_valid(scores, radix(scores, k, block=32, chunks=2, finish="candidates", cand_block=64,
                                             warp_search=warp_search), k)


def test_radix_topk_from_checks_finish():
    from mla_quant.kernels.topk import RADIX_BITS, radix_topk_from
    from mla_quant.kernels.topk.kernel import work_ints

    work = torch.zeros(2, work_ints(RADIX_BITS), dtype=torch.int32)
    with pytest.raises(ValueError, match="finish"):
        radix_topk_from(torch.randn(2, 300), 10, work, 3, finish="candidates")   # past the candidate rounds
    with pytest.raises(ValueError, match="finish"):
        radix_topk_from(torch.randn(2, 300), 10, work, 1, finish="heap")


def test_radix_digit_schedules_cover_32_bits():
    from mla_quant.kernels.topk.kernel import rounds, work_ints

    assert rounds(11) == ((21, 11), (10, 11), (0, 10)) and rounds(8) == ((24, 8), (16, 8), (8, 8), (0, 8))
    assert work_ints(11) == 3 * 2048 + 4 and work_ints(8) == 4 * 256 + 4   # + arrived, cand, gt, eq counters
