"""benches ``dsa_decode`` and ``dsa_prefill``: DeepSeek Sparse Attention for GLM 5.2 against dense MLA.

GLM 5.2 per-GPU shapes: MLA rows of 512 latent + 64 rope (page size 64), ``heads`` 8 (TP8 of 64) or 64 (one
GPU), indexer 32 heads × 128 (replicated under TP) over FP8 key pages with per-token scales, ``topk`` 2048.
Every request's pages are scattered over one pool; inputs rotate over several block tables (distinct pages)
until one pass reads more than 3× the L2 cache.

``dsa_decode`` (one query token per request): the whole attention step after the projections — indexer
scores over the ``ctx`` cached keys and top-k (``indexer_topk``: at ≤ 4 rows the scores kernel also counts the
radix select's first digit), sparse absorbed attention over the gathered rows (``sparse_mla_decode``) — timed
as one CUDA-graph replay, against the dense ``mla_decode`` (peer) at the same ``kv``, heads, batch and context.
Extra fields, each part timed alone: ``index_topk_us`` (indexer_topk with a kept work buffer, as the model's
indexer calls it; ``index_topk_fresh_work_us``: a new zeroed buffer per call, one memset more),
``indexer_us`` (indexer_scores only), ``topk_us`` (``topk_indices`` of the step's scores, default path),
``topk_radix8_us`` / ``topk_radix11_us`` / ``topk_torch_us`` (the radix select forced with 8- or 11-bit digits,
torch.topk — to place RADIX_MAX_ROWS and RADIX_BITS), ``topk_radix8_rounds_us`` (8-bit digits, the rounds +
select finish instead of the candidate one), ``topk_radix11_block1024_us`` (11-bit digits in the 1024-column
tiles of commit ecce103),
``sparse_us``, ``sparse_splits{16,32,64,128}_us`` (batch 1: the sparse attention with forced split counts;
the planner gives 128 of 16 rows at ≤ 16 heads, 64 above); ``indexer_share`` (index_topk / step),
``ratio_vs_dense`` (step / dense; the goal at 64k is ≤ 0.35), ``unfused_step_us`` / ``unfused_ratio_vs_dense``
(the step as scores → topk_indices → sparse),
``peer_config`` (the dense peer's autotuned config, e.g. ``m16n64w8s2``), ``step_device_ops`` (kernels + memsets
of one step, torch profiler), ``graph_captured`` (the step captured in
a CUDA graph: no host sync). ``bytes``: indexer keys + scales of the context, the top-k gathered rows, q and
out (the least the step reads; the fp32 scores round trip is not counted); ``flops``: 2·ctx·32·128 (indexer)
+ 2·H·topk·(576 + 512) (attention) per request.

``dsa_prefill`` (one chunk of ``tokens`` new tokens closing a ``ctx``-token request, BF16 KV as the prefill
recipe keeps it): indexer scores of the chunk against every visible key, top-k, and the sparse absorbed
attention (the same kernel, one program per token and head block), against H2's dense ``mla_prefill`` over the
expanded keys and values of the whole context (its up-projection not timed — which favours the peer).
"""
from __future__ import annotations

import itertools
import math

import torch

from mla_quant.formats import KVFormat
from mla_quant.kernels.indexer_scores import indexer_scores, indexer_topk, topk_work_buffer
from mla_quant.kernels.mla_decode import mla_decode, tuned_config
from mla_quant.kernels.mla_prefill import mla_prefill
from mla_quant.kernels.sparse_mla_decode import sparse_mla_decode
from mla_quant.kernels.topk import RADIX_MAX_ROWS, _radix_topk, topk_indices

from .common import L2_BYTES, Context, case, median_us, graph_us, random_kv_pool

