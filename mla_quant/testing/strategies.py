"""Public Hypothesis strategies for kernel tests (this library's and its users').

Tensors are built from a drawn seed (Hypothesis shrinks seeds and shapes, not raw floats), which keeps
large tensors cheap to generate and failures reproducible.
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from ..formats import BF16, FP8Block, Int4Group, KVFormat


def realistic_tensor(shape, seed: int, dtype=torch.float32, outlier_frac: float = 0.001,
                     outlier_scale: float = 50.0, heavy_tail: bool = False, device="cpu") -> torch.Tensor:
    """Gaussian (or Student-t with 3 dof when ``heavy_tail``) values with rare large outliers, as in
    LLM weights and activations."""
    g = torch.Generator().manual_seed(seed)
    if heavy_tail:
        x = _student_t(shape, g)
    else:
        x = torch.randn(shape, generator=g)
    if outlier_frac > 0 and x.numel():
        mask = torch.rand(shape, generator=g) < outlier_frac
        x = torch.where(mask, x * outlier_scale, x)
    return x.to(dtype=dtype, device=device)


def _student_t(shape, g: torch.Generator, dof: float = 3.0) -> torch.Tensor:
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn((*shape, int(dof)), generator=g).pow(2).sum(-1)
    return z / torch.sqrt(chi2 / dof)


@st.composite
def tensors(draw, shape, dtype=torch.float32, heavy_tail: bool | None = None, device="cpu"):
    """A tensor of the given shape (a tuple, or a strategy of tuples) with realistic outliers."""
    shape = draw(shape) if isinstance(shape, st.SearchStrategy) else shape
    seed = draw(st.integers(0, 2**31 - 1))
    ht = draw(st.booleans()) if heavy_tail is None else heavy_tail
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    return realistic_tensor(shape, seed, heavy_tail=ht, dtype=torch.float32, device=device).mul(scale).to(dtype)


def odd_sizes(min_value: int = 1, max_value: int = 1000, multiple_of: int = 1):
    """Sizes that favour awkward values: 1, primes, 2^k ± 1, and multiples of ``multiple_of``."""
    awkward = [v for v in (1, 3, 7, 31, 33, 63, 65, 127, 129, 255, 257, 1000) if min_value <= v <= max_value]
    base = st.integers(min_value, max_value)
    if multiple_of > 1:
        lo, hi = -(-min_value // multiple_of), max_value // multiple_of
        return st.integers(max(lo, 1), max(hi, 1)).map(lambda m: m * multiple_of)
    return st.one_of(st.sampled_from(awkward), base) if awkward else base


def weight_formats(include_bf16: bool = True):
    fmts = [FP8Block(), FP8Block(act_quant=False), Int4Group(32), Int4Group(64), Int4Group(128)]
    return st.sampled_from(([BF16()] if include_bf16 else []) + fmts)


def kv_formats():
    return st.sampled_from([KVFormat("bf16"), KVFormat("fp8_e4m3"), KVFormat("fp8_e4m3", "tensor"),
                            KVFormat("fp8_ds_mla")])


@st.composite
def quantized_weights(draw, fmt=None, n=None, k=None):
    """(fmt, dense fp32 weight [N, K], its quantized tensors) for a drawn or given format and shape."""
    fmt = draw(weight_formats()) if fmt is None else fmt
    k_mult = getattr(fmt, "group_size", None) or (fmt.act_group if isinstance(fmt, FP8Block) else 8)
    n = draw(odd_sizes(1, 300)) if n is None else n
    k = draw(st.integers(1, 4).map(lambda m: m * max(k_mult, 32))) if k is None else k
    w = draw(tensors((n, k), heavy_tail=None))
    return fmt, w, fmt.quantize(w)


@st.composite
def ragged_lengths(draw, batch=st.integers(1, 8), min_len: int = 1, max_len: int = 300):
    """A list of per-request sequence lengths (a ragged batch)."""
    b = draw(batch) if isinstance(batch, st.SearchStrategy) else batch
    return draw(st.lists(st.integers(min_len, max_len), min_size=b, max_size=b))


@st.composite
def page_tables(draw, lengths, page_size: int, num_pages: int | None = None, share_prefix: bool = False):
    """A random block table over a page pool for the given sequence lengths.

    Returns (block_table int32 [B, max_pages] with unused entries = -1, seq_lens int32 [B], num_pages).
    Pages are distinct across requests (shuffled), except that with ``share_prefix`` every request may
    reuse the first full pages of request 0 (prefix sharing).
    """
    lengths = draw(lengths) if isinstance(lengths, st.SearchStrategy) else list(lengths)
    need = [-(-n // page_size) for n in lengths]
    max_pages = max(need + [1])
    total = sum(need)
    pool = num_pages if num_pages is not None else total + draw(st.integers(0, 8))
    if pool < total:
        raise ValueError(f"page_tables: {total} pages needed, pool has {pool}")
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1))))
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[cursor:cursor + n].to(torch.int32)
        cursor += n
    if share_prefix and len(lengths) > 1:
        full0 = lengths[0] // page_size
        for b in range(1, len(lengths)):
            shared = draw(st.integers(0, min(full0, lengths[b] // page_size)))
            table[b, :shared] = table[0, :shared]
    return table, torch.tensor(lengths, dtype=torch.int32), pool
