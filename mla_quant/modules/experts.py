"""``StackedExperts``: all routed experts of one MoE layer, stacked per projection in the kernels' layout.

Storage: for each projection (``gate_proj`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]) the format's
checkpoint tensors with a leading expert dimension, e.g. Int4Group ``gate_proj_weight_packed`` int32
[E, I, H/8] and ``gate_proj_weight_scale`` [E, I, H/32]; FP8Block ``*_weight`` e4m3 [E, N, K] and
``*_weight_scale_inv`` fp32 [E, ⌈N/128⌉, ⌈K/128⌉]; BF16 ``*_weight`` [E, N, K].

The state dict is the checkpoint's, per expert: ``{e}.gate_proj.weight_packed`` / ``.weight_scale`` /
``.weight_shape`` (INT4), ``{e}.gate_proj.weight`` + ``.weight_scale_inv`` (FP8), ``{e}.gate_proj.weight``
(BF16). Saving slices the stacks (views, bit-exact); loading copies each expert into its slot, or with
``load_state_dict(..., assign=True)`` (e.g. into a model built on ``meta``) stacks the checkpoint tensors.
``weight_shape`` is not stored: it is written on save and checked on load.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats import BF16, FP8Block, Int4Group, WeightFormat
from ..kernels.fused_moe import fused_moe, fused_moe_reference
from . import qat as qat_ops

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _quantize(fmt: WeightFormat, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One dense [N, K] weight in ``fmt`` (BF16 takes the model dtype), without ``weight_shape``."""
    tensors = fmt.quantize(w, dtype) if isinstance(fmt, BF16) else fmt.quantize(w)
    tensors.pop("weight_shape", None)
    return tensors


def kernel_args(fmt: WeightFormat) -> dict:
    """How :func:`~mla_quant.kernels.fused_moe.fused_moe` runs experts held in ``fmt``."""
    if isinstance(fmt, BF16):
        return {"kind": "bf16"}
    if isinstance(fmt, FP8Block):
        return {"kind": "fp8_block", "block": fmt.block, "act_quant": fmt.act_quant, "act_group": fmt.act_group,
                "ue8m0": fmt.ue8m0}
    if isinstance(fmt, Int4Group):
        return {"kind": "int4_group", "group_size": fmt.group_size}
    raise TypeError(f"StackedExperts: no MoE kernel for format {fmt!r}")


