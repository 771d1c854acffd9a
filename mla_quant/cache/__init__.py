"""Paged KV storage, page allocator, page tags and capacity arithmetic."""
from .batch import PagedBatch

__all__ = ["PagedBatch"]
