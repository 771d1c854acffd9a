"""Public Hypothesis strategies and assertion helpers for kernel tests."""
from .assertions import (
    assert_all_written,
    assert_bitwise_equal,
    assert_rel_close,
    assert_sqnr_at_least,
    poisoned_empty,
    rel_err,
    sqnr_db,
)
from .strategies import (
    kv_formats,
    odd_sizes,
    page_tables,
    quantized_weights,
    ragged_lengths,
    realistic_tensor,
    tensors,
    weight_formats,
)

__all__ = [
    "assert_all_written", "assert_bitwise_equal", "assert_rel_close", "assert_sqnr_at_least",
    "poisoned_empty", "rel_err", "sqnr_db", "kv_formats", "odd_sizes", "page_tables", "quantized_weights",
    "ragged_lengths", "realistic_tensor", "tensors", "weight_formats",
]
