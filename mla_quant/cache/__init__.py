"""Paged KV storage, page allocator, page tags and capacity arithmetic."""
from .allocator import OutOfPages, PageAllocator, PrefixRef, UnknownRequest
from .batch import PagedBatch
from .capacity import KVCapacity, kv_bytes_per_token, kv_capacity, kv_capacity_tokens, weight_bytes_per_gpu
from .indexer_cache import IndexerKCache, IndexerKeys
from .paged import LayerKV, PagedKVCache
from .tables import block_table_to_csr, check_page_table, csr_to_block_table, pages_needed, slots_from_block_table
from .tags import NoopTagTracker, PageTagMismatch, PageTagTracker

__all__ = ["PagedBatch", "LayerKV", "PagedKVCache", "PageAllocator", "PrefixRef", "OutOfPages", "UnknownRequest",
           "PageTagTracker", "NoopTagTracker", "PageTagMismatch", "block_table_to_csr", "check_page_table",
           "csr_to_block_table", "pages_needed", "slots_from_block_table", "kv_capacity_tokens", "kv_capacity",
           "KVCapacity", "kv_bytes_per_token", "weight_bytes_per_gpu"]
__all__ += ["IndexerKCache", "IndexerKeys"]
