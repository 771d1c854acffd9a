"""The parallel tests run many tiny ops in several processes on a small shared CPU: one intra-op thread per
process (more threads only contend; see tests/models/conftest.py)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
