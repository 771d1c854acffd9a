"""Test set-up: seeds, the ``gpu`` marker, backend fixtures and Hypothesis profiles.

Without CUDA, Triton kernels run under the interpreter (``TRITON_INTERPRET=1`` must be set before any
kernel is decorated, hence here) while the default backend stays the torch reference; tests that check a
kernel against its reference ask for the ``triton_backend`` fixture.
"""
from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("MLA_QUANT_BACKEND", "torch")
    # The test tensors are tiny: on a 2-core CI machine intra-op threads cost more than they give
    # (a small decode step measured 1.35 s with two threads, 0.09 s with one).
    torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", max_examples=20, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=50, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

DEVICE = "cuda" if HAS_CUDA else "cpu"
# Hopper's fp8 tensor-core MMA accumulates a 128-deep K block with fewer than fp32's mantissa bits (the
# reason DeepGEMM promotes per block, as fp8_gemm does): 6.3e-4 relative error was measured on the H200 for
# one block. The interpreter multiplies in fp32, so there fp8 GEMMs must match their references to 1e-5.
FP8_MMA_REL_TOL = 2e-3 if HAS_CUDA else 1e-5


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on the H200)")
    skip_slow = pytest.mark.skip(reason="slow: set MLA_QUANT_SLOW=1")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and os.environ.get("MLA_QUANT_SLOW") != "1":
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def triton_backend(monkeypatch):
    """Run the ops' Triton kernels: on the GPU, or interpreted on the CPU."""
    monkeypatch.setenv("MLA_QUANT_BACKEND", "triton")
    return DEVICE


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("MLA_QUANT_BACKEND", "torch")
    return DEVICE
