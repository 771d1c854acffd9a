"""PageTagTracker: the tags' life cycle, verify/check/abort, and schedules with injected bookkeeping bugs.

A shadow memory holds, for every slot of the pool, the id of the row last written there; each request knows
the ids it must read. A schedule allocates, extends (steps that write then read), forks prefixes (copy-on-write),
retains and releases prefixes, and frees. In buggy schedules, real bug classes are injected:

* ``use_after_free``  a request's page is freed while the request still holds it (and reused at once);
* ``double_free``     a shared page is released twice when one owner finishes (the other still reads it);
* ``off_by_one``      a block-table entry of a step points one page off (page id + 1, or the previous entry's);
* ``stale_prefix``    a prefix cache entry exactly at a page boundary (SGLang #22819) outlives its pages: they are
                      reused, then a new request forks the stale entry;
* ``swap``            the pages of two requests are swapped in the allocator's lists.

Every stale read — a request reading a row that is not its own — must be caught before the read, by the tags
(or by the allocator's own guards, which refuse to hand out a referenced page or free a page twice); a correct
schedule must never abort. The counts are printed (run with ``-s``) and written to ``$MLA_QUANT_TAG_RATES``.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mla_quant.cache import (
    NoopTagTracker,
    OutOfPages,
    PageAllocator,
    PagedKVCache,
    PageTagMismatch,
    PageTagTracker,
)

BUGS = ("use_after_free", "double_free", "off_by_one", "stale_prefix", "swap")
GARBAGE = -1


# ============================================================================================ unit tests
def test_tags_are_fresh_on_every_allocation_and_zero_when_free():
    alloc = PageAllocator(6, 4)
    t = alloc.tracker
    alloc.add_request("a", 8)
    assert t.recorded("a") == [1, 2] and [t.current(p) for p in range(3)] == [1, 2, 0]
    alloc.fork("a", "b")
    assert t.recorded("b") == [1, 2]                     # shared pages keep their tag
    alloc.free("a")
    assert t.current(0) == 1                             # still held by b
    alloc.free("b")
    assert t.current(0) == 0 and t.current(1) == 0       # free: tag 0
    alloc.add_request("c", 24)                           # reallocated: new tags, never reused ones
    assert sorted(t.recorded("c")) == [3, 4, 5, 6, 7, 8]
    t.flush()
    assert t.page_tags.tolist() == [t.current(p) for p in range(6)]


def test_verify_flags_a_reader_of_a_reallocated_page_and_check_raises_or_aborts():
    alloc = PageAllocator(4, 4)
    alloc.add_request("a", 6)
    alloc.add_request("b", 3)
    batch = alloc.plan(["a", "b"])
    assert not alloc.tracker.verify_batch(batch).any()
    # a buggy scheduler frees a's second page while a still holds it, then it goes to someone else
    page = alloc.pages("a")[1]
    alloc.refcount[page] = 0
    alloc._free.appendleft(page)
    alloc.tracker.release([page])
    alloc.add_request("c", 2)
    assert alloc.pages("c") == [page]
    batch = alloc.plan(["a", "b", "c"])
    assert alloc.tracker.verify_batch(batch).tolist() == [True, False, False]
    with pytest.raises(PageTagMismatch, match="request 'a'") as err:
        alloc.tracker.check(batch)
    assert isinstance(err.value, RuntimeError) and err.value.requests == ["a"]
    entry, pid, want, have = err.value.pages["a"][0]
    assert (entry, pid) == (1, page) and want != have
    assert alloc.tracker.check(batch, on_mismatch="abort") == ["a"]
    kept = alloc.abort("a")                                 # releases only what a still owns
    assert kept == [page] and alloc.refcount[page] == 1 and "c" in alloc
    with pytest.raises(ValueError, match="on_mismatch"):
        alloc.tracker.check(batch, on_mismatch="ignore")


def test_a_write_into_a_page_another_request_holds_is_caught():
    """A reference count one too low makes the allocator skip a copy-on-write: the tags of the shared page stay
    valid for both owners, but the tracker's own holder count stops the writer."""
    alloc = PageAllocator(4, 4)
    alloc.add_request("a", 6)
    alloc.fork("a", "b")                      # b shares a's partial page 1
    assert alloc.tracker.holders(1) == 2
    alloc.refcount[1] -= 1                    # the bug: a lost reference
    batch = alloc.plan(["b"])                 # no copy: b would write token 6 into a's page
    assert alloc.pages("b") == alloc.pages("a") and alloc.take_pending_copies() == []
    assert alloc.tracker.verify_batch(batch).tolist() == [True]
    prefix = alloc.retain_prefix("a", 5)      # a retained prefix holds pages as well
    assert alloc.tracker.holders(0) == 3 and alloc.tracker.recorded(prefix) == list(prefix.tags)
    alloc.release_prefix(prefix)
    assert alloc.tracker.holders(0) == 2


