"""The DSA, MLA-decode and W4A16 sweeps' settings on the CPU: each names a knob the library has (a module constant or a
parameter of the radix select), and applying one restores the library afterwards; the sweeps run on the GPU only."""
import inspect

from benchmarks.sweep_dsa import COMBOS, FINISH, INDEXER, PDL, SPARSE, _patched, knob_value
from mla_quant.kernels import _pdl, indexer_scores, sparse_mla_decode, topk


def test_settings_name_existing_knobs_and_are_undone():
    params = inspect.signature(topk._radix_topk).parameters
    assert all(set(s) <= set(params) for s in FINISH)
    modules = ((indexer_scores, INDEXER, "indexer"), (sparse_mla_decode, SPARSE, "sparse"), (_pdl, PDL, "pdl"))
    before = {(m, name): getattr(m, name) for m, grid, _ in modules for s in grid for name in s}
    before.update({(_pdl, name): getattr(_pdl, name) for c in COMBOS for p, s in c if p == "pdl" for name in s})
    radix = topk._radix_topk
    for module, grid, part in modules:
        for setting in grid:
            with _patched(part, setting):
                assert all(getattr(module, k) == knob_value(k, v) for k, v in setting.items())
    with _patched("finish", FINISH[0]):
        assert topk._radix_topk is not radix
    for combo in COMBOS:
        with _patched("combo", combo):
            for part, setting in combo:
                if part == "finish":
                    assert topk._radix_topk is not radix
                else:
                    module = {"indexer": indexer_scores, "sparse": sparse_mla_decode, "pdl": _pdl}[part]
                    assert all(getattr(module, k) == knob_value(k, v) for k, v in setting.items())
    with _patched("default", {}):
        assert topk._radix_topk is radix
    pdl_settings = [*PDL, *(s for c in COMBOS for p, s in c if p == "pdl")]
    assert all(set(s.get("SKIP", ())) <= set(_pdl.OPS) for s in pdl_settings)
    assert topk._radix_topk is radix
    assert all(getattr(m, name) == v for (m, name), v in before.items())


def test_mla_decode_sweep_merge_settings_name_module_constants():
    from benchmarks.sweep_mla_decode import MERGES, _patched
    from mla_quant.kernels import mla_decode

    before = {name: getattr(mla_decode, name) for m in MERGES for name in m}
    seen = []
    _patched(lambda: seen.append({name: getattr(mla_decode, name) for name in MERGES[0]}), MERGES[0])()
    assert seen == [MERGES[0]]
    assert {name: getattr(mla_decode, name) for name in before} == before


def test_fp8_gemm_sweep_only_keeps_the_named_settings_and_auto():
    from benchmarks.sweep_fp8_gemm import settings

    every = settings()
    assert [label for label, _ in every][:2] == ["auto", "portable"] and len(every) > 3
    kept = settings("PERSISTENT=1, portable")
    assert [label for label, _ in kept][:2] == ["auto", "portable"]
    assert all(label in ("auto", "portable") or "PERSISTENT=1" in label for label, _ in kept)
    assert any("PERSISTENT=1" in label for label, _ in kept) and len(kept) < len(every)
    assert settings("no such setting") == every[:1]


def test_w4a16_swap_settings_name_module_constants_and_are_undone():
    from benchmarks.common import module_attrs
    from benchmarks.sweep_w4a16 import SWAP_SETTINGS, name, swap_setting
    from mla_quant.kernels.w4a16_gemm import kernel

    before = (kernel.SWAP_TILE, kernel.SWAP_MAX_SPLIT)
    assert swap_setting(SWAP_SETTINGS[0]) == {"SWAP_TILE": before[0], "SWAP_MAX_SPLIT": before[1]}  # default first
    for setting in SWAP_SETTINGS:
        cfg = swap_setting(setting)
        bn, bk, _, _ = cfg["SWAP_TILE"]
        assert bk % 64 == 0 and bn % 64 == 0  # whole group pairs per K block; wgmma's 64 rows per warp group
        with module_attrs(kernel, cfg):
            assert (kernel.SWAP_TILE, kernel.SWAP_MAX_SPLIT) == setting
        assert name(cfg).startswith("swap")
    assert (kernel.SWAP_TILE, kernel.SWAP_MAX_SPLIT) == before


