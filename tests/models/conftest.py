"""Model tests run many tiny ops: on a small, shared CPU one intra-op thread is far faster (thread
start-up and contention dominate; an index_add of a few hundred floats took 2.7 ms with 2 threads under
load, 5 µs with 1)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