class StackedExperts(nn.Module):
    """Routed SwiGLU experts ``down(silu(gate(x)) * up(x))`` in one weight format.

    ``forward(x [T, H], topk_weights [T, k], topk_ids [T, k], shared_out=None) -> [T, H]`` (x.dtype).
    With autograd active (grad enabled and an input or weight requiring grad) it runs the differentiable
    torch path; otherwise the fused Triton kernels (on CUDA) or their reference (on CPU).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 fmt: WeightFormat | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.dtype = dtype
        self.fmt = fmt or BF16()
        self.qat: qat_ops.QATConfig | None = None
        kernel_args(self.fmt)
        for proj in PROJECTIONS:
            self.fmt.check_shape(*self.proj_shape(proj))
        self._make_tensors(device)

    # ---- layout -------------------------------------------------------------------------------------
    def proj_shape(self, proj: str) -> tuple[int, int]:
        """[N, K] of one expert's projection."""
        h, i = self.hidden_size, self.intermediate_size
        return (h, i) if proj == "down_proj" else (i, h)

    def _specs(self, proj: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The stored tensors of one expert's projection: name -> (shape, dtype)."""
        n, k = self.proj_shape(proj)
        if self.qat is not None:
            specs = {"weight": ((n, k), self.dtype)}
            if self.qat.frozen_scales:
                specs["weight_scale"] = self.qat.fmt.tensor_specs(n, k)["weight_scale"]
            return specs
        return {s: spec for s, spec in self.fmt.tensor_specs(n, k, self.dtype).items() if s != "weight_shape"}

    @staticmethod
    def _param_name(proj: str, suffix: str) -> str:
        return f"{proj}_{suffix}"

    def _make_tensors(self, device) -> None:
        for proj in PROJECTIONS:
            for suffix, (shape, dt) in self._specs(proj).items():
                t = torch.zeros((self.num_experts, *shape), dtype=dt, device=device)
                trainable = suffix == "weight" and dt == self.dtype
                self.register_parameter(self._param_name(proj, suffix), nn.Parameter(t, requires_grad=trainable))

    def _drop_tensors(self) -> None:
        for proj in PROJECTIONS:
            for suffix in self._specs(proj):
                delattr(self, self._param_name(proj, suffix))

    def tensors(self, proj: str) -> dict[str, torch.Tensor]:
        """The stacked tensors of one projection, keyed by checkpoint suffix ([E, ...] each)."""
        return {s: getattr(self, self._param_name(proj, s)) for s in self._specs(proj)}

    def assign_stacked_(self, proj: str, tensors: dict[str, torch.Tensor]) -> None:
        """Hold ``tensors`` as ``proj`` without copying: the format's stacked tensors ([E, ...], keyed by
        checkpoint suffix, last dimension contiguous), e.g. views of a fused [E, 2I, H] gate-up tensor, or
        weights that already sit on the GPU."""
        specs = self._specs(proj)
        if set(tensors) != set(specs):
            raise ValueError(f"assign_stacked_: {proj} needs {sorted(specs)}, got {sorted(tensors)}")
        for suffix, (shape, dt) in specs.items():
            t, key = tensors[suffix], f"{proj}.{suffix}"
            if tuple(t.shape) != (self.num_experts, *shape):
                raise ValueError(f"assign_stacked_: {key} shape {tuple(t.shape)}, "
                                 f"expected {(self.num_experts, *shape)}")
            if t.dtype != dt and not (t.dtype.is_floating_point and dt.is_floating_point and t.dtype.itemsize > 1
                                      and dt.itemsize > 1):
                raise TypeError(f"assign_stacked_: {key} dtype {t.dtype}, expected {dt}")
            name = self._param_name(proj, suffix)
            trainable = getattr(self, name).requires_grad and t.dtype.is_floating_point
            setattr(self, name, nn.Parameter(t, requires_grad=trainable))

    @property
    def device(self) -> torch.device:
        return self.tensors("gate_proj")[next(iter(self._specs("gate_proj")))].device

    # ---- per-expert access --------------------------------------------------------------------------
    def expert_weight(self, e: int, proj: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert ``e``'s projection as a dense [N, K] matrix (the QAT master in QAT mode)."""
        tensors = {s: t[e] for s, t in self.tensors(proj).items()}
        if self.qat is not None:
            return tensors["weight"].detach().to(dtype)
        return self.fmt.dequantize(tensors, dtype)

    @torch.no_grad()
    def set_expert_weight(self, e: int, proj: str, w: torch.Tensor) -> None:
        """Quantize a dense [N, K] weight into expert ``e``'s slot of ``proj``."""
        if tuple(w.shape) != self.proj_shape(proj):
            raise ValueError(f"set_expert_weight: {proj} weight shape {tuple(w.shape)} != {self.proj_shape(proj)}")
        if self.qat is not None:
            self.tensors(proj)["weight"][e].copy_(w)
            return
        for suffix, t in _quantize(self.fmt, w.to(self.device), self.dtype).items():
            self.tensors(proj)[suffix][e].copy_(t)

    def convert_format_(self, fmt: WeightFormat) -> "StackedExperts":
        """Re-hold every expert in ``fmt`` (dequantize to fp32 and quantize, one expert at a time)."""
        if self.qat is not None:
            raise RuntimeError("StackedExperts: in QAT mode; call export_qat_() before converting")
        kernel_args(fmt)
        for proj in PROJECTIONS:
            fmt.check_shape(*self.proj_shape(proj))
        dense = {p: [self.expert_weight(e, p) for e in range(self.num_experts)] for p in PROJECTIONS}
        device = self.device
        self._drop_tensors()
        self.fmt = fmt
        self._make_tensors(device)
        for p in PROJECTIONS:
            for e, w in enumerate(dense[p]):
                self.set_expert_weight(e, p, w)
        return self

    # ---- QAT -----------------------------------------------------------------------------------------
    def enable_qat_(self, config: qat_ops.QATConfig | None = None) -> "StackedExperts":
        """Hold trainable master weights (model dtype) and run INT4 fake-quant forwards (see qat.py)."""
        if self.qat is not None:
            raise RuntimeError("StackedExperts: QAT is already enabled")
        config = config or qat_ops.QATConfig()
        if not self.dtype.is_floating_point:
            raise TypeError(f"StackedExperts: QAT needs a floating model dtype, got {self.dtype}")
        masters, scales = {}, {}
        for p in PROJECTIONS:
            config.fmt.check_shape(*self.proj_shape(p))
            masters[p] = torch.stack([self.expert_weight(e, p, self.dtype) for e in range(self.num_experts)])
            if config.frozen_scales:
                held = self.tensors(p)
                same_grid = (isinstance(self.fmt, Int4Group) and self.fmt.group_size == config.fmt.group_size)
                scales[p] = (held["weight_scale"].detach().to(config.fmt.torch_scale_dtype) if same_grid
                             else qat_ops.int4_scales(masters[p], config.fmt))
        self._drop_tensors()
        self.qat = config
        self._make_tensors(masters["gate_proj"].device)
        with torch.no_grad():
            for p in PROJECTIONS:
                self.tensors(p)["weight"].copy_(masters[p])
                if config.frozen_scales:
                    self.tensors(p)["weight_scale"].copy_(scales[p])
        return self

    def export_qat_(self) -> "StackedExperts":
        """Leave QAT mode: quantize the masters to the QAT format exactly as the fake-quant forward did."""
        if self.qat is None:
            raise RuntimeError("StackedExperts: not in QAT mode")
        config = self.qat
        exported = {p: qat_ops.export_int4(self.tensors(p)["weight"], config.fmt,
                                           self.tensors(p).get("weight_scale")) for p in PROJECTIONS}
        device = self.device
        self._drop_tensors()
        self.qat, self.fmt = None, config.fmt
        self._make_tensors(device)
        with torch.no_grad():
            for p in PROJECTIONS:
                for suffix, t in exported[p].items():
                    self.tensors(p)[suffix].copy_(t)
        return self

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_out: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"StackedExperts: x must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        gate, up, down = (self.tensors(p) for p in PROJECTIONS)
        if self.qat is not None:
            scales = ({p: self.tensors(p)["weight_scale"] for p in PROJECTIONS} if self.qat.frozen_scales
                      else None)
            return qat_ops.qat_experts_forward(x, topk_weights, topk_ids,
                                               {p: self.tensors(p)["weight"] for p in PROJECTIONS},
                                               scales, self.qat.fmt, shared_out)
        args = kernel_args(self.fmt)
        weights = [t for w in (gate, up, down) for t in w.values()]
        tracked = (x, topk_weights, *weights) + ((shared_out,) if shared_out is not None else ())
        if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
            return fused_moe_reference(x, topk_weights, topk_ids, gate, up, down, shared_out=shared_out, **args)
        return fused_moe(x.contiguous(), topk_weights, topk_ids, gate, up, down, shared_out=shared_out, **args)

    # ---- checkpoint layout ---------------------------------------------------------------------------
    def _checkpoint_suffixes(self, proj: str) -> list[str]:
        suffixes = list(self._specs(proj))
        if self.qat is None and isinstance(self.fmt, Int4Group):
            suffixes.append("weight_shape")
        return suffixes

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for e in range(self.num_experts):
            for proj in PROJECTIONS:
                for suffix in self._checkpoint_suffixes(proj):
                    key = f"{prefix}{e}.{proj}.{suffix}"
                    if suffix == "weight_shape":
                        destination[key] = torch.tensor(self.proj_shape(proj), dtype=torch.int64, device=self.device)
                    else:
                        t = getattr(self, self._param_name(proj, suffix))
                        destination[key] = (t if keep_vars else t.detach())[e]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        assign = local_metadata.get("assign_to_params_buffers", False)
        expected = set()
        for proj in PROJECTIONS:
            for suffix in self._checkpoint_suffixes(proj):
                keys = [f"{prefix}{e}.{proj}.{suffix}" for e in range(self.num_experts)]
                expected.update(keys)
                missing_keys.extend(k for k in keys if k not in state_dict)
                present = [(e, k) for e, k in enumerate(keys) if k in state_dict]
                if suffix == "weight_shape":
                    self._check_weight_shapes(proj, [(k, state_dict[k]) for _, k in present], error_msgs)
                elif present:
                    self._load_stack(proj, suffix, present, state_dict, assign, error_msgs)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)

    def _check_weight_shapes(self, proj, items, error_msgs) -> None:
        want = list(self.proj_shape(proj))
        for key, t in items:
            if t.is_meta:
                continue
            if t.numel() != 2 or t.tolist() != want:
                error_msgs.append(f"{key}: weight_shape {t.tolist()} does not match this layer's {want}")

    def _load_stack(self, proj, suffix, present, state_dict, assign, error_msgs) -> None:
        name = self._param_name(proj, suffix)
        param = getattr(self, name)
        want = tuple(param.shape[1:])
        for _, key in present:
            t = state_dict[key]
            if not isinstance(t, torch.Tensor):
                error_msgs.append(f"{key}: expected a tensor, got {type(t).__name__}")
                return
            if tuple(t.shape) != want:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(t.shape)} from "
                                  f"checkpoint, the shape of one expert in current model is {want}.")
                return
        with torch.no_grad():
            if assign and len(present) == self.num_experts:
                # Stack the checkpoint tensors: the layer takes their device and dtype (assign semantics).
                stacked = torch.stack([state_dict[k] for _, k in present])
                setattr(self, name, nn.Parameter(stacked, requires_grad=param.requires_grad))
                return
            if param.is_meta:
                if not assign:
                    error_msgs.append(f"{present[0][1]}: loading into experts on the meta device needs "
                                      "load_state_dict(..., assign=True)")
                    return
                first = state_dict[present[0][1]]
                param = nn.Parameter(torch.empty(param.shape, dtype=first.dtype, device=first.device),
                                     requires_grad=param.requires_grad)
                setattr(self, name, param)
            for e, key in present:
                param[e].copy_(state_dict[key])

    def extra_repr(self) -> str:
        mode = f", qat={self.qat!r}" if self.qat is not None else ""
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, fmt={self.fmt!r}{mode}")