def test_mla_gluon_sweep_setting_names_map_to_launcher_constants():
    """Every ``gluon_...`` setting of benchmarks.sweep_mla_gluon names constants the launcher has, with the values
    the name spells; other names are rejected."""
    import pytest

    from benchmarks.sweep_mla_gluon import _settings_for
    from mla_quant.kernels import mla_decode

    s = _settings_for("gluon_w8s3p1wssw")
    assert s == {"GLUON_WARPS": 8, "GLUON_STAGES": 3, "GLUON_PER_SM": 1, "GLUON_PER_SM_SHORT": 1,
                 "GLUON_WS": True, "GLUON_SWAP_QK": True}
    assert _settings_for("gluon_w4s2p2")["GLUON_WS"] is False
    assert all(hasattr(mla_decode, k) for k in s)
    with pytest.raises(ValueError, match="setting"):
        _settings_for("gluon_4warps")
    from benchmarks.sweep_mla_gluon import GROUPS  # head_groups settings: fp8_e4m3 (the launcher's choice), bf16 or fp8_ds_mla pages
    assert GROUPS.match("groups8").groups() == (None, "8") and GROUPS.match("bf16_groups4").groups() == ("bf16_", "4")
    assert GROUPS.match("ds_groups8").groups() == ("ds_", "8") and GROUPS.match("ds_mla") is None
    assert GROUPS.match("groups") is None and GROUPS.match("gluon_w4s2p2") is None


def test_interleaved_rounds_vary_each_settings_predecessor():
    """interleaved_graph_us's passes: each setting once per pass, the first pass as given, and later passes in an order
    that gives settings other predecessors (a setting timed after a lighter kernel reads faster on the H200; rotating
    the order would keep every predecessor), the same orders on every call."""
    from benchmarks.common import round_orders

    names = ["bf16", "smm", "auto", "a", "b", "c"]
    orders = round_orders(names, 6)
    assert orders[0] == names and all(sorted(o) == sorted(names) for o in orders)
    predecessors = {n: {o[o.index(n) - 1] for o in orders if o.index(n)} for n in names}
    assert all(len(p) >= 2 for n, p in predecessors.items() if n != "bf16"), predecessors
    assert round_orders(names, 6) == orders


def test_moe_half2_sweep_pins_are_undone():
    """A pinned tile (or gate-up / down pair) holds only within its block: afterwards the autotuner has its configs
    and the choices it had cached, even when the block raised, so a later autotuned setting runs its own tiles."""
    import pytest

    from benchmarks.sweep_moe_half2 import _pinned, _pinned_pair, _rows_config, _tuner

    tuner = _tuner("half2_prefetch")
    configs, cache = tuner.configs, dict(tuner.cache)
    gated = tuner.keys.index("GATED")
    key_up, key_down = (tuple(gate if i == gated else 0 for i in range(len(tuner.keys)))
                        for gate in (True, False))
    chosen = {key_up: configs[0], key_down: configs[-1]}
    tuner.cache.update(chosen)
    try:
        pin, up, down = _rows_config(16, 256, 1), _rows_config(64, 512, 8), _rows_config(64, 256, 4)
        with _pinned(pin, "half2_prefetch"):
            assert tuner.configs == [pin] and not tuner.cache
        assert tuner.configs is configs and tuner.cache == {**cache, **chosen}
        with _pinned_pair(up, down, call=lambda: pytest.fail("the cache had keys: no call needed")):
            assert tuner.cache[key_up] is up and tuner.cache[key_down] is down
        assert tuner.configs is configs and tuner.cache == {**cache, **chosen}
        with pytest.raises(RuntimeError), _pinned(pin, "half2_prefetch"):
            raise RuntimeError("a tile that fails")
        assert tuner.configs is configs and tuner.cache == {**cache, **chosen}
    finally:
        tuner.configs = configs
        tuner.cache.clear()
        tuner.cache.update(cache)


