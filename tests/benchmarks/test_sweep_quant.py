"""The quant sweep's grid on the CPU: every setting is one the launchers accept (checked before dispatch), for every
op of the bench; the sweep itself runs on the GPU only."""
import pytest
import torch

from benchmarks.bench_quant import quant_ops
from benchmarks.sweep_quant import GRID


def test_every_setting_of_the_grid_is_accepted_by_its_launcher():
    x = torch.randn(8, 1152, dtype=torch.bfloat16)  # small: the reference path runs on the CPU
    ops = quant_ops(x)
    assert {op for op, _, _ in ops} == set(GRID)
    for op, call, bytes_moved in ops:
        assert bytes_moved > x.numel()
        for config in [None, *GRID[op]]:
            call(config)


def test_a_bad_setting_is_refused():
    ops = dict((op, call) for op, call, _ in quant_ops(torch.randn(8, 1152, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="config"):
        ops["int4_quantize_g32"]({"BN": 1, "BK": 16, "num_warps": 1})
    with pytest.raises(ValueError, match="config"):
        ops["block_quant_fp8"]({"num_warps": 3})
