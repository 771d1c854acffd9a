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


def test_pdl_only_on_hopper_cuda_devices(monkeypatch):
    """Programmatic dependent launch is asked for on sm_90+ CUDA devices only, never in the interpreter, nor
    for an op in ``_pdl.SKIP`` (launched plainly, its kernel still signals the next one); MLA_QUANT_PDL=0
    (``_pdl.ENABLED``) turns it off; an unknown op is an error."""
    from mla_quant.kernels import _pdl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _pdl.pdl_launch(torch.device("cpu"), "topk") == {"PDL": False}
    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: caps[index])
    _pdl._sm90_or_later.cache_clear()
    try:
        assert _pdl.pdl_launch(torch.device("cuda", 0), "topk") == {"PDL": 2, "launch_pdl": True}   # EARLY
        monkeypatch.setattr(_pdl, "EARLY", False)
        assert _pdl.pdl_launch(torch.device("cuda", 0), "topk") == {"PDL": 1, "launch_pdl": True}
        assert _pdl.pdl_launch(torch.device("cuda", 1), "topk") == {"PDL": False}
        assert _pdl.pdl_launch(torch.device("cuda", 0), "mla_decode") == {"PDL": 1}   # in SKIP: plain launch
        with pytest.raises(ValueError, match="op"):
            _pdl.pdl_launch(torch.device("cuda", 0), "mla_decod")
        monkeypatch.setattr(_pdl, "ENABLED", False)
        assert _pdl.pdl_launch(torch.device("cuda", 0), "topk") == {"PDL": False}
        monkeypatch.setattr(_pdl, "ENABLED", True)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert _pdl.pdl_launch(torch.device("cuda", 0), "topk") == {"PDL": False}
    finally:
        _pdl._sm90_or_later.cache_clear()
