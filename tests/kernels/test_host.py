"""``kernels._host``: the launchers' integer helpers equal Triton's (which cost ~3.5 µs per call from Python)."""
import triton
from hypothesis import given
from hypothesis import strategies as st

from mla_quant.kernels._host import cdiv, next_power_of_2


@given(st.integers(0, 1 << 40), st.integers(1, 1 << 20))
def test_cdiv_is_tritons(a, b):
    assert cdiv(a, b) == triton.cdiv(a, b)


@given(st.integers(0, 1 << 40))
def test_next_power_of_2_is_tritons(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)


def test_edges():
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [0, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert [cdiv(a, 128) for a in (0, 1, 127, 128, 129)] == [0, 1, 1, 1, 2]
