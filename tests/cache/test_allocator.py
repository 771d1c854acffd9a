"""PageAllocator: requests, prefix sharing with copy-on-write through the cache, plans, all-or-nothing
OutOfPages, clear errors, and random schedules whose reads always return each request's own rows."""
import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.cache import (
    NoopTagTracker,
    OutOfPages,
    PageAllocator,
    PagedBatch,
    PagedKVCache,
    UnknownRequest,
    check_page_table,
)

D = 32 + 16  # small rows: kv_lora_rank 32, rope 16


def small_cache(num_pages=16, page_size=4, kv="bf16"):
    return PagedKVCache(2, num_pages, page_size, 32, 16, kv).poison_()


def write(cache, slots, rows):
    for layer in range(cache.num_layers):
        cache.append(layer, rows * (layer + 1), slots)


def read(cache, alloc, request):
    return cache.read(0, alloc.pages(request), alloc.num_tokens(request))


def snapshot(alloc):
    t = alloc.tracker
    return (copy.deepcopy({r: (alloc.pages(r), alloc.num_tokens(r)) for r in alloc.requests}), list(alloc.refcount),
            list(alloc._free), copy.deepcopy(t._records), list(t._host_tags), t.page_tags.clone(), t._next_tag)


def same_snapshot(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_requests_get_slots_in_their_pages_and_read_back():
    cache = small_cache()
    alloc = PageAllocator(cache=cache)
    rows_a, rows_b = torch.randn(6, D).bfloat16(), torch.randn(3, D).bfloat16()
    write(cache, alloc.add_request("a", 6), rows_a)
    write(cache, alloc.add_request("b", 3), rows_b)
    assert alloc.pages("a") == [0, 1] and alloc.pages("b") == [2]
    more = torch.randn(4, D).bfloat16()
    slots = alloc.extend("a", 4)
    assert slots.tolist() == [6, 7, 12, 13]  # fills page 1, then a fresh page 3
    write(cache, slots, more)
    assert torch.equal(read(cache, alloc, "a"), torch.cat([rows_a, more]).float())
    assert torch.equal(read(cache, alloc, "b"), rows_b.float())
    alloc.free("a")
    assert alloc.num_free_pages == 15 and alloc.refcount[:4] == [0, 0, 1, 0]
    alloc.check_invariants()


def test_fork_at_a_page_boundary_shares_pages_and_never_copies():
    cache = small_cache()
    alloc = PageAllocator(cache=cache)
    rows = torch.randn(8, D).bfloat16()
    write(cache, alloc.add_request("a", 8), rows)
    alloc.fork("a", "b")
    assert alloc.pages("b") == alloc.pages("a") == [0, 1] and alloc.refcount[:2] == [2, 2]
    nb = torch.randn(1, D).bfloat16()
    write(cache, alloc.extend("b", 1), nb)
    assert alloc.pages("b") == [0, 1, 2] and alloc.pending_copies == []
    assert alloc.tracker.recorded("b")[:2] == alloc.tracker.recorded("a")  # inherited tags
    assert torch.equal(read(cache, alloc, "b"), torch.cat([rows, nb]).float())
    alloc.free("a")
    assert alloc.refcount[:3] == [1, 1, 1]
    assert torch.equal(read(cache, alloc, "b"), torch.cat([rows, nb]).float())
    alloc.check_invariants()


@pytest.mark.parametrize("writer_first", ["src", "dst"])
def test_partial_last_page_is_copied_on_write_for_every_layer(writer_first):
    cache = small_cache()
    alloc = PageAllocator(cache=cache)
    rows = torch.randn(6, D).bfloat16()
    write(cache, alloc.add_request("a", 6), rows)
    alloc.fork("a", "b", 5)  # shares page 0 and the partial page 1 (token 5 of "a" is not b's)
    assert alloc.pages("b") == [0, 1] and alloc.refcount[1] == 2
    new_a, new_b = torch.randn(3, D).bfloat16(), torch.randn(2, D).bfloat16()
    order = [("a", new_a), ("b", new_b)] if writer_first == "src" else [("b", new_b), ("a", new_a)]
    for r, new in order:
        write(cache, alloc.extend(r, new.shape[0]), new)
    assert alloc.pages("a")[0] == alloc.pages("b")[0] == 0 and alloc.pages("a")[1] != alloc.pages("b")[1]
    for layer in range(2):
        got_a = cache.read(layer, alloc.pages("a"), 9)
        got_b = cache.read(layer, alloc.pages("b"), 7)
        assert torch.equal(got_a, torch.cat([rows, new_a]).float() * (layer + 1))
        assert torch.equal(got_b, torch.cat([rows[:5], new_b]).float() * (layer + 1))
    alloc.check_invariants()


def test_retained_prefix_outlives_its_request():
    cache = small_cache()
    alloc = PageAllocator(cache=cache)
    rows = torch.randn(10, D).bfloat16()
    write(cache, alloc.add_request("a", 10), rows)
    prefix = alloc.retain_prefix("a", 8)
    alloc.free("a")
    assert alloc.refcount[:3] == [1, 1, 0]
    alloc.fork(prefix, "b")
    alloc.fork(prefix, "c", 6)
    alloc.release_prefix(prefix)
    assert torch.equal(read(cache, alloc, "b"), rows[:8].float())
    assert torch.equal(read(cache, alloc, "c"), rows[:6].float())
    with pytest.raises(ValueError, match="released"):
        alloc.fork(prefix, "d")
    with pytest.raises(ValueError, match="not retained"):
        alloc.release_prefix(prefix)
    alloc.check_invariants()


def test_plan_builds_the_step_batch():
    cache = small_cache(page_size=4)
    alloc = PageAllocator(cache=cache)
    alloc.add_request("a", 5)
    alloc.add_request("b", 0)
    batch = alloc.plan(["b", "a"], [3, 1])
    assert isinstance(batch, PagedBatch) and batch.request_ids == ("b", "a")
    assert batch.block_table.tolist() == [[2, -1], [0, 1]]
    assert batch.seq_lens.tolist() == [3, 6] and batch.cu_seqlens_q.tolist() == [0, 3, 4]
    assert batch.positions.tolist() == [0, 1, 2, 5] and batch.slot_mapping.tolist() == [8, 9, 10, 5]
    assert batch.max_query_len == 3 and not batch.is_decode
    assert batch.tags.tolist() == [[3, 0], [1, 2]]
    assert batch.block_table.dtype == batch.seq_lens.dtype == batch.cu_seqlens_q.dtype == torch.int32
    assert batch.positions.dtype == batch.slot_mapping.dtype == torch.int64
    indptr, indices, last = batch.csr()
    assert indptr.tolist() == [0, 1, 3] and indices.tolist() == [2, 0, 1] and last.tolist() == [3, 2]
    assert alloc.tracker.check(batch) == []
    sub = batch.select([1])
    assert sub.request_ids == ("a",) and sub.block_table.tolist() == [[0, 1]] and sub.seq_lens.tolist() == [6]
    assert sub.cu_seqlens_q.tolist() == [0, 1] and sub.positions.tolist() == [5] and sub.slot_mapping.tolist() == [5]
    assert sub.tags.tolist() == [[1, 2]] and sub.max_query_len == 1
    assert batch.select(torch.tensor([True, False])).slot_mapping.tolist() == [8, 9, 10]
    with pytest.raises(ValueError, match="increasing"):
        batch.select([1, 0])
    padded = alloc.plan(["a"], 1, max_pages=8)
    assert padded.block_table.shape == (1, 8) and padded.tags.shape == (1, 8)


@pytest.mark.parametrize("op", ["plan", "extend", "add_request"])
def test_out_of_pages_changes_nothing(op):
    cache = small_cache(num_pages=8, page_size=4)
    alloc = PageAllocator(cache=cache)
    alloc.add_request("a", 6)
    alloc.fork("a", "b", 5)          # a partial shared page: a step would need a copy too
    alloc.add_request("c", 9)
    alloc.tracker.flush()
    before = snapshot(alloc)
    data_before = [lk.data.clone() for lk in cache.layers]
    with pytest.raises(OutOfPages) as err:
        if op == "plan":
            alloc.plan(["a", "b", "c"], [1, 1, 12])  # a's copy + 3 pages for c > 3 free: refused as a whole
        elif op == "extend":
            alloc.extend("c", 16)
        else:
            alloc.add_request("d", 20)
    assert isinstance(err.value, RuntimeError) and err.value.free == 3
    alloc.tracker.flush()
    assert same_snapshot(before, snapshot(alloc))
    assert all(torch.equal(x.view(torch.uint8), lk.data.view(torch.uint8)) for x, lk in zip(data_before, cache.layers))
    assert "d" not in alloc
    alloc.plan(["a", "b"], [1, 1])   # what fits still works
    alloc.check_invariants()


def test_errors_name_the_request_or_page():
    alloc = PageAllocator(8, 4)
    alloc.add_request("a", 3)
    for call in [lambda: alloc.extend("zz", 1), lambda: alloc.free("zz"), lambda: alloc.fork("zz", "y"),
                 lambda: alloc.pages("zz"), lambda: alloc.plan(["a", "zz"]), lambda: alloc.block_table(["zz"])]:
        with pytest.raises(UnknownRequest, match="'zz' is not allocated"):
            call()
    with pytest.raises(ValueError, match="already exists"):
        alloc.add_request("a")
    with pytest.raises(ValueError, match="already exists"):
        alloc.fork("a", "a")
    with pytest.raises(ValueError, match="num_tokens"):
        alloc.fork("a", "b", 4)
    with pytest.raises(ValueError, match="twice"):
        alloc.plan(["a", "a"])
    with pytest.raises(ValueError, match="new_tokens"):
        alloc.plan(["a"], [1, 2])
    alloc.free("a")
    with pytest.raises(UnknownRequest):  # a second free of the same request
        alloc.free("a")
    with pytest.raises(RuntimeError, match="double free of page 0"):
        alloc._release_page(0)
    with pytest.raises(ValueError, match="tracker"):
        PageAllocator(8, 4, tracker=NoopTagTracker(16, 4))
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(cache=small_cache(16), num_pages=8)


def test_without_a_cache_copies_are_left_for_the_caller():
    alloc = PageAllocator(8, 4, tracker=NoopTagTracker())
    alloc.add_request("a", 2)
    alloc.fork("a", "b")
    alloc.extend("b", 1)
    assert alloc.take_pending_copies() == [(0, 1)] and alloc.pending_copies == []
    batch = alloc.plan(["a", "b"])
    assert batch.tags is None and NoopTagTracker().check(batch) == []


# ------------------------------------------------------------------------------------------ random schedules
@given(page_size=st.sampled_from([1, 16, 64]), seed=st.integers(0, 2**31 - 1),
       ops=st.lists(st.tuples(st.sampled_from(["add", "step", "fork", "free", "retain"]), st.integers(0, 2**16)),
                    min_size=1, max_size=25))
def test_random_schedules_read_back_each_requests_own_rows(page_size, seed, ops):
    """Whatever the schedule, every live request reads exactly the rows it (or the prefix it forked) wrote,
    NaN-poisoned unused slots are never read, the tags never fire and the invariants hold."""
    num_pages = max(8, 200 // page_size)
    cache = PagedKVCache(1, num_pages, page_size, 32, 16, "bf16").poison_()
    alloc = PageAllocator(cache=cache)
    g = torch.Generator().manual_seed(seed)
    expected: dict[int, torch.Tensor] = {}
    prefixes = []
    next_id = 0
    for op, arg in ops:
        live = sorted(expected)
        try:
            if op == "add" or not live:
                n = arg % 70
                rows = torch.randn(n, D, generator=g).bfloat16()
                write(cache, alloc.add_request(next_id, n), rows)
                expected[next_id] = rows
                next_id += 1
            elif op == "step":
                batch_ids = [r for i, r in enumerate(live) if (arg >> i) & 1] or live[:1]
                counts = [1 + (arg + i) % 3 for i in range(len(batch_ids))]
                batch = alloc.plan(batch_ids, counts)
                check_page_table(batch.block_table, batch.seq_lens, page_size, num_pages)
                assert alloc.tracker.check(batch) == []
                new = torch.randn(sum(counts), D, generator=g).bfloat16()
                write(cache, batch.slot_mapping, new)
                for r, part in zip(batch_ids, new.split(counts)):
                    expected[r] = torch.cat([expected[r], part])
            elif op == "fork":
                src = live[arg % len(live)]
                if prefixes and arg % 2:
                    ref, rows = prefixes[arg % len(prefixes)]
                    alloc.fork(ref, next_id)
                    expected[next_id] = rows
                else:
                    n = arg % (alloc.num_tokens(src) + 1)
                    alloc.fork(src, next_id, n)
                    expected[next_id] = expected[src][:n]
                next_id += 1
            elif op == "retain":
                src = live[arg % len(live)]
                n = arg % (alloc.num_tokens(src) + 1)
                prefixes.append((alloc.retain_prefix(src, n), expected[src][:n]))
            else:
                victim = live[arg % len(live)]
                alloc.free(victim)
                del expected[victim]
                if prefixes and arg % 3 == 0:
                    alloc.release_prefix(prefixes.pop()[0])
        except OutOfPages:
            pass
        alloc.check_invariants()
        for r, rows in expected.items():
            got = read(cache, alloc, r)
            assert torch.equal(got, rows.float()), f"request {r} reads someone else's rows"
