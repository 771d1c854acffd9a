"""Random weights for a built model, in whatever formats its layers hold, without a quantization pass.

Tensors are told apart by their checkpoint suffix (the state_dict keys are the checkpoint's), so this
works for every module of the library:

===========================  =====================================================================
``*.weight_packed`` (INT4)   uniform codes in [-7, 7] (packed); ``weight_scale`` = ``std / 4.32``
``*.weight`` e4m3 (FP8)      ``randn · 64`` cast to e4m3; ``weight_scale_inv`` = ``std / 64``
``*.weight`` [N, K] float    ``normal(0, std)`` with ``std = K^-0.5`` (``embed_tokens``: std 1)
``*.weight`` [D] float       ``1 + 0.1·randn`` (norm gains)
``*.bias``                   ``0.1·randn``;  ``e_score_correction_bias``: ``0.05·rand``
===========================  =====================================================================

(``4.32`` is the standard deviation of integers uniform in [-7, 7], so every format gives weights of
about the same scale.) Meant for tests, examples and benchmarks; fast enough for real widths on a GPU.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.int4_quant import int4_pack

FP8 = torch.float8_e4m3fn
INT4_CODE_STD = (sum(q * q for q in range(-7, 8)) / 15) ** 0.5  # 4.32


@torch.no_grad()
def init_random_weights_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter / persistent buffer of ``model`` in place (see the module docstring)."""
    state = model.state_dict(keep_vars=True)
    gens: dict[torch.device, torch.Generator] = {}

    def gen(t: torch.Tensor) -> torch.Generator:
        if t.device not in gens:
            gens[t.device] = torch.Generator(device=t.device).manual_seed(seed)
        return gens[t.device]

    for key, t in state.items():
        if t.device.type == "meta":
            raise ValueError(f"init_random_weights_: {key!r} is on the meta device")
        prefix, _, suffix = key.rpartition(".")
        if suffix == "weight_packed":
            n, k8 = t.shape
            codes = torch.randint(-7, 8, (n, k8 * 8), generator=gen(t), device=t.device, dtype=torch.int8)
            t.copy_(int4_pack(codes))
            scale = state[prefix + ".weight_scale"]
            scale.fill_((k8 * 8) ** -0.5 / INT4_CODE_STD)
        elif suffix in ("weight_scale", "weight_shape", "weight_scale_inv"):
            continue  # set with their weight (the shape is fixed by the layer)
        elif suffix == "weight" and t.dtype == FP8:
            w = torch.randn(t.shape, generator=gen(t), device=t.device) * 64
            t.copy_(w.clamp(-448, 448).to(FP8))
            state[prefix + ".weight_scale_inv"].fill_(t.shape[1] ** -0.5 / 64)
        elif suffix == "e_score_correction_bias":
            t.copy_(0.05 * torch.rand(t.shape, generator=gen(t), device=t.device))
        elif not t.dtype.is_floating_point:
            continue
        elif suffix == "weight" and t.dim() == 2:
            std = 1.0 if prefix.endswith("embed_tokens") else t.shape[1] ** -0.5
            t.copy_(std * torch.randn(t.shape, generator=gen(t), device=t.device))
        elif suffix == "weight" and t.dim() == 1:
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen(t), device=t.device))
        elif suffix == "bias":
            t.copy_(0.1 * torch.randn(t.shape, generator=gen(t), device=t.device))
        else:
            raise ValueError(f"init_random_weights_: no rule for {key!r} {tuple(t.shape)} {t.dtype}")
    return model
