"""Page allocator over the page pool that all layers share (docs/kv_cache.md, "Allocator").

Host-side bookkeeping, as in vLLM's block manager and SGLang's token pools: a FIFO free list, a reference
count per page, and per request the ordered list of its pages and its token count. Requests share prefix
pages by reference (:meth:`PageAllocator.fork`); a page that is shared and not full is copied before a
request writes into it (copy-on-write, through the cache for every layer). Allocation is all-or-nothing:
:class:`OutOfPages` leaves every request's pages, tables and tags as they were.

Each allocation gives the page a fresh generation tag and each request records the tags of the pages it
takes (:mod:`.tags`), so ``PageTagTracker.verify`` can stop a request before it reads a page it lost.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

import torch

from ._rows import IntRow, to_device
from .batch import PagedBatch
from .paged import PagedKVCache, check_page_size
from .tables import block_table_to_csr
from .tags import STALE_TAG, NoopTagTracker, PageTagTracker


class OutOfPages(RuntimeError):
    """Not enough free pages; nothing was allocated (every request's pages and tables are unchanged)."""

    def __init__(self, needed: int, free: int, what: str = ""):
        self.needed, self.free = needed, free
        super().__init__(f"out of KV pages{': ' + what if what else ''}: need {needed}, {free} free")


class UnknownRequest(KeyError):
    def __str__(self) -> str:  # KeyError would print the repr of its message
        return str(self.args[0])


@dataclass(frozen=True)
class PrefixRef:
    """A retained prefix: the first ``num_tokens`` tokens of a request, with a reference on each of its pages
    (so they outlive the request) and the tags recorded for them. Fork new requests from it; release it with
    ``PageAllocator.release_prefix``."""

    pages: tuple[int, ...]
    tags: tuple[int, ...]
    num_tokens: int
    id: int


@dataclass
class _Request:
    pages: IntRow = field(default_factory=IntRow)   # physical page ids, in order
    num_tokens: int = 0


class PageAllocator:
    """Pages of a ``page_size``-token pool shared by every layer of ``cache``.

    Args:
        num_pages, page_size: the pool (``cache.num_pages`` / ``cache.page_size`` when a cache is given).
        cache: the ``PagedKVCache`` whose pages copy-on-write copies (or any object with ``num_pages``,
            ``page_size``, ``device`` and ``copy_pages(src, dst)``, e.g. a model's latent + indexer cache);
            None keeps the copies in :attr:`pending_copies` for the caller (bookkeeping only).
        tracker: a ``PageTagTracker`` (default: one on the cache's device — tags on) or ``NoopTagTracker()``.
    Request ids are any hashable values.
    """

    def __init__(self, num_pages: int | None = None, page_size: int | None = None,
                 cache: PagedKVCache | None = None, tracker: PageTagTracker | NoopTagTracker | None = None):
        if cache is not None:
            if num_pages not in (None, cache.num_pages) or page_size not in (None, cache.page_size):
                raise ValueError(f"num_pages/page_size: {num_pages}/{page_size} disagree with the cache "
                                 f"({cache.num_pages}/{cache.page_size})")
            num_pages, page_size = cache.num_pages, cache.page_size
        if num_pages is None or num_pages < 1:
            raise ValueError(f"num_pages: {num_pages} must be at least 1")
        page_size = 64 if page_size is None else page_size
        check_page_size(page_size)
        self.num_pages, self.page_size, self.cache = num_pages, page_size, cache
        if tracker is None:
            tracker = PageTagTracker(num_pages, page_size, cache.device if cache is not None else "cpu")
        if tracker.num_pages not in (None, num_pages) or tracker.page_size not in (None, page_size):
            raise ValueError(f"tracker: built for {tracker.num_pages} pages of {tracker.page_size}, "
                             f"the pool has {num_pages} of {page_size}")
        self.tracker = tracker
        self.refcount = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._requests: dict[Hashable, _Request] = {}
        self._prefixes: dict[int, PrefixRef] = {}
        self._prefix_ids = count()
        self.pending_copies: list[tuple[int, int]] = []   # (src page, dst page), when there is no cache

    # ------------------------------------------------------------------------------------- queries
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def requests(self) -> list[Hashable]:
        return list(self._requests)

    def __contains__(self, request: Hashable) -> bool:
        return request in self._requests

    def _get(self, request: Hashable) -> _Request:
        try:
            return self._requests[request]
        except KeyError:
            raise UnknownRequest(f"request {request!r} is not allocated") from None

    def num_tokens(self, request: Hashable) -> int:
        return self._get(request).num_tokens

    def pages(self, request: Hashable) -> list[int]:
        return self._get(request).pages.tolist()

    def slots(self, request: Hashable, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Physical slots ``int64 [stop - start]`` of tokens ``start..stop`` of a request."""
        req = self._get(request)
        stop = req.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= req.num_tokens:
            raise ValueError(f"start/stop: [{start}, {stop}) outside the request's {req.num_tokens} tokens")
        ps, pages = self.page_size, req.pages
        return torch.tensor([pages[j // ps] * ps + j % ps for j in range(start, stop)], dtype=torch.long)

    # ------------------------------------------------------------------------------------- page moves
    def _take_free(self, n: int) -> list[int]:
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            if self.refcount[p] != 0:
                raise RuntimeError(f"allocator corrupted: page {p} on the free list has {self.refcount[p]} owners")
            self.refcount[p] = 1
        return pages

    def _release_page(self, page: int) -> None:
        if self.refcount[page] <= 0:
            raise RuntimeError(f"double free of page {page}")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self._free.append(page)
            self.tracker.release([page])

    def _needs_copy(self, req: _Request) -> bool:
        """The request's last page is partial and shared: it must be copied before the request writes."""
        return bool(req.pages) and req.num_tokens % self.page_size != 0 and self.refcount[req.pages[-1]] > 1

    def _new_pages_for(self, req: _Request, n: int) -> int:
        return -(-(req.num_tokens + n) // self.page_size) - len(req.pages)

    def _grow(self, request: Hashable, req: _Request, n: int) -> torch.Tensor:
        """Extend by ``n`` tokens (pages already known to be available); returns their slots."""
        if n > 0 and self._needs_copy(req):
            entry, old = len(req.pages) - 1, req.pages[-1]
            owned = self.tracker.owns(request, entry, old)   # a copy must not launder a lost page
            (new,) = self._take_free(1)
            self.pending_copies.append((old, new))
            self.refcount[old] -= 1   # still >= 1: the other owners keep it
            req.pages[-1] = new
            tag = self.tracker.assign([new])[0]
            self.tracker.replace(request, entry, tag if owned else STALE_TAG)
        fresh = self._take_free(self._new_pages_for(req, n))
        req.pages.extend(fresh)
        self.tracker.record(request, self.tracker.assign(fresh))
        start = req.num_tokens
        req.num_tokens += n
        return self.slots(request, start, start + n)

    def _flush_copies(self) -> None:
        if self.cache is not None and self.pending_copies:
            src, dst = zip(*self.pending_copies)
            self.cache.copy_pages(list(src), list(dst))
            self.pending_copies.clear()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) page copies the caller must do before the next writes (only without a cache)."""
        out, self.pending_copies = self.pending_copies, []
        return out

    def _pages_needed(self, requests: Sequence[Hashable], new_tokens: Sequence[int]) -> int:
        """Free pages a step needs: new pages plus copies of shared partial pages (the last owner of a shared
        page to write keeps it)."""
        refs: dict[int, int] = {}
        need = 0
        for r, n in zip(requests, new_tokens):
            req = self._get(r)
            if n <= 0:
                continue
            need += self._new_pages_for(req, n)
            if req.pages and req.num_tokens % self.page_size:
                last = req.pages[-1]
                left = refs.get(last, self.refcount[last])
                if left > 1:
                    need += 1
                    refs[last] = left - 1
        return need

    # ------------------------------------------------------------------------------------- requests
    def add_request(self, request: Hashable, num_tokens: int = 0) -> torch.Tensor:
        """A new request with room for ``num_tokens`` tokens; returns their slots ``int64 [num_tokens]``."""
        if request in self._requests:
            raise ValueError(f"request {request!r} already exists")
        if num_tokens < 0:
            raise ValueError(f"num_tokens: {num_tokens} must be >= 0")
        need = -(-num_tokens // self.page_size)
        if need > len(self._free):
            raise OutOfPages(need, len(self._free), f"request {request!r}")
        self._requests[request] = req = _Request()
        self.tracker.record(request, [])
        return self._grow(request, req, num_tokens)

    def extend(self, request: Hashable, num_tokens: int) -> torch.Tensor:
        """Room for ``num_tokens`` more tokens; returns their slots ``int64 [num_tokens]`` (all or nothing)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: {num_tokens} must be >= 0")
        need = self._pages_needed([request], [num_tokens])
        if need > len(self._free):
            raise OutOfPages(need, len(self._free), f"request {request!r}")
        slots = self._grow(request, self._get(request), num_tokens)
        self._flush_copies()
        return slots

    def fork(self, src: Hashable | PrefixRef, dst: Hashable, num_tokens: int | None = None) -> None:
        """New request ``dst`` sharing the first ``num_tokens`` tokens (default all) of request ``src`` or of a
        retained :class:`PrefixRef`: it references the same pages (no copy, no new page) and inherits their
        recorded tags. A partial last page is copied when either owner writes into it."""
        if dst in self._requests:
            raise ValueError(f"request {dst!r} already exists")
        if isinstance(src, PrefixRef):
            if self._prefixes.get(src.id) != src:
                raise ValueError(f"src: prefix {src.id} was released")
            pages, tags, total = list(src.pages), list(src.tags), src.num_tokens
        else:
            req = self._get(src)
            pages, tags, total = req.pages.tolist(), self.tracker.recorded(src), req.num_tokens
        n = total if num_tokens is None else num_tokens
        if not 0 <= n <= total:
            raise ValueError(f"num_tokens: {n} outside the source's {total} tokens")
        k = -(-n // self.page_size)
        for p in pages[:k]:
            self.refcount[p] += 1
        self._requests[dst] = _Request(IntRow(pages[:k]), n)
        self.tracker.record(dst, tags[:k])

    def retain_prefix(self, request: Hashable, num_tokens: int | None = None) -> PrefixRef:
        """Hold the pages of a request's first ``num_tokens`` tokens (e.g. for a prefix cache) until
        :meth:`release_prefix`, with their recorded tags."""
        req = self._get(request)
        n = req.num_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= req.num_tokens:
            raise ValueError(f"num_tokens: {n} outside the request's {req.num_tokens} tokens")
        k = -(-n // self.page_size)
        tags = self.tracker.recorded(request)[:k] if self.tracker.enabled else [0] * k
        ref = PrefixRef(tuple(req.pages[:k]), tuple(tags), n, next(self._prefix_ids))
        for p in ref.pages:
            self.refcount[p] += 1
        self._prefixes[ref.id] = ref
        self.tracker.record(ref, ref.tags)     # a holder of its pages, like a request
        return ref

    def release_prefix(self, prefix: PrefixRef) -> None:
        if self._prefixes.get(prefix.id) != prefix:
            raise ValueError(f"prefix: {prefix.id} is not retained (released twice?)")
        del self._prefixes[prefix.id]
        self.tracker.forget(prefix)
        for p in prefix.pages:
            self._release_page(p)

    def free(self, request: Hashable) -> None:
        """Release a finished request's pages (shared pages stay with their other owners)."""
        req = self._get(request)
        del self._requests[request]
        for p in req.pages:
            self._release_page(p)
        self.tracker.forget(request)

    def abort(self, request: Hashable) -> list[int]:
        """Release a request that failed its tag check: only the pages that still carry the tags it recorded
        (the others belong to someone else now and are left alone). Returns the pages it did not release."""
        req = self._get(request)
        owned = [self.tracker.owns(request, i, p) for i, p in enumerate(req.pages)]
        del self._requests[request]
        for p, mine in zip(req.pages, owned):
            if mine:
                self._release_page(p)
        self.tracker.forget(request)
        return [p for p, mine in zip(req.pages, owned) if not mine]

    # ------------------------------------------------------------------------------------- tables
    def block_table(self, requests: Sequence[Hashable], device: torch.device | str = "cpu",
                    max_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table int32 ``[B, max_pages]`` padded with -1, seq_lens int32 ``[B]``) for these requests."""
        reqs = [self._get(r) for r in requests]
        width = max([len(q.pages) for q in reqs] + [1]) if max_pages is None else max_pages
        if any(len(q.pages) > width for q in reqs):
            raise ValueError(f"max_pages: {width} is smaller than a request's {max(len(q.pages) for q in reqs)} pages")
        table = torch.full((len(reqs), width), -1, dtype=torch.int32)
        for i, q in enumerate(reqs):
            table[i, :len(q.pages)] = q.pages.view()
        seq_lens = torch.tensor([q.num_tokens for q in reqs], dtype=torch.int32)
        return to_device(table, device), to_device(seq_lens, device)

    def csr(self, requests: Sequence[Hashable], device: torch.device | str = "cpu"):
        """(kv_indptr, kv_indices, kv_last_page_len), int32, as flashinfer takes them."""
        table, seq_lens = self.block_table(requests, device)
        return block_table_to_csr(table, seq_lens, self.page_size)

    def plan(self, requests: Sequence[Hashable], new_tokens: Sequence[int] | int = 1,
             device: torch.device | str | None = None, max_pages: int | None = None) -> PagedBatch:
        """Make room for a step's new tokens (``new_tokens`` per request, or one count for all) and return the
        step's :class:`PagedBatch` (tables after the append, the new tokens' positions and slots, the recorded
        tags). All or nothing: on :class:`OutOfPages` no request changed."""
        requests = list(requests)
        if len(set(requests)) != len(requests):
            raise ValueError("requests: a request appears twice in one step")
        counts = [new_tokens] * len(requests) if isinstance(new_tokens, int) else [int(n) for n in new_tokens]
        if len(counts) != len(requests):
            raise ValueError(f"new_tokens: {len(counts)} counts for {len(requests)} requests")
        if any(n < 0 for n in counts):
            raise ValueError("new_tokens: counts must be >= 0")
        need = self._pages_needed(requests, counts)
        if need > len(self._free):
            raise OutOfPages(need, len(self._free), f"a step of {len(requests)} requests")
        device = torch.device(device if device is not None else (self.cache.device if self.cache else "cpu"))
        slots, positions = [], []
        for r, n in zip(requests, counts):
            req = self._get(r)
            positions.append(torch.arange(req.num_tokens, req.num_tokens + n))
            slots.append(self._grow(r, req, n))
        self._flush_copies()
        table, seq_lens = self.block_table(requests, device, max_pages)
        cu = torch.zeros(len(requests) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
        tags = (self.tracker.recorded_table(requests, table.shape[1], device) if self.tracker.enabled else None)
        empty = torch.zeros(0, dtype=torch.long)
        return PagedBatch(
            block_table=table, seq_lens=seq_lens, cu_seqlens_q=to_device(cu, device),
            positions=to_device(torch.cat(positions or [empty]), device),
            slot_mapping=to_device(torch.cat(slots or [empty]), device),
            page_size=self.page_size, max_query_len=max(counts, default=0), request_ids=tuple(requests), tags=tags)

    # ------------------------------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Recount every reference and compare (host-side, O(pages); for tests and debugging): reference
        counts, the free list, and (with a tracker) that every held page carries a live tag."""
        counts = [0] * self.num_pages
        for req in self._requests.values():
            if len(req.pages) != -(-req.num_tokens // self.page_size):
                raise AssertionError(f"a request holds {len(req.pages)} pages for {req.num_tokens} tokens")
            for p in req.pages:
                counts[p] += 1
        for ref in self._prefixes.values():
            for p in ref.pages:
                counts[p] += 1
        if counts != self.refcount:
            bad = next(p for p in range(self.num_pages) if counts[p] != self.refcount[p])
            raise AssertionError(f"page {bad}: refcount {self.refcount[bad]}, {counts[bad]} references")
        free = list(self._free)
        if len(set(free)) != len(free) or set(free) != {p for p in range(self.num_pages) if counts[p] == 0}:
            raise AssertionError("free list differs from the unreferenced pages")
        if self.tracker.enabled:
            for p in range(self.num_pages):
                if (self.tracker.current(p) == 0) != (counts[p] == 0) or self.tracker.holders(p) != counts[p]:
                    raise AssertionError(f"page {p}: tag {self.tracker.current(p)} held by "
                                         f"{self.tracker.holders(p)} records, {counts[p]} references")
