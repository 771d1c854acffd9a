"""bench ``e2e_decode``: decode steps of a real-width, reduced-depth Kimi K2.6 on one H200 under a fixed KV
memory budget.

The model is ``KimiK26ForCausalLM`` at the real width (hidden 7168, 64 heads, MLA 1536/512, vocab 163840)
with 3 layers: layer 0 dense (MLP 18432), layers 1–2 MoE with all 384 routed experts (+ the BF16 shared
expert), random weights made in place (``init_random_weights_``). The routed experts are ``experts`` —
``int4_g32`` (the release: compressed-tensors INT4, W4A16) or ``fp8_block`` (128×128 blocks, W8A8) —
everything else in BF16 as Kimi K2.6 ships it. Every request holds ``ctx`` = 4096 cached tokens (random
rows written into the page pool once per KV format) and the timed step appends one more.

**Fixed KV budget.** One budget in bytes for every KV format (case key ``budget_gb``, GB of 1e9 bytes): the
BF16 pages that concurrency 32 needs at this context (32 × 65 pages of 64 tokens, 3 layers), plus 1 %
headroom — per-token FP8 scales make ``fp8_e4m3`` 580 bytes per token and layer, not half of BF16's 1152,
so an exact BF16 fit would leave FP8 0.7 % short of 64 requests; the headroom is far below the 1/32 that
would let BF16 hold a 33rd request. Each format's pool holds ``budget // page bytes`` pages: BF16 holds
concurrency 32 and not 64, FP8 holds 64 (1.99× the tokens). A concurrency whose pages do not fit is a row
with ``status = "out_of_pages"``, ``pages_needed`` and ``pages_held`` and no timing (``median_us`` None);
the page allocator itself is asked and must agree with the arithmetic (:func:`page_plan`).

**Series** (``experts``, ``kv``) at concurrency 1, 8, 16, 32, 64, each row's peer one step along a chain:

* ``fp8_block`` + ``bf16`` KV: the baseline, no peer;
* ``fp8_block`` + ``fp8_e4m3`` KV: peer ``kv=bf16`` (same weights; at 64 the peer is out of pages:
  ``peer_status``) — the seed's "BF16 runs out at twice the concurrency FP8 still holds";
* ``int4_g32`` + ``fp8_e4m3`` KV: peer ``experts=fp8_block`` (same KV) — the seed's +55 % at concurrency 1
  is ``speedup_vs_peer`` − 1;
* full mode adds ``int4_g32`` + ``bf16`` KV (peer ``experts=fp8_block``).

One decode step = ``model(ids [B], batch=PagedBatch, cache=...)``: embedding, 3 layers (KV append + absorbed
MLA decode over the pages + MLP/MoE), final norm, LM head over the B new tokens, replayed from a CUDA graph
(``common.graph_us``; ``cuda_graph`` says whether capture worked), median of many replays (``triton``'s
``do_bench``, L2 flushed). Extra fields: ``tokens_per_s`` (B / step), ``kv_pool_gb`` (the pool's real bytes),
``max_concurrency`` (requests the pool holds); full mode also ``layer_us`` (dense layer, one MoE layer, norm
+ LM head, each timed alone) and ``projected_61_layer_ms`` (dense + 60 MoE + head: the full model's step on
one GPU if it fit — it does not; the per-layer cost that TP/EP divide).

``bytes`` = the least the step reads: every BF16 weight of the 3 layers, the experts the batch can touch
(expected distinct experts of B·8 uniform picks out of 384, per MoE layer) in the row's format, the LM head,
and the B requests' KV pages (ctx + 1 tokens, 3 layers).

Time on the H200 (estimate; two model builds of ~10 s each, Triton autotuning at each new batch size):
``--quick`` (3 series × 5 concurrencies: 14 timed steps, 1 out of pages; 150 ms of replays each) ≈ 60–90 s;
full mode (4 series: 18 timed steps, 2 out of pages; 300 ms each, + 3 layer timings each) ≈ 2.5–4 min.
On a CPU (``Context(device="cpu")``) the same code runs a tiny Kimi-shaped model (concurrency 1, 2, 4,
budget sized for 2 BF16 requests + 5 %, eager timing) so the logic is checked without a GPU.

Run: ``python -m benchmarks --only e2e_decode [--quick]``.
"""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from mla_quant.cache import NoopTagTracker, OutOfPages, PageAllocator
from mla_quant.cache.capacity import kv_bytes_per_token
from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_