def test_noop_tracker_has_the_same_interface_and_does_nothing():
    alloc = PageAllocator(4, 4, tracker=NoopTagTracker())
    alloc.add_request("a", 5)
    batch = alloc.plan(["a"])
    assert batch.tags is None
    assert NoopTagTracker().verify_batch(batch).tolist() == [False]
    assert alloc.tracker.check(batch) == [] and alloc.abort("a") == []
    assert not NoopTagTracker.enabled and PageTagTracker.enabled
    public = {n for n in dir(PageTagTracker) if not n.startswith("_")} - {"mismatch", "recorded_table"}
    assert public <= set(dir(NoopTagTracker))


def test_verify_with_an_explicit_table_and_unknown_requests():
    alloc = PageAllocator(4, 4)
    alloc.add_request("a", 5)
    table, seq_lens = alloc.block_table(["a"])
    assert alloc.tracker.verify(["a"], table, seq_lens).tolist() == [False]
    with pytest.raises(KeyError, match="'zz'"):
        alloc.tracker.verify(["zz"], table, seq_lens)
    table[0, 0] = 7                                           # a page id out of range
    assert alloc.tracker.verify(["a"], table, seq_lens).tolist() == [True]


# ============================================================================================ schedules
class Harness:
    """Allocator + tracker + shadow memory, driven by rules; counts reads, stale reads, detections."""

    def __init__(self, page_size: int, num_pages: int, inject: bool):
        self.ps, self.num_pages, self.inject = page_size, num_pages, inject
        self.alloc = PageAllocator(num_pages, page_size)     # bookkeeping only: copies land in the shadow
        self.mem = [GARBAGE] * (num_pages * page_size)       # slot -> id of the row written there
        self.expected: dict[int, list[int]] = {}             # request -> ids it must read, in order
        self.prefixes: list[tuple] = []                      # (PrefixRef, ids)
        self.next_row = 0
        self.next_req = 0
        self.table_bug = None                                # an off-by-one for the next step
        self.halted = False                                  # the allocator's own guard stopped the run
        self.stats = dict(steps=0, reads=0, stale_reads=0, detected_stale=0, undetected_stale=0, aborts=0,
                          early_aborts=0, guard_stops=0, injections=0,
                          **{f"injected_{b}": 0 for b in BUGS})

    # ---------------------------------------------------------------------------------- helpers
    def rows(self, n):
        ids = list(range(self.next_row, self.next_row + n))
        self.next_row += n
        return ids

    def new_id(self):
        self.next_req += 1
        return self.next_req - 1

    def apply_copies(self):
        for src, dst in self.alloc.take_pending_copies():
            s, d = src * self.ps, dst * self.ps
            self.mem[d:d + self.ps] = self.mem[s:s + self.ps]

    def stale(self, table_row, n, ids) -> bool:
        for j in range(n):
            page = int(table_row[j // self.ps])
            if not 0 <= page < self.num_pages or self.mem[page * self.ps + j % self.ps] != ids[j]:
                return True
        return False

    def guarded(self, fn, *args):
        """Run an allocator call; a RuntimeError from its own guards (not OutOfPages) ends a buggy run."""
        try:
            return fn(*args)
        except OutOfPages:
            return None
        except RuntimeError:
            if not self.inject:
                raise
            self.stats["guard_stops"] += 1
            self.halted = True
            return None

    # ---------------------------------------------------------------------------------- operations
    def add(self, n):
        rid = self.new_id()
        if self.guarded(self.alloc.add_request, rid, 0) is None and rid not in self.alloc:
            return
        self.expected[rid] = []
        self.step([rid], [n])

    def step(self, requests, counts):
        requests = [r for r in requests if r in self.expected]
        if not requests or self.halted:
            return
        batch = self.guarded(self.alloc.plan, requests, counts)
        if batch is None:
            return
        self.apply_copies()
        if self.table_bug is not None:
            self.corrupt_table(batch)
        failed = self.alloc.tracker.verify_batch(batch).tolist()     # before any write or read
        self.stats["steps"] += 1
        slots = batch.slot_mapping.split(batch.query_lens.tolist())
        for b, r in enumerate(requests):                              # writes of the requests that go on
            if not failed[b]:
                ids = self.rows(counts[b])
                for s, i in zip(slots[b].tolist(), ids):
                    self.mem[s] = i
                self.expected[r] += ids
        for b, r in enumerate(requests):                              # reads
            n = int(batch.seq_lens[b])
            ids = self.expected[r]
            if failed[b]:                                             # aborted: what it would have read
                old = n - counts[b]
                is_stale = self.stale(batch.block_table[b], old, ids)
                self.stats["aborts"] += 1
                self.stats["detected_stale" if is_stale else "early_aborts"] += int(True)
                self.stats["stale_reads"] += int(is_stale)
                self.guarded(self.alloc.abort, r)
                del self.expected[r]
                continue
            self.stats["reads"] += 1
            if self.stale(batch.block_table[b], n, ids):
                self.stats["stale_reads"] += 1
                self.stats["undetected_stale"] += 1

    def fork(self, src, n):
        if src not in self.expected or self.halted:
            return
        n = min(n, len(self.expected[src]))
        dst = self.new_id()
        self.alloc.fork(src, dst, n)
        self.expected[dst] = self.expected[src][:n]

    def retain(self, src, n):
        if src not in self.expected or self.halted:
            return
        n = min(n, len(self.expected[src]))
        self.prefixes.append((self.alloc.retain_prefix(src, n), self.expected[src][:n]))

    def fork_prefix(self, k):
        if self.prefixes and not self.halted:
            ref, ids = self.prefixes[k % len(self.prefixes)]
            dst = self.new_id()
            self.alloc.fork(ref, dst)
            self.expected[dst] = list(ids)

    def release(self, k):
        if self.prefixes and not self.halted:
            ref, _ = self.prefixes.pop(k % len(self.prefixes))
            self.guarded(self.alloc.release_prefix, ref)

    def free(self, r):
        if r in self.expected and not self.halted:
            del self.expected[r]
            self.guarded(self.alloc.free, r)

    # ---------------------------------------------------------------------------------- bugs
    def holders(self):
        return [r for r in self.expected if self.alloc.pages(r)]

    def inject_bug(self, kind, pick):
        if self.halted:
            return
        rng = random.Random(pick)
        alloc, held = self.alloc, self.holders()
        if kind in ("use_after_free", "swap", "double_free", "stale_prefix") and not held:
            return
        if kind == "use_after_free":                   # free a held page; it is reused first
            r = rng.choice(held)
            page = rng.choice(alloc.pages(r))
            alloc.refcount[page] = 0
            alloc._free.appendleft(page)
            alloc.tracker.release([page])
        elif kind == "double_free":                    # one owner finishes; a shared page is released twice
            shared = [r for r in held if any(alloc.refcount[p] > 1 for p in alloc.pages(r))]
            if not shared:
                return
            r = rng.choice(shared)
            page = rng.choice([p for p in alloc.pages(r) if alloc.refcount[p] > 1])
            self.free(r)
            if not self.halted:
                self.guarded(alloc._release_page, page)          # the second release
            if self.halted:
                return
            if alloc.refcount[page] == 0:                         # free while another owner reads it: reuse first
                alloc._free.remove(page)
                alloc._free.appendleft(page)
        elif kind == "off_by_one":
            self.table_bug = rng.random()
        elif kind == "stale_prefix":                   # a page-boundary prefix entry outlives its pages
            r = rng.choice(held)
            n = (len(self.expected[r]) // self.ps) * self.ps
            if n == 0:
                return
            ref, ids = self.alloc.retain_prefix(r, n), self.expected[r][:n]
            self.free(r)
            if self.halted:
                return
            self.guarded(self.alloc.release_prefix, ref)    # evicted by the prefix cache ...
            if self.halted:
                return
            self.add(self.alloc.num_free_pages * self.ps)   # ... its pages reused by a new request ...
            alloc._prefixes[ref.id] = ref               # ... but the entry is resurrected and hit
            dst = self.new_id()
            alloc.fork(ref, dst)
            self.expected[dst] = list(ids)
            self.step([dst], [1])
        elif kind == "swap":                           # two requests' page lists cross
            pairs = [(a, b) for a in held for b in held if a != b]
            if not pairs:
                return
            a, b = rng.choice(pairs)
            pa, pb = alloc._requests[a].pages, alloc._requests[b].pages
            i, j = rng.randrange(len(pa)), rng.randrange(len(pb))
            pa[i], pb[j] = pb[j], pa[i]
        self.stats["injections"] += 1
        self.stats[f"injected_{kind}"] += 1

    def corrupt_table(self, batch):
        rng = random.Random(self.table_bug)
        self.table_bug = None
        pages = (batch.seq_lens.long() + self.ps - 1) // self.ps
        rows = [b for b in range(batch.batch_size) if int(pages[b]) > 0]
        if not rows:
            return
        b = rng.choice(rows)
        i = rng.randrange(int(pages[b]))
        if i > 0 and rng.random() < 0.5:
            batch.block_table[b, i] = batch.block_table[b, i - 1]     # the previous entry's page
        else:
            batch.block_table[b, i] += 1                              # the next page id

    def check_clean(self):
        assert self.stats["undetected_stale"] == 0, self.stats
        if not self.inject:
            assert self.stats["aborts"] == 0 and self.stats["stale_reads"] == 0, self.stats
            self.alloc.check_invariants()


class CleanSchedule(RuleBasedStateMachine):
    """Correct schedules: no request ever aborts, the invariants always hold."""

    inject = False

    def __init__(self):
        super().__init__()
        self.h: Harness | None = None

    @initialize(page_size=st.sampled_from([1, 4, 16, 64]), pages=st.integers(4, 40))
    def setup(self, page_size, pages):
        self.h = Harness(page_size, pages * max(1, 16 // page_size), self.inject)

    @rule(n=st.integers(0, 120))
    def add(self, n):
        self.h.add(n)

    @rule(mask=st.integers(1, 2**12), lens=st.integers(0, 2**12))
    def step(self, mask, lens):
        live = sorted(self.h.expected)
        reqs = [r for i, r in enumerate(live) if (mask >> (i % 12)) & 1]
        self.h.step(reqs, [1 + ((lens >> (2 * (i % 6))) & 3) for i in range(len(reqs))])

    @rule(pick=st.integers(0, 2**16), n=st.integers(0, 200), boundary=st.booleans())
    def fork(self, pick, n, boundary):
        live = sorted(self.h.expected)
        if live:
            src = live[pick % len(live)]
            self.h.fork(src, (n // self.h.ps) * self.h.ps if boundary else n)

    @rule(pick=st.integers(0, 2**16), n=st.integers(0, 200))
    def retain(self, pick, n):
        live = sorted(self.h.expected)
        if live:
            self.h.retain(live[pick % len(live)], n)

    @rule(k=st.integers(0, 2**16))
    def fork_prefix(self, k):
        self.h.fork_prefix(k)

    @rule(k=st.integers(0, 2**16))
    def release(self, k):
        self.h.release(k)

    @rule(pick=st.integers(0, 2**16))
    def free(self, pick):
        live = sorted(self.h.expected)
        if live:
            self.h.free(live[pick % len(live)])

    @invariant()
    def no_stale_read_goes_unnoticed(self):
        if self.h is not None:
            self.h.check_clean()


class BuggySchedule(CleanSchedule):
    """The same schedules with injected bookkeeping bugs: every stale read is caught before it happens."""

    inject = True

    @precondition(lambda self: self.h is not None and not self.h.halted)
    @rule(kind=st.sampled_from(BUGS), pick=st.integers(0, 2**31))
    def inject_bug(self, kind, pick):
        self.h.inject_bug(kind, pick)


TestCleanSchedules = CleanSchedule.TestCase
TestCleanSchedules.settings = settings(settings.default, stateful_step_count=40)
TestBuggySchedules = BuggySchedule.TestCase
TestBuggySchedules.settings = settings(settings.default, stateful_step_count=40)


# ============================================================================================ rates
def run_schedules(n_schedules: int, ops_per_schedule: int, bug: str | None, seed: int = 0) -> dict:
    """Random schedules (a plain seeded driver over the same rules), injecting only ``bug`` (None: none);
    aggregated counts."""
    total: dict = {}
    rng = random.Random(seed)
    for _ in range(n_schedules):
        ps = rng.choice([1, 4, 16, 64])
        h = Harness(ps, rng.randint(4, 40) * max(1, 16 // ps), inject=bug is not None)
        for _ in range(ops_per_schedule):
            live = sorted(h.expected)
            op = rng.choices(["add", "step", "fork", "retain", "fork_prefix", "release", "free", "bug"],
                             [2, 6, 1, 1, 1, 1, 1, 0 if bug is None else 1])[0]
            if op == "add" or not live:
                h.add(rng.randint(0, 120))
            elif op == "step":
                reqs = rng.sample(live, rng.randint(1, len(live)))
                h.step(reqs, [rng.randint(1, 4) for _ in reqs])
            elif op == "fork":
                n = rng.randint(0, 200)
                h.fork(rng.choice(live), (n // ps) * ps if rng.random() < 0.5 else n)
            elif op == "retain":
                h.retain(rng.choice(live), rng.randint(0, 200))
            elif op == "fork_prefix":
                h.fork_prefix(rng.randrange(2**16))
            elif op == "release":
                h.release(rng.randrange(2**16))
            elif op == "free":
                h.free(rng.choice(live))
            else:
                h.inject_bug(bug, rng.randrange(2**31))
            if h.halted:
                break
        # the run ends with one decode step over every request left: pending stale reads surface now
        h.step(sorted(h.expected), [1] * len(h.expected))
        h.check_clean()
        for k, v in h.stats.items():
            total[k] = total.get(k, 0) + v
    total["schedules"] = n_schedules
    return total


def _rates(n: int) -> dict:
    """``n`` clean schedules and ``n`` per bug class, 60 operations each."""
    clean = run_schedules(n, 60, None, seed=1)
    out = {"schedules_per_class": n, "ops_per_schedule": 60,
           "clean": {"reads": clean["reads"], "steps": clean["steps"], "aborts": clean["aborts"],
                     "false_positive_rate": clean["aborts"] / max(clean["reads"] + clean["aborts"], 1)}}
    for i, bug in enumerate(BUGS):
        got = run_schedules(n, 60, bug, seed=2 + i)
        out[bug] = {k: got[k] for k in ("injections", "stale_reads", "detected_stale", "undetected_stale",
                                         "early_aborts", "guard_stops", "reads")}
        out[bug]["detection_rate"] = got["detected_stale"] / got["stale_reads"] if got["stale_reads"] else None
    print(json.dumps(out, indent=1))
    path = os.environ.get("MLA_QUANT_TAG_RATES")
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    assert clean["aborts"] == 0 and clean["stale_reads"] == 0
    for bug in BUGS:
        assert out[bug]["undetected_stale"] == 0 and out[bug]["injections"] > 0
    assert sum(out[b]["stale_reads"] for b in BUGS) > n // 2, "the injected bugs must actually cause stale reads"
    return out


def test_detection_and_false_positive_rates():
    _rates(12)


@pytest.mark.slow
def test_detection_and_false_positive_rates_thousands_of_schedules():
    _rates(1000)


def test_tags_off_the_same_bugs_go_unnoticed():
    """With the no-op tracker the injected bugs produce stale reads that nobody notices: the harness sees them."""
    h = Harness(4, 16, inject=True)
    h.alloc = PageAllocator(16, 4, tracker=NoopTagTracker())
    h.add(8)
    h.add(8)
    a, b = sorted(h.expected)
    pa, pb = h.alloc._requests[a].pages, h.alloc._requests[b].pages
    pa[0], pb[0] = pb[0], pa[0]
    h.step([a, b], [1, 1])
    assert h.stats["undetected_stale"] == 2


def test_page_tags_follow_the_cache_device():
    cache = PagedKVCache(1, 8, 4, 32, 16)
    alloc = PageAllocator(cache=cache)
    assert alloc.tracker.page_tags.device == cache.device and alloc.tracker.page_tags.dtype == torch.int64
