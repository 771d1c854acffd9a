"""Shared by the indexer / DSA module tests: random weights and a paged-step driver."""
from __future__ import annotations

import torch

from mla_quant.cache import NoopTagTracker, PageAllocator, PagedKVCache
from mla_quant.cache.indexer_cache import IndexerKCache


def init_(module: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Random weights; norm weights around 1 (as trained ones are)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
    return module


def make_pools(num_layers, num_pages, page_size, kv_lora_rank, rope_dim, kv_format="bf16",
               index_layers=(0,), head_dim=64, key_kind="fp32", device="cpu"):
    """A NaN-poisoned latent cache, indexer key cache and an allocator over them."""
    cache = PagedKVCache(num_layers, num_pages, page_size, kv_lora_rank, rope_dim, kv_format, device).poison_()
    keys = IndexerKCache(list(index_layers), num_pages, page_size, head_dim, key_kind, device).poison_()
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    return cache, keys, alloc


def schedule(lengths, prefill, chunk):
    """Per step the new-token count of each request: a first chunk of ``prefill`` tokens, then chunks of
    ``chunk`` (1 = decode) until each request is done."""
    done = [0] * len(lengths)
    steps = []
    while any(d < n for d, n in zip(done, lengths)):
        counts = [min(prefill if d == 0 else chunk, n - d) for d, n in zip(done, lengths)]
        steps.append(counts)
        done = [d + c for d, c in zip(done, counts)]
    return steps


def run_paged(alloc, xs, steps, step_fn):
    """Drive ``step_fn(batch, x [T, hidden]) -> tuple of [T, ...] outputs`` over the steps; returns per request
    the outputs concatenated over its tokens (in position order)."""
    for r in range(len(xs)):
        alloc.add_request(r)
    done = [0] * len(xs)
    outs = [None] * len(xs)
    for counts in steps:
        reqs = [r for r, c in enumerate(counts) if c > 0]
        cnt = [counts[r] for r in reqs]
        batch = alloc.plan(reqs, cnt)
        x = torch.cat([xs[r][done[r]:done[r] + c] for r, c in zip(reqs, cnt)])
        got = step_fn(batch, x)
        off = 0
        for r, c in zip(reqs, cnt):
            part = [g[off:off + c] for g in got]
            outs[r] = part if outs[r] is None else [_cat_rows(a, b) for a, b in zip(outs[r], part)]
            off += c
            done[r] += c
    return outs


def _cat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Concatenate along rows; index tensors of different widths (top-k width grows with the context) are
    padded with -1."""
    if a.dtype == torch.int32 and a.shape[1:] != b.shape[1:]:
        w = max(a.shape[-1], b.shape[-1])
        a, b = (torch.nn.functional.pad(t, (0, w - t.shape[-1]), value=-1) for t in (a, b))
    return torch.cat([a, b])


def selected_sets(indices: torch.Tensor) -> list[set[int]]:
    """int [T, K] (-1 unused) -> the selected positions per row."""
    return [set(row[row >= 0].tolist()) for row in indices]


def assert_same_selection(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, tol: float = 1e-5) -> None:
    """Rows of ``got`` and ``want`` (int [T, K], -1 unused) select the same keys, up to ties: where the sets
    differ, the selected scores (``scores [T, N]``) must agree as sorted lists (ReLU makes exact-zero ties
    common)."""
    for t, (a, b) in enumerate(zip(selected_sets(got), selected_sets(want))):
        if a == b:
            continue
        sa = scores[t, sorted(a)].sort().values
        sb = scores[t, sorted(b)].sort().values
        assert sa.shape == sb.shape and torch.allclose(sa, sb, rtol=tol, atol=tol), \
            f"row {t}: {sorted(a)} vs {sorted(b)} (scores {sa.tolist()} vs {sb.tolist()})"
