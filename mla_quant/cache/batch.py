"""Per-step batch metadata for paged attention, built once per step and shared by every layer
(flashinfer's plan()/run() split): int32 index tensors on the compute device.

Tokens of a step are flattened over requests: request b contributes ``query_lens[b]`` new tokens
(a prefill chunk, or 1 for plain decode, or a few for speculative decode), in order. The new tokens are the
last ``query_lens[b]`` of the request's ``seq_lens[b]`` tokens. ``PageAllocator.plan`` builds it; the spec
of every tensor is in docs/kv_cache.md.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    block_table: torch.Tensor   # int32 [B, max_pages]: physical page ids, unused entries -1
    seq_lens: torch.Tensor      # int32 [B]: tokens in the cache for each request *after* this step's append
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]: prefix sum of the new tokens per request
    positions: torch.Tensor     # int64 [T]: absolute position of each new token (= its index in its sequence)
    slot_mapping: torch.Tensor  # int64 [T]: physical slot (page * page_size + offset) each new token is written to
    page_size: int
    max_query_len: int          # max(query_lens), a host int so kernels can pick a path without a sync
    request_ids: tuple[Hashable, ...] = ()  # the requests, in row order (host)
    tags: torch.Tensor | None = None        # int64 [B, max_pages]: page tags each request recorded (PageTagTracker)

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]

    @property
    def is_decode(self) -> bool:
        """Every request adds exactly one token."""
        return self.max_query_len == 1

    def select(self, rows) -> "PagedBatch":
        """The sub-batch of some requests (row indices, or a bool mask ``[B]``), e.g. the ones that passed
        their tag check: tables, lengths, new tokens and tags of those rows, in order."""
        rows = torch.as_tensor(rows, device="cpu")
        rows = rows.nonzero().flatten() if rows.dtype == torch.bool else rows.long().reshape(-1)
        if rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all()):
            raise ValueError("rows: must be increasing (tokens stay in request order)")
        dev = self.block_table.device
        idx = rows.to(dev)
        q_lens = self.query_lens.long()
        keep_tok = torch.zeros(self.batch_size, dtype=torch.bool, device=dev)
        keep_tok[idx] = True
        owner = torch.searchsorted(self.cu_seqlens_q[1:].long(),
                                   torch.arange(self.num_tokens, device=dev), right=True)
        tok = keep_tok[owner]
        cu = torch.zeros(rows.numel() + 1, dtype=torch.int32, device=dev)
        cu[1:] = q_lens[idx].cumsum(0).to(torch.int32)
        max_q = int(q_lens[idx].max()) if rows.numel() else 0
        return PagedBatch(self.block_table[idx], self.seq_lens[idx], cu, self.positions[tok], self.slot_mapping[tok],
                          self.page_size, max_q, tuple(self.request_ids[i] for i in rows.tolist()) if self.request_ids
                          else (), None if self.tags is None else self.tags[idx])

    def csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The table in flashinfer's CSR form: (kv_indptr [B + 1], kv_indices [nnz], kv_last_page_len [B]), int32."""
        from .tables import block_table_to_csr

        return block_table_to_csr(self.block_table, self.seq_lens, self.page_size)
