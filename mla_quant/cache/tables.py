"""Page-table helpers for the cache layer (the index tensors are specified in docs/kv_cache.md)."""
import torch

from ..kernels.page_table import (
    block_table_to_csr,
    check_page_table,
    csr_to_block_table,
    pages_needed,
    slots_from_block_table,
)



def page_ids(name: str, pages, num_pages: int) -> torch.Tensor:
    """Page ids as a host int64 tensor, range-checked (page lists come from the allocator, on the host)."""
    t = torch.as_tensor(pages, dtype=torch.long).reshape(-1).cpu()
    bad = t[(t < 0) | (t >= num_pages)]
    if bad.numel():
        raise IndexError(f"{name}: page id {int(bad[0])} out of range [0, {num_pages})")
    return t


def copy_page_ids(src_pages, dst_pages, src_num_pages: int, dst_num_pages: int,
                  same_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked (src, dst) host page ids for a page copy: equal counts, no page written twice, and no
    overlap when copying within one cache."""
    src = page_ids("src_pages", src_pages, src_num_pages)
    dst = page_ids("dst_pages", dst_pages, dst_num_pages)
    if src.numel() != dst.numel():
        raise ValueError(f"dst_pages: {dst.numel()} pages for {src.numel()} src_pages")
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("dst_pages: a page appears twice")
    if same_cache and bool(torch.isin(src, dst).any()):
        raise ValueError("dst_pages: overlaps src_pages within one cache")
    return src, dst


__all__ = ["block_table_to_csr", "check_page_table", "copy_page_ids", "csr_to_block_table", "page_ids",
           "pages_needed", "slots_from_block_table"]
