import pytest
import torch

from mla_quant.kernels import _backend


def test_cpu_tensors_use_the_reference_unless_forced(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MLA_QUANT_BACKEND", raising=False)
    assert not _backend.use_triton(torch.zeros(1))
    monkeypatch.setenv("MLA_QUANT_BACKEND", "torch")
    assert not _backend.use_triton(torch.zeros(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("MLA_QUANT_BACKEND", "auto")
    assert _backend.use_triton(torch.zeros(1))


def test_forcing_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MLA_QUANT_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        _backend.use_triton(torch.zeros(1))


def test_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv("MLA_QUANT_BACKEND", "cuda")
    with pytest.raises(ValueError, match="MLA_QUANT_BACKEND='cuda'"):
        _backend.use_triton(torch.zeros(1))