PAGE = 64
D_LATENT, D_ROPE = 512, 64
IDX_HEADS, IDX_DIM, TOPK = 32, 128, 2048
NOPE, V = 192, 256                    # GLM 5.2 qk_nope_head_dim / v_head_dim (the prefill peer's expanded form)
SCALE = 256 ** -0.5                   # GLM 5.2 softmax scale (no YaRN)
INDEX_KEY_BYTES = IDX_DIM + 4         # e4m3 key + fp32 scale
TOPK_VARIANTS = (("radix8", {"method": "radix", "radix_bits": 8}), ("radix11", {"method": "radix", "radix_bits": 11}),
                 ("radix8_rounds", {"method": "radix", "radix_bits": 8, "finish": "rounds"}),
                 ("torch", {"method": "torch"}))   # top-k paths timed alone on the step's scores
SPARSE_SPLIT_VARIANTS = (16, 32, 64, 128)  # forced sparse-attention split counts timed at batch 1


def _fill_pools(kind: str, num_pages: int, dev: str):
    """MLA pages in ``kind`` and FP8 indexer key pages with realistic values (no NaN bit patterns)."""
    data, scales = random_kv_pool(kind, num_pages, PAGE, D_LATENT, D_ROPE, dev)
    keys = torch.empty(num_pages, PAGE, IDX_DIM, dtype=torch.float8_e4m3fn, device=dev)
    key_scales = torch.rand(num_pages, PAGE, device=dev) * 0.02 + 0.01
    for lo in range(0, num_pages, 4096):
        hi = min(num_pages, lo + 4096)
        keys[lo:hi] = torch.randn(hi - lo, PAGE, IDX_DIM, device=dev).mul(30).to(torch.float8_e4m3fn)
    return data, scales, keys, key_scales


def decode_queries(batch: int, n: int, dev: str):
    """One decode token per request at position n - 1 of an n-token context: (seq_lens, req_ids, positions,
    indexer q (e4m3 [batch, 32, 128]), indexer head weights (fp32 [batch, 32]))."""
    seq_lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
    req_ids = torch.arange(batch, dtype=torch.int32, device=dev)
    positions = torch.full((batch,), n - 1, dtype=torch.int64, device=dev)
    q_idx = torch.randn(batch, IDX_HEADS, IDX_DIM, device=dev).mul(30).to(torch.float8_e4m3fn)
    return seq_lens, req_ids, positions, q_idx, torch.rand(batch, IDX_HEADS, device=dev)


