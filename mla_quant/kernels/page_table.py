"""Paged index tensors (int32, as flashinfer and FlashMLA take them) — checks and conversions in pure torch.

* block table ``[B, max_pages]`` int32: request ``b``'s ``i``-th page id; entries past its
  ``ceil(seq_lens[b] / page_size)`` pages are padding (``-1`` by convention) and are never read.
* ``seq_lens [B]`` int32: tokens in the cache for each request.
* slot of token ``j`` of request ``b``: ``block_table[b, j // page_size] · page_size + j % page_size``.
* CSR form (flashinfer ``BatchMLAPagedAttentionWrapper``/``BatchDecodeWithPagedKVCacheWrapper``):
  ``kv_indptr [B + 1]`` (prefix sum of pages per request), ``kv_indices [kv_indptr[-1]]`` (the page ids,
  request after request), ``kv_last_page_len [B]`` (tokens in each request's last page, in ``[1, page_size]``;
  0 for an empty request).

See docs/kv_cache.md for the full spec.
"""
from __future__ import annotations

import torch

from ._checks import check_same_device, check_tensor


def pages_needed(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages each request occupies: ``ceil(seq_lens / page_size)`` (same dtype and device)."""
    return (seq_lens + (page_size - 1)) // page_size


def check_page_table(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                     num_pages: int | None = None) -> None:
    """Validate a block table against sequence lengths (and a page pool). Errors name the argument.

    Syncs with the device (reads the values), so call it at a public boundary or in tests, not per layer.
    """
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1)
    check_same_device(block_table=block_table, seq_lens=seq_lens)
    b, max_pages = block_table.shape
    if seq_lens.shape[0] != b:
        raise ValueError(f"seq_lens: {seq_lens.shape[0]} lengths for a block table of {b} requests")
    if page_size < 1:
        raise ValueError(f"page_size: {page_size} must be positive")
    if b == 0:
        return
    if int(seq_lens.min()) < 0:
        raise ValueError(f"seq_lens: negative length {int(seq_lens.min())}")
    need = pages_needed(seq_lens, page_size)
    worst = int(need.argmax())
    if int(need[worst]) > max_pages:
        raise ValueError(f"seq_lens: request {worst} has {int(seq_lens[worst])} tokens, more than its "
                         f"{max_pages} pages of {page_size} hold")
    used = torch.arange(max_pages, device=block_table.device)[None, :] < need[:, None]
    bad = used & (block_table < 0)
    if num_pages is not None:
        bad |= used & (block_table >= num_pages)
    if bool(bad.any()):
        bad_b, bad_i = bad.nonzero()[0].tolist()
        raise IndexError(f"block_table: page id {int(block_table[bad_b, bad_i])} of request {bad_b} (entry {bad_i}) "
                         f"is outside [0, {num_pages if num_pages is not None else 'num_pages'})")


def slots_from_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor,
                           page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical slots of every cached token: (slots int64 ``[B, max(seq_lens)]``, valid bool, same shape).

    Slots past a request's length are 0 and marked invalid; padding entries of the table are not read.
    """
    b = block_table.shape[0]
    max_len = int(seq_lens.max()) if b else 0
    pos = torch.arange(max_len, device=block_table.device)
    valid = pos[None, :] < seq_lens[:, None].long()
    page_idx = (pos // page_size).clamp_max(max(block_table.shape[1] - 1, 0))
    pages = block_table.long()[:, page_idx] if block_table.shape[1] else torch.zeros(b, max_len, dtype=torch.long,
                                                                                     device=block_table.device)
    slots = torch.where(valid, pages * page_size + pos % page_size, torch.zeros_like(pages))
    return slots, valid


def block_table_to_csr(block_table: torch.Tensor, seq_lens: torch.Tensor,
                       page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block table + lengths -> (kv_indptr int32 [B + 1], kv_indices int32 [nnz], kv_last_page_len int32 [B])."""
    need = pages_needed(seq_lens.long(), page_size)
    kv_indptr = torch.zeros(block_table.shape[0] + 1, dtype=torch.int32, device=block_table.device)
    kv_indptr[1:] = need.cumsum(0).to(torch.int32)
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < need[:, None]
    kv_indices = block_table[used].to(torch.int32)             # row-major: request after request
    kv_last_page_len = torch.where(seq_lens > 0, (seq_lens.long() - 1) % page_size + 1,
                                   torch.zeros_like(seq_lens.long())).to(torch.int32)
    return kv_indptr, kv_indices, kv_last_page_len


def csr_to_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                       page_size: int, max_pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`block_table_to_csr`: (block_table int32 [B, max_pages] padded with -1, seq_lens int32)."""
    counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
    b = counts.shape[0]
    width = max_pages if max_pages is not None else (int(counts.max()) if b else 0)
    table = torch.full((b, width), -1, dtype=torch.int32, device=kv_indices.device)
    used = torch.arange(width, device=kv_indices.device)[None, :] < counts[:, None]
    table[used] = kv_indices.to(torch.int32)
    seq_lens = torch.where(counts > 0, (counts - 1) * page_size + kv_last_page_len.long(), torch.zeros_like(counts))
    return table, seq_lens.to(torch.int32)