def test_w4a16_sweeps_timing_rows():
    """The W4A16 sweeps' rows: median of each setting's rounds, its ratio to tinygemm of the same rounds and its
    weight bytes per second (and their fraction of the run's copy rate when one was measured), a setting that failed
    kept with its error; fastest first."""
    from benchmarks.sweep_w4a16_gemv import GROUP, timing_rows

    n, k = 64, 256
    rounds = {"tinygemm": [4.0, 9.0, 5.0], "stream": [2.0, 2.5, 3.0], "broken": "CompileTimeAssertionFailure: x"}
    rows = timing_rows(rounds, {"stream": 1e-3, "broken": None}, n, k)
    assert [r["setting"] for r in rows] == ["stream", "tinygemm", "broken"]
    stream = rows[0]
    assert stream["median_us"] == 2.5 and stream["vs_tinygemm"] == 2.0 and stream["rel_err"] == 1e-3
    assert stream["tbps"] == round((n * k // 2 + 2 * n * k // GROUP) / 2.5e-6 / 1e12, 3)
    assert rows[2]["error"].startswith("CompileTimeAssertionFailure") and "median_us" not in rows[2]
    assert "frac_of_copy" not in stream  # no copy rate measured: no fraction
    with_copy = timing_rows(rounds, {}, n, k, copy_tbps=0.5)[0]
    assert with_copy["frac_of_copy"] == round(stream["tbps"] / 0.5, 3)


def test_mlp_decode_sweep_rows():
    """Each setting against its same-round peer (the MLP forms against tinygemm's MLP, the down projections against
    tinygemm's down); INT4 bytes per second over all three projections for the MLP rows, the down's for the down rows;
    an error row keeps its message and no timing."""
    from benchmarks.sweep_mlp_decode import _int4_bytes, _rows

    rounds = {"int4_mlp": [10.0, 12.0, 11.0], "tinygemm_mlp": [22.0, 22.0, 22.0], "down_pairs": [4.0, 4.0, 4.0],
              "down_tinygemm": [8.0, 8.0, 8.0], "swiglu_pairs": [2.0, 2.0, 2.0], "bf16_mlp": "RuntimeError: boom"}
    rows = {r["setting"]: r for r in _rows(rounds, {"int4_mlp": 1e-3}, 7168, 2048, copy_tbps=3.0)}
    mlp, down = rows["int4_mlp"], rows["down_pairs"]
    assert mlp["median_us"] == 11.0 and mlp["vs_peer"] == 2.0 and mlp["rel_err"] == 1e-3
    assert mlp["tbps"] == round(3 * _int4_bytes(7168, 2048) / 11e-6 / 1e12, 3)
    assert mlp["frac_of_copy"] == round(mlp["tbps"] / 3.0, 3)
    assert down["vs_peer"] == 2.0 and down["tbps"] == round(_int4_bytes(7168, 2048) / 4e-6 / 1e12, 3)
    assert "tbps" not in rows["swiglu_pairs"] and "vs_peer" not in rows["swiglu_pairs"]
    assert rows["bf16_mlp"]["error"].startswith("RuntimeError") and "median_us" not in rows["bf16_mlp"]


def test_moe_rows_sweep_rows_and_tile_settings():
    """Each setting's time over FP8's and its weight rate over the copy rate (INT4 settings at INT4's bytes, FP8 at
    its own); an error keeps its message and no rate; a fragment-tile setting sets the launch tiles only while it
    runs."""
    from benchmarks.bench_moe import _expert_bytes
    from benchmarks.sweep_moe_rows import frag_tile_name, frag_tile_setting, token_row
    from mla_quant.kernels.fused_moe import fragments

    rounds = {"int4_gemv": [1000.0, 1200.0, 1100.0], "fp8_block": [2000.0, 2000.0, 2000.0], "int4_tile16": "boom"}
    row = token_row(32, rounds, 190.0, {"int4_gemv": 1e-3}, copy_tbps=3.0)
    assert row["us"]["int4_gemv"] == 1100.0 and row["time_vs_fp8"]["int4_gemv"] == 0.55
    assert row["rows_per_active_expert"] == round(256 / 190.0, 3) and row["block_m_now"] == 1
    assert row["weight_tbps"]["int4_gemv"] == round(190.0 * _expert_bytes("int4_g32") / 1100.0 / 1e6, 3)
    assert row["weight_tbps"]["fp8_block"] == round(190.0 * _expert_bytes("fp8_block") / 2000.0 / 1e6, 3)
    assert row["frac_of_copy"]["int4_gemv"] == round(row["weight_tbps"]["int4_gemv"] / 3.0, 3)
    assert "int4_tile16" not in row["weight_tbps"] and row["us"]["int4_tile16"] == "boom"
    before = dict(fragments.MOE_FRAG_BLOCK_TILES)
    seen = frag_tile_setting(lambda: dict(fragments.MOE_FRAG_BLOCK_TILES), (256, 8, False))()
    assert seen == {"gate_up": (256, 8, False), "down": (256, 8, False)}
    assert fragments.MOE_FRAG_BLOCK_TILES == before
    assert frag_tile_name((256, 8, False)) == "int4_frag16_bk256w8_noprefetch"


def test_measured_context_measures_and_prints_the_ceilings(monkeypatch, capsys):
    """The sweeps' shared start: a CUDA Context whose copy rate and matmul rate this run measured, both printed."""
    import benchmarks.common as common

    def fake(ctx):
        ctx.copy_tbps, ctx.bf16_tflops = 3.0159, 757.6

    monkeypatch.setattr(common, "measure_ceilings", fake)
    ctx = common.measured_context()
    assert ctx.device == "cuda" and (ctx.copy_tbps, ctx.bf16_tflops) == (3.0159, 757.6)
    assert capsys.readouterr().out == "copy 3.016 TB/s, bf16 matmul 758 TFLOP/s\n"