def _tables(batch: int, ctx: int, bytes_per_set: int, num_pages: int, dev: str) -> list[torch.Tensor]:
    """Block tables over distinct pages of the pool, enough that one pass reads more than 3× L2."""
    pages = ctx // PAGE
    n_sets = max(1, min(16, math.ceil(3 * L2_BYTES / bytes_per_set), num_pages // (batch * pages)))
    perm = torch.randperm(num_pages, device=dev).to(torch.int32)
    return [perm[i * batch * pages:(i + 1) * batch * pages].reshape(batch, pages).contiguous()
            for i in range(n_sets)]


def _graph_us(fn, reps: int) -> float:
    """Median µs of one of ``reps`` calls replayed from a CUDA graph (eager if capture fails)."""
    return graph_us(fn, reps)[0]


def _device_ops(fn) -> int | None:
    """Kernels (and memsets / copies) one eager call of ``fn`` puts on the GPU, from the torch profiler (None if
    the profiler is unavailable): each costs ~1-2 µs of launch gap even inside a CUDA graph."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - a missing profiler only loses this field
        return None


def _decode_cases(ctx: Context, kinds, heads_list, batches, contexts) -> list[dict]:
    dev = ctx.device
    num_pages = max(batches) * max(contexts) // PAGE
    cases = []
    for kind in kinds:
        pool, scales, keys, key_scales = _fill_pools(kind, num_pages, dev)
        row_bytes = KVFormat(kind).bytes_per_token(D_LATENT, D_ROPE)
        for heads, batch, n in itertools.product(heads_list, batches, contexts):
            tables = _tables(batch, n, batch * n * (row_bytes + INDEX_KEY_BYTES), num_pages, dev)
            seq_lens, req_ids, positions, q_idx, w_idx = decode_queries(batch, n, dev)
            q = torch.randn(batch, heads, D_LATENT + D_ROPE, device=dev, dtype=torch.bfloat16)
            q_nope, q_pe = q[..., :D_LATENT], q[..., D_LATENT:]

            work = topk_work_buffer(dev, batch) if batch <= RADIX_MAX_ROWS else None

            def index_topk(tb, kept=True):  # the model's indexer keeps its work buffer (no memset per step)
                return indexer_topk(q_idx, w_idx, keys, key_scales, tb, req_ids, positions, TOPK, n,
                                    work=work if kept else None)

            top = [index_topk(tb) for tb in tables]
            scores = indexer_scores(q_idx, w_idx, keys, key_scales, tables[0], req_ids, positions, n)

            def index(tb):
                return indexer_scores(q_idx, w_idx, keys, key_scales, tb, req_ids, positions, n)

            def attend(tb, idx):
                return sparse_mla_decode(q_nope, q_pe, pool, scales, kind, tb, seq_lens, req_ids, idx, SCALE)

            def step(tb):
                return attend(tb, index_topk(tb))

            def step_unfused(tb):
                return attend(tb, topk_indices(index(tb), TOPK))

            def dense(tb):
                return mla_decode(q[:, None], pool, scales, tb, seq_lens, SCALE, kind, D_LATENT, max_seq_len=n,
                                  validate=False)

            reps = len(tables)
            t_step, captured = graph_us(lambda: [step(tb) for tb in tables], reps)
            t_unfused = _graph_us(lambda: [step_unfused(tb) for tb in tables], reps)
            t_index = _graph_us(lambda: [index(tb) for tb in tables], reps)
            t_index_topk = _graph_us(lambda: [index_topk(tb) for tb in tables], reps)
            t_fresh = _graph_us(lambda: [index_topk(tb, kept=False) for tb in tables], reps)
            t_topk = _graph_us(lambda: [topk_indices(scores, TOPK) for _ in tables], reps)
            t_topk_alt = {f"topk_{name}_us": round(_graph_us(lambda: [topk_indices(scores, TOPK, **kw)
                                                                        for _ in tables], reps), 3)
                          for name, kw in TOPK_VARIANTS}
            t_topk_alt["topk_radix11_block1024_us"] = round(_graph_us(     # the tile of commit ecce103
                lambda: [_radix_topk(scores, TOPK, block=1024, radix_bits=11) for _ in tables], reps), 3)
            t_sparse = _graph_us(lambda: [attend(tb, idx) for tb, idx in zip(tables, top)], reps)
            t_sparse_alt = {}
            if batch == 1:  # the sparse attention's split count at one request (latency-bound)
                for splits in SPARSE_SPLIT_VARIANTS:
                    t_sparse_alt[f"sparse_splits{splits}_us"] = round(_graph_us(lambda: [
                        sparse_mla_decode(q_nope, q_pe, pool, scales, kind, tb, seq_lens, req_ids, idx, SCALE,
                                          num_splits=splits) for tb, idx in zip(tables, top)], reps), 3)
            t_dense = _graph_us(lambda: [dense(tb) for tb in tables], reps)
            dense_config = tuned_config()   # the peer's autotuned config: it moved the peer 86-101 µs between runs
            moved = batch * (n * INDEX_KEY_BYTES + min(TOPK, n) * row_bytes
                             + IDX_HEADS * IDX_DIM + heads * (2 * (D_LATENT + D_ROPE) + 2 * D_LATENT))
            flops = 2 * batch * (n * IDX_HEADS * IDX_DIM + heads * min(TOPK, n) * (D_LATENT + D_ROPE + D_LATENT))
            cases.append(case(
                "dsa_decode", {"kv": kind, "heads": heads, "batch": batch, "ctx": n, "topk": TOPK}, t_step,
                bytes=moved, flops=flops, peer=f"mla_decode_{kind}", peer_median_us=t_dense, peer_config=dense_config,
                indexer_us=round(t_index, 3), topk_us=round(t_topk, 3), index_topk_us=round(t_index_topk, 3),
                index_topk_fresh_work_us=round(t_fresh, 3), sparse_us=round(t_sparse, 3),
                indexer_share=round(t_index_topk / t_step, 3),
                ratio_vs_dense=round(t_step / t_dense, 3), unfused_step_us=round(t_unfused, 3),
                unfused_ratio_vs_dense=round(t_unfused / t_dense, 3), **t_topk_alt, **t_sparse_alt,
                step_device_ops=_device_ops(lambda: step(tables[0])), graph_captured=captured, input_sets=reps))
            del tables, top, scores
        del pool, scales, keys, key_scales
        torch.cuda.empty_cache()
    return cases


def _prefill_cases(ctx: Context, heads_list, contexts, tokens: int) -> list[dict]:
    dev = ctx.device
    kind = "bf16"
    num_pages = max(contexts) // PAGE
    pool, scales, keys, key_scales = _fill_pools(kind, num_pages, dev)
    cases = []
    for heads, n in itertools.product(heads_list, contexts):
        table = torch.randperm(num_pages, device=dev)[: n // PAGE].to(torch.int32)[None].contiguous()
        seq_lens = torch.full((1,), n, dtype=torch.int32, device=dev)
        req_ids = torch.zeros(tokens, dtype=torch.int32, device=dev)
        positions = torch.arange(n - tokens, n, device=dev)
        q_idx = torch.randn(tokens, IDX_HEADS, IDX_DIM, device=dev).mul(30).to(torch.float8_e4m3fn)
        w_idx = torch.rand(tokens, IDX_HEADS, device=dev)
        q = torch.randn(tokens, heads, D_LATENT + D_ROPE, device=dev, dtype=torch.bfloat16)
        q_nope, q_pe = q[..., :D_LATENT], q[..., D_LATENT:]

        def index():
            return indexer_scores(q_idx, w_idx, keys, key_scales, table, req_ids, positions, n)

        scores = index()
        top = topk_indices(scores, TOPK)

        def attend(idx):
            return sparse_mla_decode(q_nope, q_pe, pool, scales, kind, table, seq_lens, req_ids, idx, SCALE)

        t_step = median_us(lambda: attend(topk_indices(index(), TOPK)))
        t_index = median_us(index)
        t_topk = median_us(lambda: topk_indices(scores, TOPK))
        t_sparse = median_us(lambda: attend(top))
        del scores
        qd = torch.randn(tokens, heads, NOPE + D_ROPE, device=dev, dtype=torch.bfloat16)
        kd = torch.randn(n, heads, NOPE + D_ROPE, device=dev, dtype=torch.bfloat16)
        vd = torch.randn(n, heads, V, device=dev, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, n], dtype=torch.int32, device=dev)
        t_dense = median_us(lambda: mla_prefill(qd, kd, vd, cu_q, cu_k, tokens, SCALE, causal=True,
                                                validate=False))
        del qd, kd, vd
        visible = tokens * n - tokens * (tokens - 1) // 2
        moved = n * INDEX_KEY_BYTES + tokens * min(TOPK, n) * 2 * (D_LATENT + D_ROPE)
        flops = 2 * (visible * IDX_HEADS * IDX_DIM + tokens * heads * min(TOPK, n) * (2 * D_LATENT + D_ROPE))
        cases.append(case(
            "dsa_prefill", {"kv": kind, "heads": heads, "batch": 1, "ctx": n, "topk": TOPK, "tokens": tokens},
            t_step, bytes=moved, flops=flops, peer="mla_prefill_bf16", peer_median_us=t_dense,
            indexer_us=round(t_index, 3), topk_us=round(t_topk, 3), sparse_us=round(t_sparse, 3),
            indexer_share=round((t_index + t_topk) / t_step, 3), ratio_vs_dense=round(t_step / t_dense, 3)))
    del pool, scales, keys, key_scales
    torch.cuda.empty_cache()
    return cases


def run(ctx: Context) -> list[dict]:
    if ctx.quick:
        return (_decode_cases(ctx, ("fp8_ds_mla",), (8, 64), (1, 64), (8192, 65536))
                + _prefill_cases(ctx, (64,), (65536,), 2048))
    return (_decode_cases(ctx, ("bf16", "fp8_ds_mla"), (8, 64), (1, 16, 64), (8192, 32768, 65536, 131072))
            + _prefill_cases(ctx, (8, 64), (8192, 32768, 65536, 131072), 2048))
