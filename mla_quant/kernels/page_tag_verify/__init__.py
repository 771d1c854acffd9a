"""``page_tag_verify``: one launch per decode step that finds the requests about to read a page they do not own.

Every physical page carries a tag (``page_tags [num_pages]`` int64) that the allocator renews each time the
page is handed out; each request recorded the tag of every page it took (``recorded_tags [B, P]``, aligned
with its ``block_table`` row). Before attention reads, a request fails if one of the pages its table points
at is out of range or carries another tag, if its length does not fit its table, or (optionally) if a new
token's slot is not the one its table gives. See ``reference.py`` for the exact rule and docs/page_tags.md.
"""
from __future__ import annotations

import torch

from .._backend import use_triton
from .._checks import check_same_device, check_tensor
from .._host import next_power_of_2
from .reference import page_tag_verify_reference

INDEX = (torch.int32, torch.int64)

__all__ = ["page_tag_verify", "page_tag_verify_reference"]


def page_tag_verify(block_table: torch.Tensor, seq_lens: torch.Tensor, recorded_tags: torch.Tensor,
                    page_tags: torch.Tensor, page_size: int, cu_seqlens_q: torch.Tensor | None = None,
                    slot_mapping: torch.Tensor | None = None, page_holders: torch.Tensor | None = None,
                    return_first_bad: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``block_table [B, P]`` int32, ``seq_lens [B]`` int32, ``recorded_tags [B, P]`` int64,
    ``page_tags [num_pages]`` int64 -> failed bool ``[B]`` (and ``first_bad`` int32 ``[B]``), on the device,
    without a host sync. Padding entries of the table (past a request's pages) are never read.

    Optional ``cu_seqlens_q [B + 1]`` int32 and ``slot_mapping [T]`` (the step's write slots) are checked
    against the table too; with ``page_holders [num_pages]`` (int64: requests and prefixes holding each page)
    a write into a page with more than one holder fails as well.
    """
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, contiguous=True)
    check_tensor("recorded_tags", recorded_tags, dtype=torch.int64, ndim=2)
    check_tensor("page_tags", page_tags, dtype=torch.int64, ndim=1, contiguous=True)
    check_same_device(block_table=block_table, seq_lens=seq_lens, recorded_tags=recorded_tags, page_tags=page_tags)
    b, p = block_table.shape
    if seq_lens.shape[0] != b:
        raise ValueError(f"seq_lens: {seq_lens.shape[0]} lengths for a block table of {b} requests")
    if tuple(recorded_tags.shape) != (b, p):
        raise ValueError(f"recorded_tags: shape {tuple(recorded_tags.shape)} must equal block_table's {(b, p)}")
    if block_table.stride(1) != 1 or recorded_tags.stride(1) != 1:
        raise ValueError("block_table / recorded_tags: the page dimension must be contiguous")
    if not (isinstance(page_size, int) and page_size > 0):
        raise ValueError(f"page_size: {page_size!r} must be a positive int")
    if (cu_seqlens_q is None) != (slot_mapping is None):
        raise ValueError("cu_seqlens_q and slot_mapping: give both or neither")
    if cu_seqlens_q is not None:
        check_tensor("cu_seqlens_q", cu_seqlens_q, dtype=INDEX, ndim=1, contiguous=True)
        check_tensor("slot_mapping", slot_mapping, dtype=INDEX, ndim=1, contiguous=True)
        check_same_device(block_table=block_table, cu_seqlens_q=cu_seqlens_q, slot_mapping=slot_mapping)
        if cu_seqlens_q.shape[0] != b + 1:
            raise ValueError(f"cu_seqlens_q: {cu_seqlens_q.shape[0]} entries, expected B + 1 = {b + 1}")
    if page_holders is not None:
        if cu_seqlens_q is None:
            raise ValueError("page_holders: only checks writes, give cu_seqlens_q and slot_mapping too")
        check_tensor("page_holders", page_holders, dtype=torch.int64, ndim=1, contiguous=True)
        check_same_device(page_tags=page_tags, page_holders=page_holders)
        if page_holders.shape != page_tags.shape:
            raise ValueError(f"page_holders: shape {tuple(page_holders.shape)} != page_tags {tuple(page_tags.shape)}")
    if not use_triton(block_table, page_tags):
        failed, first_bad = page_tag_verify_reference(block_table, seq_lens, recorded_tags, page_tags, page_size,
                                                      cu_seqlens_q, slot_mapping, page_holders)
        return (failed, first_bad) if return_first_bad else failed
    from .kernel import _page_tag_verify_kernel

    failed = torch.empty(b, dtype=torch.bool, device=block_table.device)
    first_bad = torch.empty(b, dtype=torch.int32, device=block_table.device)
    if b:
        check_slots = cu_seqlens_q is not None
        block_p = min(1024, max(16, next_power_of_2(p)))
        _page_tag_verify_kernel[(b,)](
            block_table, seq_lens, recorded_tags, page_tags,
            cu_seqlens_q if check_slots else seq_lens, slot_mapping if check_slots else seq_lens,
            page_holders if page_holders is not None else page_tags,
            failed, first_bad, page_tags.shape[0], p, block_table.stride(0), recorded_tags.stride(0),
            PAGE_SIZE=page_size, CHECK_SLOTS=check_slots, CHECK_HOLDERS=page_holders is not None,
            BLOCK_P=block_p, BLOCK_Q=16,
            num_warps=4 if block_p >= 512 else 1)
    return (failed, first_bad) if return_first_bad else failed
