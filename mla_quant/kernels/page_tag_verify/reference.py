"""Pure-torch reference of ``page_tag_verify``: which requests of a batch would read a page that is not
the one they took (a stale or foreign page), or write a new token elsewhere than where they read it."""
from __future__ import annotations

import torch


def page_tag_verify_reference(block_table: torch.Tensor, seq_lens: torch.Tensor, recorded_tags: torch.Tensor,
                              page_tags: torch.Tensor, page_size: int,
                              cu_seqlens_q: torch.Tensor | None = None,
                              slot_mapping: torch.Tensor | None = None,
                              page_holders: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (failed bool [B], first_bad int32 [B]).

    Request ``b`` fails when
      * a page entry ``i < ceil(seq_lens[b] / page_size)`` holds an id outside ``[0, num_pages)``, or a page
        whose current tag is not the one ``b`` recorded (``page_tags[block_table[b, i]] != recorded_tags[b, i]``:
        the page changed hands since ``b`` took it);
      * ``seq_lens[b] < 0`` or its pages do not fit the table's ``P`` columns;
      * (with ``cu_seqlens_q`` and ``slot_mapping``) one of its new tokens — the last ``q_len`` of its sequence —
        is not written to the slot the table gives for its position (-1 for a position before 0: padding), or
        (with ``page_holders [num_pages]``) goes into a page held by more than one request or prefix.

    ``first_bad[b]``: the first failing page entry (a bad slot counts at its token's entry), ``P`` for a length
    error, -1 when ``b`` passes.
    """
    b, p = block_table.shape
    dev = block_table.device
    num_pages = page_tags.shape[0]
    seq = seq_lens.long()
    n_pages = (seq + page_size - 1).div(page_size, rounding_mode="floor")
    length_bad = (seq < 0) | (n_pages > p)
    entry = torch.arange(p, device=dev).expand(b, p)

    # 1. the pages each request reads
    pages = block_table.long()
    in_range = (pages >= 0) & (pages < num_pages)
    current = page_tags[torch.where(in_range, pages, torch.zeros_like(pages))]
    bad = (entry < n_pages[:, None]) & (~in_range | (current != recorded_tags))
    first = torch.where(bad, entry, torch.full_like(entry, p)).amin(dim=1) if p else torch.full_like(seq, p)

    # 2. the slots its new tokens are written to
    if cu_seqlens_q is not None and slot_mapping is not None:
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        t = torch.arange(slot_mapping.shape[0], device=dev)
        owner = torch.searchsorted(cu_seqlens_q[1:].long(), t, right=True)               # [T] request of token t
        pos = seq[owner] - q_lens[owner] + (t - cu_seqlens_q[:-1].long()[owner])         # [T] positions
        page_idx = pos.div(page_size, rounding_mode="floor")
        in_table = (pos >= 0) & (page_idx < p)
        page = pages[owner, page_idx.clamp(0, max(p - 1, 0))] if p else torch.zeros_like(pos)
        expect = torch.where(in_table, page * page_size + pos % page_size, torch.full_like(pos, -1))
        slot_bad = (slot_mapping.long() != expect) & ((pos < 0) | in_table)  # past the table: a length error
        if page_holders is not None:                                     # a write into a shared page
            ok_page = in_table & (page >= 0) & (page < num_pages)
            shared = page_holders[torch.where(ok_page, page, torch.zeros_like(page))] > 1
            slot_bad |= ok_page & shared
        tok_first = torch.where(slot_bad, page_idx.clamp(0, p), torch.full_like(pos, p))
        first = first.scatter_reduce(0, owner, tok_first, reduce="amin")

    failed = length_bad | (first < p)
    first_bad = torch.where(length_bad, torch.full_like(first, p), first)
    first_bad = torch.where(failed, first_bad, torch.full_like(first, -1))
    return failed, first_bad.to(torch.int32)
