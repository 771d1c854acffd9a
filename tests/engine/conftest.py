"""Engine tests: tiny fp32 models with random weights.

``dense_model`` (2 dense layers) has no router, so its logits move continuously with the tiny differences
that batching makes in fp32 (a MoE router can flip an expert on a near-tie); ``moe_model`` is the
``KimiK26Config.tiny()`` structure (1 dense + 2 MoE layers)."""
from __future__ import annotations

import pytest
import torch

from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_
from tests.conftest import DEVICE


def build(config, seed: int = 0) -> KimiK26ForCausalLM:
    model = KimiK26ForCausalLM(config, dtype=torch.float32, device=DEVICE)
    init_random_weights_(model, seed)
    return model.eval()


@pytest.fixture(scope="session")
def dense_model():
    return build(KimiK26Config.tiny().replace(num_hidden_layers=2, first_k_dense_replace=2))


@pytest.fixture(scope="session")
def moe_model():
    return build(KimiK26Config.tiny())
