"""One MLA layer on its own: the plain causal forward (naive, expanded form, no cache) against the paged path
(prefill chunks through the naive kernel, then decode steps through the absorbed kernel over the pages), for
each KV format. Kimi K2.6's per-token row (512 latent + 64 rope), 8 heads; CPU in seconds, GPU when present.

    python examples/02_mla_module.py
"""
import torch

from mla_quant.cache import NoopTagTracker, PageAllocator, PagedKVCache
from mla_quant.models import init_random_weights_
from mla_quant.modules.attention import MLAttention
from mla_quant.testing import sqnr_db

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V = 1024, 8, 384, 512, 128, 64, 128
BATCH, PROMPT, DECODE, PAGE = 2, 40, 8, 16


def paged_forward(attn: MLAttention, x: torch.Tensor, kv_format: str) -> torch.Tensor:
    """x [B, T, hidden] -> [B, T, hidden] through one layer's pages: the prompt in two chunks, then one token
    per step."""
    b, t, _ = x.shape
    cache = PagedKVCache(1, b * -(-t // PAGE), PAGE, KV_RANK, ROPE, kv_format, x.device)
    alloc = PageAllocator(cache=cache, tracker=NoopTagTracker())
    for r in range(b):
        alloc.add_request(r)
    out, pos = torch.empty_like(x), 0
    for n in [PROMPT // 2, PROMPT - PROMPT // 2] + [1] * (t - PROMPT):
        batch = alloc.plan(range(b), n)                       # tables and slots for this step's n tokens each
        y = attn.forward_paged(x[:, pos:pos + n].reshape(b * n, -1), batch, cache.layer(0))
        out[:, pos:pos + n] = y.view(b, n, -1)
        pos += n
    return out


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)     # tiny ops: threads only contend
    attn = MLAttention(HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, V, dtype=torch.float32, device=device)
    init_random_weights_(attn, seed=0)
    x = torch.randn(BATCH, PROMPT + DECODE, HIDDEN, device=device, generator=torch.Generator(device).manual_seed(1))
    with torch.no_grad():
        ref = attn(x)                                          # naive: k, v expanded per head
        print(f"MLA layer: hidden {HIDDEN}, {HEADS} heads, latent {KV_RANK} + rope {ROPE}; {BATCH} sequences of "
              f"{PROMPT} prompt + {DECODE} decode tokens, pages of {PAGE}")
        print(f"{'KV format':<12} {'bytes/token':>11} {'SQNR prefill':>13} {'SQNR decode':>12}")
        for kv in ("bf16", "fp8_e4m3", "fp8_ds_mla"):
            out = paged_forward(attn, x, kv)
            nbytes = PagedKVCache(1, 1, PAGE, KV_RANK, ROPE, kv).bytes_per_token()
            print(f"{kv:<12} {nbytes:>11} {sqnr_db(ref[:, :PROMPT], out[:, :PROMPT]):12.1f}dB "
                  f"{sqnr_db(ref[:, PROMPT:], out[:, PROMPT:]):11.1f}dB")
    print("(bf16 pages: only the latents' bf16 rounding separates the paged path from the plain forward)")


if __name__ == "__main__":
    main()
