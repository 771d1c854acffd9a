"""Assertion helpers for kernel tests: relative error, SQNR, and "every output element written"."""
from __future__ import annotations

import math

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp64 (0 when both are zero)."""
    a, e = actual.double(), expected.double()
    den = e.norm().item()
    num = (a - e).norm().item()
    return num / den if den else (0.0 if num == 0 else math.inf)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10·log10(||ref||² / ||ref - approx||²)."""
    r, a = reference.double(), approx.double()
    noise = (r - a).pow(2).sum().item()
    signal = r.pow(2).sum().item()
    return math.inf if noise == 0 else 10.0 * math.log10(signal / noise) if signal else -math.inf


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    assert_all_written(actual, what)
    err = rel_err(actual, expected)
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3g} > {tol:.3g}")


def assert_sqnr_at_least(reference: torch.Tensor, approx: torch.Tensor, db: float, what: str = "") -> None:
    got = sqnr_db(reference, approx)
    if not got >= db:
        raise AssertionError(f"{what}: SQNR {got:.2f} dB < {db:.2f} dB")


def poisoned_empty(shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """Like torch.empty, but every element is NaN (floats) or the dtype's minimum (integers), so an
    element a kernel forgets to write shows up in :func:`assert_all_written`."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def assert_all_written(t: torch.Tensor, what: str = "") -> None:
    """Fails if any element is still NaN (float) — e.g. left over from :func:`poisoned_empty`."""
    if t.dtype.is_floating_point:
        bad = torch.isnan(t.float() if t.element_size() == 1 else t)
        if bad.any():
            idx = bad.nonzero()[0].tolist()
            raise AssertionError(f"{what}: {int(bad.sum())} elements not written (NaN), first at {idx}")


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Exact equality of the bits (NaN == NaN), for layout and packing ops."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}")
    a = actual.contiguous().view(torch.uint8)
    e = expected.contiguous().view(torch.uint8)
    if not torch.equal(a, e):
        n = int((a != e).sum())
        raise AssertionError(f"{what}: {n} bytes differ")
