"""One DeepSeek Sparse Attention layer on its own (GLM 5.2's attention): the lightning indexer picks the
``index_topk`` cached tokens each query reads, then MLA runs over those only. The plain forward (masked,
expanded) against the paged path (indexer keys and latents in pages, sparse absorbed attention over the
gathered rows), with BF16 or FP8 latents and a BF16 or FP8 indexer. CPU in seconds, GPU when present.

    python examples/03_dsa_module.py
"""
import torch

from mla_quant.cache import NoopTagTracker, PageAllocator, PagedKVCache
from mla_quant.cache.indexer_cache import IndexerKCache
from mla_quant.models import init_random_weights_
from mla_quant.modules.dsa import DSAttention
from mla_quant.testing import sqnr_db

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 512, 4, 256, 512, 64, 64, 64
INDEX_HEADS, INDEX_DIM, TOPK = 8, 128, 16
BATCH, PROMPT, DECODE, PAGE = 2, 40, 8, 16


def paged_forward(attn: DSAttention, x: torch.Tensor, kv_format: str, keys_kind: str):
    """x [B, T, hidden] -> (y [B, T, hidden], top-k key positions [B, T, K]): prompt in one chunk, then one
    token per step."""
    b, t, _ = x.shape
    pages = b * -(-t // PAGE)
    cache = PagedKVCache(1, pages, PAGE, KV_RANK, ROPE, kv_format, x.device)
    keys = IndexerKCache(1, pages, PAGE, INDEX_DIM, keys_kind, x.device)
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    for r in range(b):
        alloc.add_request(r)
    out, picked, pos = torch.empty_like(x), torch.full((b, t, TOPK), -1, dtype=torch.int32), 0
    for n in [PROMPT] + [1] * (t - PROMPT):
        batch = alloc.plan(range(b), n)
        y, idx = attn.forward_paged(x[:, pos:pos + n].reshape(b * n, -1), batch, cache.layer(0), keys=keys.layer(0))
        out[:, pos:pos + n] = y.view(b, n, -1)
        picked[:, pos:pos + n, :idx.shape[-1]] = idx.view(b, n, -1).cpu()
        pos += n
    return out, picked


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean fraction of the selected key positions two selections share (as sets, per query)."""
    hits = [len(set(x.tolist()) & set(y.tolist()) - {-1}) / max(1, len(set(x.tolist()) - {-1}))
            for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))]
    return sum(hits) / len(hits)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)     # tiny ops: threads only contend
    x = torch.randn(BATCH, PROMPT + DECODE, HIDDEN, device=device, generator=torch.Generator(device).manual_seed(1))
    print(f"DSA layer: hidden {HIDDEN}, {HEADS} heads, indexer {INDEX_HEADS} heads x {INDEX_DIM}, top-{TOPK} of "
          f"up to {PROMPT + DECODE} tokens; {BATCH} sequences, pages of {PAGE}")
    print(f"{'indexer':<8} {'KV format':<11} {'SQNR prefill':>13} {'SQNR decode':>12} {'same top-k':>11}")
    def layer(indexer_fmt: str) -> DSAttention:       # the same weights whatever the indexer's precision
        attn = DSAttention(HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V, index_n_heads=INDEX_HEADS,
                           index_head_dim=INDEX_DIM, index_topk=TOPK, indexer_fmt=indexer_fmt, dtype=torch.float32,
                           device=device)
        return init_random_weights_(attn, seed=0)

    with torch.no_grad():
        ref, ref_idx = layer("bf16")(x)
        for fmt, keys_kind in (("bf16", "fp32"), ("fp8", "fp8_e4m3")):
            attn = layer(fmt)
            for kv in ("bf16", "fp8_e4m3"):
                out, idx = paged_forward(attn, x, kv, keys_kind)
                print(f"{fmt:<8} {kv:<11} {sqnr_db(ref[:, :PROMPT], out[:, :PROMPT]):12.1f}dB "
                      f"{sqnr_db(ref[:, PROMPT:], out[:, PROMPT:]):11.1f}dB {100 * overlap(ref_idx.cpu(), idx):10.1f}%")
    print("(the plain forward is the reference: bf16 indexer, latents unrounded; 'same top-k' compares the sets)")


if __name__ == "__main__":
    main()
