"""page_tag_verify: kernel == reference (exact: it only compares integers), the reference's rule on hand-made
cases, padding entries never read, out-of-range pages and lengths flagged, write slots checked, bad input."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mla_quant.kernels.page_tag_verify import page_tag_verify, page_tag_verify_reference
from mla_quant.testing import page_tables, ragged_lengths


def consistent_batch(lengths, page_size, seed, q_max=3, share_prefix=False, data=None):
    """A correct batch: table, lengths, recorded tags equal to the current tags, and correct write slots."""
    table, seq_lens, pool = data.draw(page_tables(lengths, page_size, share_prefix=share_prefix))
    pool = max(pool, 1)
    g = torch.Generator().manual_seed(seed)
    page_tags = torch.randperm(10 * pool + 10, generator=g)[:pool].long() + 1     # distinct, as allocated
    # padding entries hold garbage that must never be read (out of range and random)
    pad = table < 0
    table = torch.where(pad, torch.randint(-5, pool + 1000, table.shape, generator=g, dtype=torch.int32), table)
    recorded = torch.where(pad, torch.randint(0, 99, table.shape, generator=g),
                           page_tags[table.long().clamp(0, pool - 1)])
    q = torch.minimum(torch.randint(0, q_max + 1, (len(lengths),), generator=g), seq_lens.long())
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = q.cumsum(0).to(torch.int32)
    slots = []
    for b in range(len(lengths)):
        for pos in range(int(seq_lens[b]) - int(q[b]), int(seq_lens[b])):
            slots.append(int(table[b, pos // page_size]) * page_size + pos % page_size)
    return table, seq_lens, recorded, page_tags, cu, torch.tensor(slots, dtype=torch.int64)


def run_both(dev, *args, **kw):
    args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = page_tag_verify(*args, **kw, return_first_bad=True)
    want = page_tag_verify_reference(*args, **kw)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu()), (got, want)
    return want[0].cpu(), want[1].cpu()


SETTINGS = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(lengths=ragged_lengths(batch=st.integers(1, 9), min_len=0, max_len=300),
       page_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 2**31 - 1), share=st.booleans(),
       corrupt=st.sampled_from(["none", "tag", "page", "out_of_range", "slot", "length", "shared"]), data=st.data())
def test_kernel_matches_reference_and_flags_exactly_the_corrupted_request(
        triton_backend, lengths, page_size, seed, share, corrupt, data):
    table, seq_lens, rec, tags, cu, slots = consistent_batch(lengths, page_size, seed, share_prefix=share, data=data)
    holders = torch.ones_like(tags)
    failed, first = run_both(triton_backend, table, seq_lens, rec, tags, page_size, cu, slots, holders)
    assert not failed.any(), "a consistent batch must pass"
    assert torch.all(first == -1)
    b = data.draw(st.integers(0, len(lengths) - 1))
    n_pages = -(-int(seq_lens[b]) // page_size)
    if corrupt == "none" or (n_pages == 0 and corrupt in ("tag", "page", "out_of_range")):
        return
    if corrupt in ("slot", "shared") and int(cu[b + 1] - cu[b]) == 0:
        return
    table, rec, slots, seq_lens = table.clone(), rec.clone(), slots.clone(), seq_lens.clone()
    i = data.draw(st.integers(0, max(n_pages - 1, 0)))
    if corrupt == "tag":                  # the page was handed out again since b took it
        tags = tags.clone()
        tags[table[b, i]] += 1
        used = torch.arange(table.shape[1]) < -(-seq_lens.long()[:, None] // page_size)
        victims = (table.long() == int(table[b, i])) & used
        expect = victims.any(dim=1)       # every request reading that page fails
    elif corrupt == "page":               # a table entry that points at another (valid) page
        table[b, i] = (int(table[b, i]) + 1) % tags.shape[0]
        expect = torch.zeros(len(lengths), dtype=torch.bool)
        expect[b] = bool(tags[table[b, i]] != rec[b, i])
    elif corrupt == "out_of_range":
        table[b, i] = data.draw(st.sampled_from([-1, tags.shape[0], 2**31 - 1]))
        expect = torch.zeros(len(lengths), dtype=torch.bool)
        expect[b] = True
    elif corrupt == "slot":
        t = data.draw(st.integers(int(cu[b]), int(cu[b + 1]) - 1))
        slots[t] += data.draw(st.sampled_from([1, -1, page_size]))
        expect = torch.zeros(len(lengths), dtype=torch.bool)
        expect[b] = True
    elif corrupt == "shared":             # a write into a page someone else holds too (a missed copy-on-write)
        t = data.draw(st.integers(int(cu[b]), int(cu[b + 1]) - 1))
        page = int(slots[t]) // page_size
        holders = holders.clone()
        holders[page] = 2
        owner = torch.searchsorted(cu[1:].long(), torch.arange(slots.shape[0]), right=True)
        expect = torch.zeros(len(lengths), dtype=torch.bool)
        expect[owner[slots // page_size == page]] = True
    else:                                 # a length past the request's table
        seq_lens[b] = table.shape[1] * page_size + 1
        expect = torch.zeros(len(lengths), dtype=torch.bool)
        expect[b] = True
    failed, first = run_both(triton_backend, table, seq_lens, rec, tags, page_size, cu, slots, holders)
    assert torch.equal(failed, expect)
    if corrupt in ("tag", "page", "out_of_range") and expect[b]:
        assert int(first[b]) <= i
    if corrupt == "length":
        assert int(first[b]) == table.shape[1]


def test_reference_rule_by_hand():
    # two requests, page size 4; request 1 shares request 0's first page
    table = torch.tensor([[3, 1, -1], [3, 0, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 9], dtype=torch.int32)
    page_tags = torch.tensor([11, 12, 0, 10, 0, 0, 0, 13])
    rec = torch.tensor([[10, 12, 0], [10, 11, 13]])
    failed, first = page_tag_verify_reference(table, seq_lens, rec, page_tags, 4)
    assert failed.tolist() == [False, False] and first.tolist() == [-1, -1]
    page_tags[0] = 14                                   # page 0 reallocated: request 1 loses entry 1
    failed, first = page_tag_verify_reference(table, seq_lens, rec, page_tags, 4)
    assert failed.tolist() == [False, True] and first.tolist() == [-1, 1]
    page_tags[3] = 0                                    # the shared page freed: both fail at entry 0
    failed, first = page_tag_verify_reference(table, seq_lens, rec, page_tags, 4)
    assert failed.tolist() == [True, True] and first.tolist() == [0, 0]


def test_writes_are_checked_against_the_table(triton_backend):
    table = torch.tensor([[3, 1], [2, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 1], dtype=torch.int32)
    tags = torch.tensor([1, 2, 3, 4])
    rec = torch.tensor([[4, 2], [3, 0]])
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    good = torch.tensor([4 * 1 + 0, 4 * 1 + 1, 2 * 4 + 0])
    failed, _ = run_both(triton_backend, table, seq_lens, rec, tags, 4, cu, good)
    assert failed.tolist() == [False, False]
    bad = torch.tensor([4 * 1 + 0, 4 * 3 + 1, 2 * 4 + 0])   # token 5 of request 0 written into its first page
    failed, first = run_both(triton_backend, table, seq_lens, rec, tags, 4, cu, bad)
    assert failed.tolist() == [True, False] and first.tolist() == [1, -1]
    # a padding request (length 0) with a dummy token must write nowhere (-1)
    table2, seq2, rec2 = table[:1], torch.tensor([0], dtype=torch.int32), rec[:1]
    cu2 = torch.tensor([0, 1], dtype=torch.int32)
    assert not run_both(triton_backend, table2, seq2, rec2, tags, 4, cu2, torch.tensor([-1]))[0].any()
    assert run_both(triton_backend, table2, seq2, rec2, tags, 4, cu2, torch.tensor([5]))[0].all()


def test_large_tables_loop_over_page_blocks(triton_backend):
    # more pages than one block of the kernel, failure in the last block only
    p = 2500
    table = torch.randperm(p).to(torch.int32)[None, :].repeat(2, 1)
    tags = torch.arange(1, p + 1)
    rec = tags[table.long()]
    seq_lens = torch.tensor([p, p - 3], dtype=torch.int32)
    rec[0, p - 1] += 7
    failed, first = run_both(triton_backend, table, seq_lens, rec, tags, 1)
    assert failed.tolist() == [True, False] and first.tolist() == [p - 1, -1]


def test_empty_batch_and_empty_requests(triton_backend):
    z = torch.zeros(0, 4, dtype=torch.int32)
    failed = page_tag_verify(z.to(triton_backend), torch.zeros(0, dtype=torch.int32, device=triton_backend),
                             torch.zeros(0, 4, dtype=torch.long, device=triton_backend),
                             torch.ones(3, dtype=torch.long, device=triton_backend), 16)
    assert failed.shape == (0,)
    table = torch.full((2, 0), -1, dtype=torch.int32)
    failed, first = run_both(triton_backend, table, torch.tensor([0, 1], dtype=torch.int32),
                             torch.zeros(2, 0, dtype=torch.long), torch.ones(3, dtype=torch.long), 16)
    assert failed.tolist() == [False, True] and first.tolist() == [-1, 0]


def test_bad_input_is_named():
    t = torch.zeros(2, 3, dtype=torch.int32)
    s = torch.zeros(2, dtype=torch.int32)
    r = torch.zeros(2, 3, dtype=torch.long)
    tags = torch.zeros(5, dtype=torch.long)
    with pytest.raises(TypeError, match="block_table"):
        page_tag_verify(t.long(), s, r, tags, 4)
    with pytest.raises(TypeError, match="recorded_tags"):
        page_tag_verify(t, s, r.int(), tags, 4)
    with pytest.raises(ValueError, match="recorded_tags"):
        page_tag_verify(t, s, r[:, :2], tags, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        page_tag_verify(t, s[:1], r, tags, 4)
    with pytest.raises(TypeError, match="page_tags"):
        page_tag_verify(t, s, r, tags.int(), 4)
    with pytest.raises(ValueError, match="page_size"):
        page_tag_verify(t, s, r, tags, 0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        page_tag_verify(t, s, r, tags, 4, cu_seqlens_q=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        page_tag_verify(t, s, r, tags, 4, torch.zeros(2, dtype=torch.int32), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="page_holders"):
        page_tag_verify(t, s, r, tags, 4, page_holders=tags)
    with pytest.raises(ValueError, match="page_holders"):
        page_tag_verify(t, s, r, tags, 4, torch.zeros(3, dtype=torch.int32), torch.zeros(0, dtype=torch.long),
                        page_holders=tags[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("batch,pages", [(1, 16), (64, 64), (256, 1024)])
def test_gpu_large_batches_match_reference(batch, pages):
    g = torch.Generator().manual_seed(batch)
    pool = batch * pages
    table = torch.randperm(pool, generator=g).to(torch.int32).reshape(batch, pages)
    tags = torch.randperm(4 * pool, generator=g)[:pool].long() + 1
    rec = tags[table.long()]
    seq_lens = torch.randint(0, pages * 64 + 1, (batch,), generator=g).int()
    bad = torch.rand(batch, pages, generator=g) < 0.001
    rec[bad] += 1
    run_both("cuda", table, seq_lens, rec, tags, 64)
