"""bench ``e2e_decode``: the fixed-KV-budget page arithmetic, its agreement with the page allocator, the
series' peers, and one tiny CPU run rendered by ``benchmarks.report`` (timings themselves: on the H200)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import bench_e2e_decode as e2e
from benchmarks.common import Context
from benchmarks.report import tables
from mla_quant.cache import NoopTagTracker, PageAllocator
from mla_quant.models import KimiK26Config


def _kimi(layers: int) -> KimiK26Config:
    return KimiK26Config.full().replace(num_hidden_layers=layers)


def test_pages_per_request_counts_the_appended_token():
    assert e2e.pages_per_request(4096, 64) == 65
    assert e2e.pages_per_request(4095, 64) == 64
    assert e2e.pages_per_request(0, 64) == 1
    with pytest.raises(ValueError, match="ctx"):
        e2e.pages_per_request(-1, 64)
    with pytest.raises(ValueError, match="page_size"):
        e2e.pages_per_request(10, 0)


def test_budget_of_the_h200_run():
    """3 real-width layers, 4k context: BF16 holds 32 requests and runs out at 64; FP8 holds 64."""
    cfg = _kimi(e2e.LAYERS)
    budget = e2e.kv_budget_bytes(cfg, e2e.BUDGET_CONCURRENCY, e2e.CTX, e2e.PAGE)
    assert budget == int(32 * 65 * 64 * 1152 * 3 * 1.01)
    bf16_32 = e2e.page_plan(cfg, "bf16", budget, 32, e2e.CTX, e2e.PAGE)
    bf16_64 = e2e.page_plan(cfg, "bf16", budget, 64, e2e.CTX, e2e.PAGE)
    fp8_64 = e2e.page_plan(cfg, "fp8_e4m3", budget, 64, e2e.CTX, e2e.PAGE)
    assert bf16_32 == e2e.PagePlan("ok", 2080, 2100, 32)
    assert bf16_64 == e2e.PagePlan(e2e.OUT_OF_PAGES, 4160, 2100, 32)
    assert fp8_64 == e2e.PagePlan("ok", 4160, budget // (64 * 580 * 3), 64)
    # without the headroom FP8's per-token scales would leave it short of 64 requests
    exact = e2e.kv_budget_bytes(cfg, 32, e2e.CTX, e2e.PAGE, headroom=0.0)
    assert e2e.page_plan(cfg, "fp8_e4m3", exact, 64, e2e.CTX, e2e.PAGE).status == e2e.OUT_OF_PAGES


@given(ctx=st.integers(0, 300_000), layers=st.integers(1, 61), ref=st.integers(1, 64),
       concurrency=st.integers(1, 200))
def test_bf16_holds_exactly_the_reference_and_fp8_twice(ctx, layers, ref, concurrency):
    cfg = _kimi(layers)
    budget = e2e.kv_budget_bytes(cfg, ref, ctx, e2e.PAGE)
    bf16 = e2e.page_plan(cfg, "bf16", budget, concurrency, ctx, e2e.PAGE)
    fp8 = e2e.page_plan(cfg, "fp8_e4m3", budget, concurrency, ctx, e2e.PAGE)
    assert bf16.max_concurrency == ref
    assert fp8.max_concurrency >= 2 * ref
    assert fp8.pages_held < 2 * bf16.pages_held + 2 * e2e.pages_per_request(ctx, e2e.PAGE)  # ~2×, no more
    for plan in (bf16, fp8):
        assert plan.pages_needed == concurrency * e2e.pages_per_request(ctx, e2e.PAGE)
        assert (plan.status == "ok") == (concurrency <= plan.max_concurrency) == (plan.pages_needed <= plan.pages_held)
        assert plan.pages_held * e2e.PAGE * cfg.num_hidden_layers <= budget  # the pool stays inside the budget


@given(num_pages=st.integers(1, 40), page_size=st.sampled_from([1, 4, 16, 64]), ctx=st.integers(0, 150),
       concurrency=st.integers(1, 12))
def test_admit_runs_out_exactly_when_the_pages_do(num_pages, page_size, ctx, concurrency):
    alloc = PageAllocator(num_pages=num_pages, page_size=page_size, tracker=NoopTagTracker())
    batch = e2e.admit(alloc, concurrency, ctx, "cpu")
    fits = concurrency * e2e.pages_per_request(ctx, page_size) <= num_pages
    assert (batch is not None) == fits
    if fits:
        assert batch.seq_lens.tolist() == [ctx + 1] * concurrency
        assert batch.slot_mapping.numel() == concurrency
        assert alloc.num_free_pages == num_pages - concurrency * e2e.pages_per_request(ctx, page_size)
    else:  # nothing left behind
        assert alloc.requests == [] and alloc.num_free_pages == num_pages


@pytest.mark.parametrize("series", [e2e.BASE_SERIES, e2e.BASE_SERIES + e2e.FULL_EXTRA_SERIES])
def test_every_peer_is_a_measured_series_one_key_away(series):
    peers = {s: e2e.series_peer(*s) for s in series}
    assert peers[("fp8_block", "bf16")] is None
    assert e2e.peer_label(("fp8_block", "fp8_e4m3"), peers[("fp8_block", "fp8_e4m3")]) == "kv=bf16"
    assert e2e.peer_label(("int4_g32", "fp8_e4m3"), peers[("int4_g32", "fp8_e4m3")]) == "experts=fp8_block"
    for s, p in peers.items():
        if p is not None:
            assert p in series and sum(a != b for a, b in zip(s, p)) == 1


def test_tiny_cpu_run_rows_and_report():
    rows = e2e.run(Context(device="cpu", quick=True))
    plan = e2e.make_plan(Context(device="cpu", quick=True))
    assert len(rows) == len(plan.series) * len(plan.concurrency)
    by = {(r["case"]["experts"], r["case"]["kv"], r["case"]["concurrency"]): r for r in rows}
    top = max(plan.concurrency)
    for r in rows:
        assert set(r["case"]) == {"kv", "experts", "concurrency", "ctx", "budget_gb", "status"}
        assert r["case"]["budget_gb"] == rows[0]["case"]["budget_gb"]   # one budget for every format
        assert (r["median_us"] is None) == (r["case"]["status"] == e2e.OUT_OF_PAGES)
    oop = by["fp8_block", "bf16", top]
    assert oop["case"]["status"] == e2e.OUT_OF_PAGES and oop["tokens_per_s"] is None
    assert oop["pages_needed"] > oop["pages_held"] and oop["bytes"] == 0
    fp8_kv = by["fp8_block", "fp8_e4m3", top]      # FP8 KV still holds what BF16 cannot
    assert fp8_kv["case"]["status"] == "ok" and fp8_kv["median_us"] > 0
    assert fp8_kv["peer"] == "kv=bf16" and fp8_kv["peer_status"] == e2e.OUT_OF_PAGES
    assert fp8_kv["peer_median_us"] is None and "speedup_vs_peer" not in fp8_kv
    for b in plan.concurrency[:-1]:
        int4 = by["int4_g32", "fp8_e4m3", b]
        assert int4["peer"] == "experts=fp8_block"
        assert int4["peer_median_us"] == by["fp8_block", "fp8_e4m3", b]["median_us"]
        assert int4["tokens_per_s"] == pytest.approx(b / (int4["median_us"] * 1e-6), rel=1e-2)
    meta = {"device": "cpu", "torch": "t", "triton": "t", "date": "d", "commit": "0" * 40, "copy_tbps": 4.0,
            "bf16_tflops": 700.0}
    text = tables({"meta": meta, "cases": rows})
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert "tokens/s" in lines[0] and "pages needed / held" in lines[0]
    oop_line = next(ln for ln in lines if f"| bf16 | fp8_block | {top} |" in ln)
    assert "| — | — |" in oop_line and f"{oop['pages_needed']} / {oop['pages_held']}" in oop_line
    fp8_line = next(ln for ln in lines if f"| fp8_e4m3 | fp8_block | {top} |" in ln)
    assert "| kv=bf16 | out_of_pages |" in fp8_line
