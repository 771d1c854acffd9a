"""Paged KV storage, page allocator, page tags and capacity arithmetic."""
from .batch import PagedBatch
from .paged import LayerKV, PagedKVCache
from .tables import block_table_to_csr, check_page_table, csr_to_block_table, pages_needed, slots_from_block_table

__all__ = ["PagedBatch", "LayerKV", "PagedKVCache", "block_table_to_csr", "check_page_table",
           "csr_to_block_table", "pages_needed", "slots_from_block_table"]
