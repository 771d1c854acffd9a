"""Page-table helpers for the cache layer (the index tensors are specified in docs/kv_cache.md)."""
from ..kernels.page_table import (
    block_table_to_csr,
    check_page_table,
    csr_to_block_table,
    pages_needed,
    slots_from_block_table,
)

__all__ = ["block_table_to_csr", "check_page_table", "csr_to_block_table", "pages_needed",
           "slots_from_block_table"]
