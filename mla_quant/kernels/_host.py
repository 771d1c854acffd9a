"""Integer helpers for the launchers' host code.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` objects (so that kernels may call
them too); called from Python they cost ~3.5 µs each (Triton 3.6 and 3.9, this project's 2-core CI machine) against
~0.04 µs for the arithmetic, and one launch used to call them up to ~16 times (``fp8_gemm``'s split-K planning at
decode sizes). These are the same functions for the non-negative ints the launchers pass.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for b > 0 (``triton.cdiv``)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two ≥ n for n ≥ 1, 0 for n = 0 (``triton.next_power_of_2``)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