from .common import Context, case, graph_us, random_kv_pool

BENCH = "e2e_decode"
EXPERTS = {"int4_g32": Int4Group(32), "fp8_block": FP8Block()}
BASE_SERIES = (("fp8_block", "bf16"), ("fp8_block", "fp8_e4m3"), ("int4_g32", "fp8_e4m3"))
FULL_EXTRA_SERIES = (("int4_g32", "bf16"),)
CONCURRENCY = (1, 8, 16, 32, 64)
BUDGET_CONCURRENCY = 32      # the BF16 pages of this many requests make the budget
BUDGET_HEADROOM = 0.01       # see the module docstring: FP8's per-token scales need 0.7 %
CTX = 4096
PAGE = 64
LAYERS = 3                   # 1 dense + 2 MoE
FULL_DEPTH = 61              # Kimi K2.6's layers, for the projection
OUT_OF_PAGES = "out_of_pages"


# ------------------------------------------------------------------------------------------ page arithmetic
def pages_per_request(ctx: int, page_size: int) -> int:
    """Pages one request holds in the timed step: ``ctx`` cached tokens plus the one the step appends."""
    if ctx < 0 or page_size < 1:
        raise ValueError(f"ctx {ctx} must be >= 0 and page_size {page_size} >= 1")
    return -(-(ctx + 1) // page_size)


def kv_budget_bytes(config, concurrency: int, ctx: int, page_size: int, kv: str = "bf16",
                    headroom: float = BUDGET_HEADROOM) -> int:
    """The fixed KV budget: the ``kv`` pages (all layers of ``config``) of ``concurrency`` requests of ``ctx``
    tokens, times ``1 + headroom``."""
    page_bytes = page_size * kv_bytes_per_token(config, kv)
    return int(concurrency * pages_per_request(ctx, page_size) * page_bytes * (1 + headroom))


@dataclass(frozen=True)
class PagePlan:
    status: str            # "ok" | "out_of_pages"
    pages_needed: int      # concurrency × pages_per_request
    pages_held: int        # pages of the format that fit in the budget
    max_concurrency: int   # requests of this context the pool holds


def page_plan(config, kv: str, budget_bytes: int, concurrency: int, ctx: int, page_size: int) -> PagePlan:
    """Whether ``concurrency`` requests of ``ctx`` tokens (+1 appended) fit in a ``kv`` pool of
    ``budget_bytes``, with the pages on both sides."""
    held = int(budget_bytes // (page_size * kv_bytes_per_token(config, kv)))
    per_request = pages_per_request(ctx, page_size)
    needed = concurrency * per_request
    return PagePlan("ok" if needed <= held else OUT_OF_PAGES, needed, held, held // per_request)


def admit(alloc: PageAllocator, concurrency: int, ctx: int, device) -> object | None:
    """Add ``concurrency`` requests of ``ctx`` tokens and plan their one-token decode step: the step's
    ``PagedBatch``, or None when the allocator runs out of pages (no request is left behind)."""
    try:
        for r in range(concurrency):
            alloc.add_request(r, ctx)
        return alloc.plan(list(range(concurrency)), new_tokens=1, device=device)
    except OutOfPages:
        for r in list(alloc.requests):
            alloc.free(r)
        return None


def series_peer(experts: str, kv: str) -> tuple[str, str] | None:
    """The (experts, kv) series a row is compared with: INT4 experts against FP8 experts at the same KV,
    FP8-expert FP8 KV against FP8-expert BF16 KV; FP8 experts + BF16 KV is the baseline."""
    if experts == "int4_g32":
        return "fp8_block", kv
    if kv == "fp8_e4m3":
        return "fp8_block", "bf16"
    return None


def peer_label(row: tuple[str, str], peer: tuple[str, str]) -> str:
    """``experts=fp8_block`` or ``kv=bf16``: the one key the peer changes."""
    (e, _), (pe, pk) = row, peer
    return f"experts={pe}" if e != pe else f"kv={pk}"


# ------------------------------------------------------------------------------------------ the run's plan
@dataclass(frozen=True)
class Plan:
    config: KimiK26Config
    ctx: int
    concurrency: tuple[int, ...]
    budget_concurrency: int
    series: tuple[tuple[str, str], ...]
    headroom: float         # budget over the BF16 pages of budget_concurrency requests
    layer_times: bool       # time the dense layer, one MoE layer and the head alone (projection)
    rep_ms: float
    model: str


def make_plan(ctx: Context) -> Plan:
    if torch.device(ctx.device).type == "cpu":   # tiny, to check the logic without a GPU
        # rows of 128 + 32 values: the 4-byte FP8 scale is 2.5 % of a token, hence the larger headroom
        return Plan(KimiK26Config.tiny(), 64, (1, 2, 4), 2, BASE_SERIES, 0.05, False, 0.0, "kimi_k26_tiny")
    cfg = KimiK26Config.full().replace(num_hidden_layers=LAYERS)
    series = BASE_SERIES if ctx.quick else BASE_SERIES + FULL_EXTRA_SERIES
    return Plan(cfg, CTX, CONCURRENCY, BUDGET_CONCURRENCY, series, BUDGET_HEADROOM, not ctx.quick,
                150.0 if ctx.quick else 300.0, f"kimi_k26_{LAYERS}_layers_real_width")


# ------------------------------------------------------------------------------------------ measuring
def _build(config, expert_fmt, device) -> KimiK26ForCausalLM:
    def formats(name: str):
        return expert_fmt if ".mlp.experts." in name else BF16()

    model = KimiK26ForCausalLM(config, dtype=torch.bfloat16, formats=formats, device=device).eval()
    init_random_weights_(model, seed=0)
    model.validate_inputs = False
    for layer in model.model.layers:
        layer.self_attn.validate_tables = False
    return model


def _filled_cache(model, kv: str, num_pages: int, device):
    """A ``kv`` pool of ``num_pages`` pages, every slot holding a realistic random row (no NaN patterns)."""
    cfg = model.config
    cache = model.allocate_cache(num_pages, PAGE, kv, device=device)
    for i in range(cfg.num_hidden_layers):
        lk = cache.kv.layer(i)
        data, scales = random_kv_pool(kv, num_pages, PAGE, cfg.kv_lora_rank, cfg.qk_rope_head_dim, device)
        lk.data.copy_(data)
        if scales is not None:
            lk.scales.copy_(scales)
    return cache


def _timed(fn, device, rep_ms: float) -> tuple[float, bool]:
    """Median µs of ``fn``: CUDA-graph replays on a GPU, a few eager calls on a CPU."""
    with torch.no_grad():
        if torch.device(device).type == "cuda":
            return graph_us(fn, rep_ms=rep_ms)
        fn()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(runs), False


def _expected_distinct(batch_size: int, top_k: int, experts: int) -> float:
    return experts * (1 - (1 - top_k / experts) ** batch_size)


def _weight_bytes(model, batch_size: int) -> int:
    """Bytes of the weights one step must read (experts: the expected distinct ones of each MoE layer)."""
    cfg = model.config
    total = 0
    for name, t in model.state_dict().items():
        if name.startswith("model.embed_tokens"):
            total += batch_size * cfg.hidden_size * t.element_size()   # B embedding rows
        elif ".mlp.experts." not in name:
            total += t.numel() * t.element_size()
    per_expert = 0
    experts = model.model.layers[cfg.num_hidden_layers - 1].mlp.experts
    for proj in ("gate_proj", "up_proj", "down_proj"):
        per_expert += sum(t[0].numel() * t.element_size() for t in experts.tensors(proj).values())
    active = _expected_distinct(batch_size, cfg.num_experts_per_tok, cfg.n_routed_experts)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    return int(total + moe_layers * active * per_expert)


def _layer_times(model, batch, cache, b: int, device, rep_ms: float) -> dict:
    cfg = model.config
    x = torch.randn(b, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    out = {}
    for label, i in (("dense", 0), ("moe", cfg.num_hidden_layers - 1)):
        layer = model.model.layers[i]
        out[label] = round(_timed(lambda: layer.forward_paged(x, batch, cache), device, rep_ms)[0], 2)
    out["norm_lm_head"] = round(_timed(lambda: model.lm_head(model.model.norm(x)), device, rep_ms)[0], 2)
    dense = cfg.first_k_dense_replace
    projected = out["dense"] * dense + out["moe"] * (FULL_DEPTH - dense) + out["norm_lm_head"]
    return {"layer_us": out, "projected_61_layer_ms": round(projected / 1e3, 3)}


def _measure_series(model, experts: str, kv: str, plan: Plan, budget: int, device) -> dict[int, dict]:
    """One (experts, kv) series: per concurrency the page plan and, when it fits, the step's timing."""
    cfg = model.config
    held = page_plan(cfg, kv, budget, 1, plan.ctx, PAGE).pages_held
    cache = _filled_cache(model, kv, held, device)
    out = {}
    for b in plan.concurrency:
        pp = page_plan(cfg, kv, budget, b, plan.ctx, PAGE)
        alloc = PageAllocator(cache=cache.kv, tracker=NoopTagTracker())
        batch = admit(alloc, b, plan.ctx, device)
        if (batch is None) != (pp.status == OUT_OF_PAGES):
            raise RuntimeError(f"{experts}/{kv} at concurrency {b}: the allocator "
                               f"{'ran out' if batch is None else 'did not run out'} of pages; "
                               f"the page plan says {pp}")
        res = {"plan": pp, "kv_pool_gb": round(cache.kv.nbytes() / 1e9, 4)}
        if batch is not None:
            ids = torch.randint(0, cfg.vocab_size, (b,), device=device)
            res["us"], res["cuda_graph"] = _timed(lambda: model(ids, batch=batch, cache=cache), device, plan.rep_ms)
            res["bytes"] = _weight_bytes(model, b) + b * (plan.ctx + 1) * cache.kv.bytes_per_token()
            if plan.layer_times:
                res.update(_layer_times(model, batch, cache, b, device, plan.rep_ms))
        out[b] = res
    return out


def _rows(results: dict, plan: Plan, budget: int) -> list[dict]:
    rows = []
    for (experts, kv), per_b in results.items():
        peer = series_peer(experts, kv)
        for b, res in per_b.items():
            pp: PagePlan = res["plan"]
            key = {"kv": kv, "experts": experts, "concurrency": b, "ctx": plan.ctx,
                   "budget_gb": round(budget / 1e9, 4), "status": pp.status}
            extra = {"model": plan.model, "pages_needed": pp.pages_needed, "pages_held": pp.pages_held,
                     "max_concurrency": pp.max_concurrency, "kv_pool_gb": res["kv_pool_gb"]}
            peer_res = results.get(peer, {}).get(b) if peer else None
            if peer_res is not None:
                extra["peer_status"] = peer_res["plan"].status
            label = peer_label((experts, kv), peer) if peer_res is not None else None
            if "us" not in res:
                row = case(BENCH, key, 0.0, peer=label, **extra)
                row["median_us"] = None   # no step ran: the requests do not fit
                row["tokens_per_s"] = None
            else:
                us = res["us"]
                row = case(BENCH, key, us, bytes=res["bytes"], peer=label,
                           peer_median_us=peer_res.get("us") if peer_res else None,
                           cuda_graph=res["cuda_graph"], tokens_per_s=float(f"{b / (us * 1e-6):.4g}"), **extra,
                           **{k: res[k] for k in ("layer_us", "projected_61_layer_ms") if k in res})
            rows.append(row)
    return rows


def run(ctx: Context) -> list[dict]:
    dev = ctx.device
    plan = make_plan(ctx)
    budget = kv_budget_bytes(plan.config, plan.budget_concurrency, plan.ctx, PAGE, headroom=plan.headroom)
    results: dict[tuple[str, str], dict[int, dict]] = {}
    for experts in dict.fromkeys(e for e, _ in plan.series):   # one model per expert format, in turn
        model = _build(plan.config, EXPERTS[experts], dev)
        for e, kv in plan.series:
            if e == experts:
                results[e, kv] = _measure_series(model, e, kv, plan, budget, dev)
        del model
        gc.collect()
        if torch.device(dev).type == "cuda":
            torch.cuda.empty_cache()
    return _rows(results, plan, budget)
