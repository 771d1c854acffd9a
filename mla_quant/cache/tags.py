"""Generation tags on KV pages, checked before decode reads (docs/page_tags.md).

Every physical page carries a tag. The allocator gives a page a fresh tag each time it hands the page out
(and tag 0 while it is free); a request records the tag of every page it takes — its own, or a shared
prefix page, whose tag it inherits from the owner it forks. Before attention reads, :meth:`verify` checks in
one kernel launch, for the whole batch, that every page each request's block table points at still carries
the tag that request recorded. A page that was freed (tag 0) or handed to someone else (a newer tag) fails.
The step's writes are checked too: each new token must go to the slot its table gives, in a page no other
request or retained prefix holds (the tracker counts the holders of every page from the recorded tags, apart
from the allocator's reference counts, so a copy-on-write skipped through a wrong count is caught).

Tags are drawn from one int64 counter for the whole pool, so a tag is never reused: not by another page
(a wrong page id in a table can never show the right tag) and not by the same page later (no wrap-around:
2^63 allocations at a billion per second last 292 years). A match therefore proves both which page it is and
which allocation of it.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..kernels.page_tag_verify import page_tag_verify
from ._rows import IntRow, to_device

FREE_TAG = 0     # the tag of a page on the free list
STALE_TAG = -1   # recorded for a copy made from a page its request had already lost: never matches


class PageTagMismatch(RuntimeError):
    """Requests that were about to read pages they no longer own.

    ``requests``: the failing request ids; ``pages``: for each, a list of
    ``(entry, page_id, recorded_tag, current_tag)`` (``current_tag`` None for an out-of-range page id,
    ``entry`` = P and ``page_id`` None for a length that does not fit the table).
    """

    def __init__(self, requests: Sequence[Hashable], pages: dict):
        self.requests = list(requests)
        self.pages = dict(pages)
        shown = "; ".join(f"request {r!r}: " + ", ".join(
            f"entry {e} page {p} tag {want} now {have}" for e, p, want, have in self.pages.get(r, [])[:4])
            for r in self.requests[:8])
        more = f" (+{len(self.requests) - 8} more)" if len(self.requests) > 8 else ""
        super().__init__(f"page tag mismatch for {len(self.requests)} request(s){more}: {shown}")


class PageTagTracker:
    """Current tag of every page (on the device, mirrored on the host) and the tags each request recorded.

    Args:
        num_pages, page_size: the page pool (the same as the allocator's).
        device: where ``page_tags`` lives (the cache's device); verify runs there.
    """

    enabled = True

    def __init__(self, num_pages: int, page_size: int, device: torch.device | str = "cpu"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages {num_pages} and page_size {page_size} must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self.device = torch.device(device)
        self.page_tags = torch.zeros(num_pages, dtype=torch.int64, device=self.device)     # [num_pages]
        self.page_holders = torch.zeros(num_pages, dtype=torch.int64, device=self.device)  # [num_pages]
        self._host_tags = [FREE_TAG] * num_pages
        self._host_holders = [0] * num_pages
        self._next_tag = FREE_TAG + 1
        self._dirty: set[int] = set()                    # pages whose tag or holders changed since flush
        self._records: dict[Hashable, IntRow] = {}       # request or prefix key -> recorded tag per entry
        self._holders: dict[int, int] = {}               # tag -> records holding it
        self._tag_page: dict[int, int] = {}              # current tag -> its page

    # -------------------------------------------------------------------------- allocator hooks (host)
    def _set_page(self, page: int, tag: int) -> None:
        self._tag_page.pop(self._host_tags[page], None)
        self._host_tags[page] = tag
        if tag != FREE_TAG:
            self._tag_page[tag] = page
        self._host_holders[page] = self._holders.get(tag, 0) if tag != FREE_TAG else 0
        self._dirty.add(page)

    def _count(self, tag: int, delta: int) -> None:
        self._holders[tag] = self._holders.get(tag, 0) + delta
        if self._holders[tag] == 0:
            del self._holders[tag]
        page = self._tag_page.get(tag)
        if page is not None:
            self._host_holders[page] = self._holders.get(tag, 0)
            self._dirty.add(page)

    def assign(self, pages: Sequence[int]) -> list[int]:
        """Fresh tags for newly allocated pages; returns them."""
        tags = list(range(self._next_tag, self._next_tag + len(pages)))
        self._next_tag += len(pages)
        for p, t in zip(pages, tags):
            self._set_page(p, t)
        return tags

    def release(self, pages: Sequence[int]) -> None:
        """Pages returned to the free list: tag 0, so a reader still holding one fails even before reuse."""
        for p in pages:
            self._set_page(p, FREE_TAG)

    def record(self, holder: Hashable, tags: Sequence[int]) -> None:
        """``holder`` (a request, or a retained prefix) took pages carrying these tags, appended to its table."""
        tags = [int(t) for t in tags]
        if holder not in self._records:
            self._records[holder] = IntRow(dtype=torch.int64)
        self._records[holder].extend(tags)
        for t in tags:
            self._count(t, +1)

    def replace(self, holder: Hashable, entry: int, tag: int) -> None:
        """Entry ``entry`` of ``holder``'s table now holds a page with ``tag`` (copy-on-write)."""
        rec = self._records[holder]
        self._count(rec[entry], -1)
        rec[entry] = int(tag)
        self._count(rec[entry], +1)

    def forget(self, holder: Hashable) -> None:
        for t in self._records.pop(holder, ()):
            self._count(t, -1)

    def recorded(self, holder: Hashable) -> list[int]:
        rec = self._records.get(holder)
        return rec.tolist() if rec is not None else []

    def current(self, page: int) -> int:
        return self._host_tags[page]

    def holders(self, page: int) -> int:
        """Records (requests and retained prefixes) that hold ``page`` at its current tag."""
        return self._host_holders[page]

    def owns(self, holder: Hashable, entry: int, page: int) -> bool:
        """Whether ``page`` at ``entry`` still carries the tag ``holder`` recorded (host-side)."""
        rec = self._records.get(holder, ())
        return 0 <= page < self.num_pages and entry < len(rec) and self._host_tags[page] == rec[entry]

    # -------------------------------------------------------------------------- device side
    def flush(self) -> None:
        """Copy the tags and holder counts changed since the last flush to ``page_tags`` / ``page_holders``
        (one small H2D copy and two scatters)."""
        if not self._dirty:
            return
        pages = sorted(self._dirty)
        update = torch.tensor([pages, [self._host_tags[p] for p in pages], [self._host_holders[p] for p in pages]],
                              dtype=torch.int64)                             # [3, n]: pages, tags, holders
        update = to_device(update, self.device)
        self.page_tags.index_copy_(0, update[0], update[1])
        self.page_holders.index_copy_(0, update[0], update[2])
        self._dirty.clear()

    def recorded_table(self, requests: Sequence[Hashable], max_pages: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
        """Recorded tags ``[B, max_pages]`` int64 aligned with the requests' block-table rows (0 past the end)."""
        table = torch.zeros(len(requests), max_pages, dtype=torch.int64)
        for i, r in enumerate(requests):
            if r not in self._records:
                raise KeyError(f"request {r!r} has no recorded page tags (unknown to the tracker)")
            rec = self._records[r].view()[:max_pages]
            table[i, :rec.numel()] = rec
        return to_device(table, self.device if device is None else device)

    def verify(self, requests: Sequence[Hashable], block_table: torch.Tensor, seq_lens: torch.Tensor,
               recorded_tags: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
               slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
        """Failing requests as a device bool mask ``[B]`` (one kernel launch, no host sync).

        ``recorded_tags`` ``[B, max_pages]`` (``PagedBatch.tags``) saves building it from the records.
        ``cu_seqlens_q`` / ``slot_mapping`` (the step's writes) are checked against the table too, and must not
        go into a page another request or prefix still holds (a copy-on-write that did not happen).
        """
        self.flush()
        if recorded_tags is None:
            recorded_tags = self.recorded_table(requests, block_table.shape[1], block_table.device)
        return page_tag_verify(block_table, seq_lens, recorded_tags, self.page_tags, self.page_size,
                               cu_seqlens_q, slot_mapping, self.page_holders if slot_mapping is not None else None)

    def verify_batch(self, batch) -> torch.Tensor:
        """:meth:`verify` for a ``PagedBatch`` built by ``PageAllocator.plan`` (its reads and its writes)."""
        return self.verify(batch.request_ids, batch.block_table, batch.seq_lens, batch.tags,
                           batch.cu_seqlens_q, batch.slot_mapping)

    def check(self, batch, on_mismatch: str = "raise") -> list:
        """Verify a ``PagedBatch`` and act on the host (one sync): ``"raise"`` raises :class:`PageTagMismatch`;
        ``"abort"`` returns the failing request ids (the caller aborts them, the others go on)."""
        if on_mismatch not in ("raise", "abort"):
            raise ValueError(f"on_mismatch: {on_mismatch!r} must be 'raise' or 'abort'")
        failed = self.verify_batch(batch).cpu()
        if not bool(failed.any()):
            return []
        ids = [batch.request_ids[i] for i in failed.nonzero().flatten().tolist()]
        if on_mismatch == "abort":
            return ids
        raise self.mismatch(batch.request_ids, batch.block_table, batch.seq_lens, failed)

    def mismatch(self, requests, block_table, seq_lens, failed) -> PageTagMismatch:
        """Build the error for the failing rows (host-side details: which entries, pages and tags)."""
        bt, sl, failed = block_table.cpu(), seq_lens.cpu(), failed.cpu()
        details = {}
        for i in failed.nonzero().flatten().tolist():
            r = requests[i]
            rec = self._records.get(r, [])
            n = -(-int(sl[i]) // self.page_size)
            rows = []
            if int(sl[i]) < 0 or n > bt.shape[1]:
                rows.append((bt.shape[1], None, None, None))
            for e in range(min(max(n, 0), bt.shape[1])):
                p = int(bt[i, e])
                want = rec[e] if e < len(rec) else None
                have = self._host_tags[p] if 0 <= p < self.num_pages else None
                if have is None or have != want:
                    rows.append((e, p, want, have))
            details[r] = rows
        return PageTagMismatch([requests[i] for i in failed.nonzero().flatten().tolist()], details)


class NoopTagTracker:
    """The tracker switched off: same interface, no records, no device work; every request passes."""

    enabled = False

    def __init__(self, num_pages: int | None = None, page_size: int | None = None, device=None):
        self.num_pages, self.page_size = num_pages, page_size

    def assign(self, pages: Sequence[int]) -> list[int]:
        return [FREE_TAG] * len(pages)

    def release(self, pages: Sequence[int]) -> None:
        pass

    def record(self, request: Hashable, tags: Sequence[int]) -> None:
        pass

    def replace(self, request: Hashable, entry: int, tag: int) -> None:
        pass

    def forget(self, request: Hashable) -> None:
        pass

    def recorded(self, request: Hashable) -> list[int]:
        return []

    def current(self, page: int) -> int:
        return FREE_TAG

    def holders(self, page: int) -> int:
        return 0

    def owns(self, request: Hashable, entry: int, page: int) -> bool:
        return True

    def flush(self) -> None:
        pass

    def verify(self, requests, block_table: torch.Tensor, seq_lens=None, recorded_tags=None,
               cu_seqlens_q=None, slot_mapping=None) -> torch.Tensor:
        return torch.zeros(block_table.shape[0], dtype=torch.bool, device=block_table.device)

    def verify_batch(self, batch) -> torch.Tensor:
        return self.verify(batch.request_ids, batch.block_table)

    def check(self, batch, on_mismatch: str = "raise") -> list:
        if on_mismatch not in ("raise", "abort"):
            raise ValueError(f"on_mismatch: {on_mismatch!r} must be 'raise' or 'abort'")
        return []
