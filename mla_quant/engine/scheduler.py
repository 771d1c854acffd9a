"""Who runs in the next step, and on which pages (docs/engine.md).

Host-side only: the scheduler moves requests between states and asks the pools' ``PageAllocator``s for pages;
the engine runs the models. Per step:

* **decode**: every request in the decode state extends by one token, all or nothing (``allocator.plan``).
  When the pages run out, unreferenced prefix-cache pages are released first, then the most recently
  admitted request of that pool is *preempted*: its pages are freed and it goes back to the front of the
  queue, to be recomputed from its tokens (prompt + outputs so far). The oldest request always progresses.
* **prefill**: chunks of at most ``max_num_batched_tokens`` tokens in all. Requests already prefilling
  continue first (as far as free pages allow); then waiting requests are admitted in arrival order while the
  budget, ``max_num_seqs`` and the pages for their *whole* remaining prefill last (no admission that would
  stall half-way), keeping one free page in reserve per request admitted to the same pool (one pool only). A waiting
  request whose prompt shares full pages with one being prefilled waits for those pages instead of
  computing them again.
* **hand-off** (two pools): prefilled requests move to the decode pool, oldest first, while it keeps one
  free page per decoding request in reserve.

Prefix sharing: full pages of computed tokens are registered in a :class:`PrefixCache`, keyed exactly by
their token blocks (a trie of page-sized blocks, as vLLM's block hashes but without collisions); an admitted
request forks the longest cached run of full pages (``allocator.fork``) and computes only the rest. Only
full pages are shared, so no request ever writes into a shared page.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cache import OutOfPages, PageAllocator, PagedBatch, PrefixRef
from .request import Request, Status


@dataclass
class _Entry:
    id: int
    ref: PrefixRef
    blocks: int          # this entry stands for the first `blocks` pages of `ref`
    parent: int | None
    key: tuple
    children: int = 0


class PrefixCache:
    """Retained full pages of computed tokens, found again by their exact token blocks (LRU, leaves first).

    ``match`` finds the longest cached run of full pages that starts a token list; ``insert`` registers a
    request's computed full pages (one ``allocator.retain_prefix`` per call); ``evict`` releases the least
    recently used entry that no longer prefixes another one.
    """

    def __init__(self, allocator: PageAllocator):
        self.allocator, self.page_size = allocator, allocator.page_size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()   # LRU order, oldest first
        self._by_key: dict[tuple, int] = {}                         # (parent id, block tokens) -> entry id
        self._ref_users: dict[int, int] = {}                        # PrefixRef id -> entries using it
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _walk(self, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """Entry ids of the cached full blocks that start ``tokens`` (at most ``max_blocks``)."""
        ids, parent, ps = [], None, self.page_size
        for b in range(min(max_blocks, len(tokens) // ps)):
            eid = self._by_key.get((parent, tuple(tokens[b * ps:(b + 1) * ps])))
            if eid is None:
                break
            ids.append(eid)
            parent = eid
        return ids

    def match(self, tokens: Sequence[int], max_tokens: int) -> tuple[PrefixRef | None, int]:
        """(the retained prefix to fork, tokens it covers): the longest cached run of full pages starting
        ``tokens`` and no longer than ``max_tokens``. Marks the run as recently used."""
        ids = self._walk(tokens, max_tokens // self.page_size)
        if not ids:
            return None, 0
        for eid in ids:
            self._entries.move_to_end(eid)
        last = self._entries[ids[-1]]
        return last.ref, last.blocks * self.page_size

    def cached_blocks(self, tokens: Sequence[int], max_tokens: int) -> int:
        return len(self._walk(tokens, max_tokens // self.page_size))

    def insert(self, request_id, tokens: Sequence[int], num_computed: int) -> int:
        """Register the full pages of ``tokens[:num_computed]`` (computed, in ``request_id``'s pages) that are
        not cached yet. Returns the number of new entries."""
        blocks = num_computed // self.page_size
        known = self._walk(tokens, blocks)
        if len(known) == blocks:
            return 0
        ref = self.allocator.retain_prefix(request_id, blocks * self.page_size)
        parent = known[-1] if known else None
        for b in range(len(known), blocks):
            key = (parent, tuple(tokens[b * self.page_size:(b + 1) * self.page_size]))
            entry = _Entry(self._next_id, ref, b + 1, parent, key)
            self._next_id += 1
            self._entries[entry.id] = entry
            self._by_key[key] = entry.id
            if parent is not None:
                self._entries[parent].children += 1
            parent = entry.id
        self._ref_users[ref.id] = blocks - len(known)
        return blocks - len(known)

    def evict(self) -> bool:
        """Drop the least recently used leaf entry (releasing its pages once no entry uses them). False when
        the cache is empty."""
        leaf = next((e for e in self._entries.values() if e.children == 0), None)
        if leaf is None:
            return False
        del self._entries[leaf.id]
        del self._by_key[leaf.key]
        if leaf.parent is not None:
            self._entries[leaf.parent].children -= 1
        self._ref_users[leaf.ref.id] -= 1
        if self._ref_users[leaf.ref.id] == 0:
            del self._ref_users[leaf.ref.id]
            self.allocator.release_prefix(leaf.ref)
        return True

    def clear(self) -> None:
        while self.evict():
            pass


@dataclass(eq=False)
class Pool:
    """One model instance with its paged cache, page allocator and prefix cache (None: no sharing)."""

    name: str
    model: object
    cache: object                     # ModelCache (or PagedKVCache)
    allocator: PageAllocator
    prefix: PrefixCache | None = None

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@dataclass(eq=False)
class Scheduler:
    """Queues and page decisions for one prefill pool and one decode pool (the same pool when the recipe
    is symmetric). See the module docstring for the policy."""

    prefill: Pool
    decode: Pool
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 64
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)       # admitted requests, in admission order
    num_preemptions: int = 0
    num_cached_tokens: int = 0                         # prompt tokens forked from cached prefix pages

    @property
    def two_pools(self) -> bool:
        return self.prefill is not self.decode

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def in_state(self, status: Status) -> list[Request]:
        return [r for r in self.running if r.status is status]

    # ------------------------------------------------------------------------------------ page room
    @staticmethod
    def _room(pool: Pool, req: Request, free_pages: int) -> int:
        """Tokens ``req`` can add with its last page's room plus ``free_pages`` new pages."""
        a = pool.allocator
        return (len(a.pages(req.id)) + free_pages) * pool.page_size - a.num_tokens(req.id)

    @staticmethod
    def _new_pages(pool: Pool, req: Request, n: int) -> int:
        a = pool.allocator
        return pool.pages_for(a.num_tokens(req.id) + n) - len(a.pages(req.id))

    # ------------------------------------------------------------------------------------ leaving
    def release(self, req: Request) -> None:
        """Free a finished request's pages and drop it from the running list."""
        if req.pool is not None:
            req.pool.allocator.free(req.id)
        self._drop(req)

    def abort(self, req: Request) -> list[int]:
        """Free an aborted request's pages that still carry its tags; returns the pages it did not release
        (they belong to someone else now)."""
        kept = req.pool.allocator.abort(req.id) if req.pool is not None else []
        self._drop(req)
        if req in self.waiting:
            self.waiting.remove(req)
        return kept

    def _drop(self, req: Request) -> None:
        req.pool = None
        if req in self.running:
            self.running.remove(req)

    def preempt(self, req: Request) -> None:
        """Free ``req``'s pages and queue it first for recompute (its tokens are kept)."""
        self.release(req)
        req.num_computed, req.status = 0, Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _victim(self, pool: Pool) -> Request | None:
        """The most recently admitted request holding pages in ``pool``."""
        return next((r for r in reversed(self.running) if r.pool is pool), None)

    # ------------------------------------------------------------------------------------ decode
    def schedule_decode(self) -> tuple[list[Request], PagedBatch] | None:
        """The decode requests and their one-token step, after freeing pages as needed (module docstring)."""
        pool = self.decode
        reqs = self.in_state(Status.DECODE)
        while reqs:
            try:
                return reqs, pool.allocator.plan([r.id for r in reqs], 1)
            except OutOfPages:
                if pool.prefix is not None and pool.prefix.evict():
                    continue
                victim = self._victim(pool)
                self.preempt(victim)
                if victim in reqs:
                    reqs.remove(victim)
        return None

    # ------------------------------------------------------------------------------------ prefill
    def _defer(self, req: Request, cached_blocks: int) -> bool:
        """Whether a request being prefilled is about to compute more of ``req``'s full prompt pages than the
        prefix cache holds now (then ``req`` waits for them instead of computing them twice)."""
        ps = self.prefill.page_size
        limit = (req.prefill_target - 1) // ps
        for other in self.in_state(Status.PREFILL):
            common = 0
            while (common < min(limit, other.prefill_target // ps)
                   and req.tokens[common * ps:(common + 1) * ps] == other.tokens[common * ps:(common + 1) * ps]):
                common += 1
            if common > cached_blocks and other.num_computed < common * ps:
                return True
        return False

    def _admit(self, req: Request, outstanding: int) -> bool:
        """Give the head of the queue its pages in the prefill pool (forking cached prefix pages) if the pages
        of its whole remaining prefill are free beyond the ``outstanding`` pages that admitted prefills still
        need (evicting cached prefixes if needed). False: it stays queued."""
        pool, alloc = self.prefill, self.prefill.allocator
        ref, cached = (None, 0) if pool.prefix is None else pool.prefix.match(req.tokens, req.prefill_target - 1)
        if ref is None:
            alloc.add_request(req.id, 0)
        else:
            alloc.fork(ref, req.id, cached)
        # one page in reserve per request that will decode in this pool: admitting into the last free pages
        # would only preempt someone at the next decode step
        reserve = 0 if self.two_pools else sum(r.pool is pool for r in self.running)
        need = pool.pages_for(req.prefill_target) - len(alloc.pages(req.id))
        while need > alloc.num_free_pages - outstanding - reserve:
            if pool.prefix is None or not pool.prefix.evict():
                alloc.free(req.id)
                return False
        self.waiting.popleft()
        req.status, req.pool, req.num_computed = Status.PREFILL, pool, cached
        req.num_cached_tokens += cached
        self.num_cached_tokens += cached
        self.running.append(req)
        return True

    def schedule_prefill(self) -> tuple[list[Request], list[int], PagedBatch] | None:
        """Prefill chunks for this step: (requests, tokens each, the planned batch), or None."""
        pool, alloc = self.prefill, self.prefill.allocator
        budget, free = self.max_num_batched_tokens, alloc.num_free_pages
        reqs, counts = [], []
        prefilling = self.in_state(Status.PREFILL)
        for r in prefilling:
            n = min(budget, r.prefill_target - r.num_computed, self._room(pool, r, free))
            if n > 0:
                free -= self._new_pages(pool, r, n)
                budget -= n
                reqs.append(r)
                counts.append(n)
        # pages the admitted prefills still need in all (this step's chunks included)
        outstanding = sum(pool.pages_for(r.prefill_target) - len(alloc.pages(r.id)) for r in prefilling)
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if pool.prefix is not None and self._defer(r, pool.prefix.cached_blocks(r.tokens, r.prefill_target - 1)):
                break
            if not self._admit(r, outstanding):
                break
            outstanding += pool.pages_for(r.prefill_target) - len(alloc.pages(r.id))
            n = min(budget, r.prefill_target - r.num_computed)
            budget -= n
            reqs.append(r)
            counts.append(n)
        if not reqs:
            return None
        return reqs, counts, alloc.plan([r.id for r in reqs], counts)

    def prefilled(self, reqs: Sequence[Request], counts: Sequence[int]) -> None:
        """The step's chunks were computed: advance the requests and share their new full pages."""
        for r, n in zip(reqs, counts):
            r.num_computed += n
            if self.prefill.prefix is not None:
                self.prefill.prefix.insert(r.id, r.tokens, r.num_computed)

    def unstick(self) -> bool:
        """Nothing could run although requests are waiting: release cached prefixes, else preempt the youngest
        partly prefilled request. False when there was nothing to free."""
        prefix = self.prefill.prefix
        if prefix is not None and len(prefix):
            prefix.clear()
            return True
        victim = next((r for r in reversed(self.running) if r.status is Status.PREFILL), None)
        if victim is None:
            return False
        self.preempt(victim)
        return True

    # ------------------------------------------------------------------------------------ hand-off
    def schedule_handoffs(self) -> list[Request]:
        """Prefilled requests that get their pages in the decode pool now (oldest first, keeping one free
        page per decoding request in reserve). The engine copies their pages, then calls :meth:`handed_off`."""
        pool, moved = self.decode, []
        reserve = len(self.in_state(Status.DECODE))
        for r in self.in_state(Status.HANDOFF):
            need = pool.pages_for(r.num_computed)
            while pool.allocator.num_free_pages - need < reserve + len(moved):
                if pool.prefix is None or not pool.prefix.evict():
                    return moved
            pool.allocator.add_request(r.id, r.num_computed)
            moved.append(r)
        return moved

    def handed_off(self, req: Request) -> None:
        self.prefill.allocator.free(req.id)
        req.pool, req.status = self.decode, Status.DECODE


__all__ = ["Scheduler", "Pool", "PrefixCache"]
