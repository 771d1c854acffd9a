"""Host-side helpers shared by the GEMM launchers (``kernels/_gemm_utils.py``): the split-K heuristic and the
autotuners' timing."""
import triton.testing

from mla_quant.kernels._gemm_utils import AUTOTUNE_QUANTILE, autotune_bench, split_k_for


def test_split_k_fills_the_target_without_starving_a_split():
    assert split_k_for(16, 56, 264) == 16     # 16 tiles, 56 K blocks: up to 256 programs
    assert split_k_for(16, 56, 264, max_split=4) == 4
    assert split_k_for(200, 56, 264) == 1     # the tiles alone fill the target
    assert split_k_for(16, 3, 264) == 1       # a split would get fewer than 2 K blocks
    assert split_k_for(1, 8, 264) == 4        # 8 K blocks: 4 splits of 2


def test_autotuners_compare_configs_on_a_low_quantile(monkeypatch):
    """Triton's autotuner asks for (median, p20, p80) and keeps the least first entry: autotune_bench turns the
    first into AUTOTUNE_QUANTILE (host interference only adds time) and passes the rest through."""
    seen = {}

    def fake_do_bench(fn, warmup, rep, quantiles=None):
        seen.update(warmup=warmup, rep=rep, quantiles=quantiles)
        return [1.0, 2.0, 3.0] if quantiles else 1.5

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert autotune_bench(lambda: None, quantiles=(0.5, 0.2, 0.8)) == [1.0, 2.0, 3.0]
    assert seen == {"warmup": 5, "rep": 25, "quantiles": (AUTOTUNE_QUANTILE, 0.2, 0.8)}
    assert autotune_bench(lambda: None, warmup=25, rep=100) == 1.5
    assert seen == {"warmup": 25, "rep": 100, "quantiles": None}
    assert 0 < AUTOTUNE_QUANTILE < 0.5
