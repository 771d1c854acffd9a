"""GPTQ for INT4 group weights: round column by column, pushing each column's rounding error onto the columns not
yet rounded, in the directions the calibration inputs say matter (Frantar et al., "GPTQ", 2022).

For a linear layer ``y = x @ W.T`` with calibration inputs X [T, K], the output error of a quantized Q is
``‖X (W − Q)^T‖² = Σ_rows (w − q) H (w − q)^T`` with the Hessian ``H = X^T X`` [K, K]. GPTQ rounds column j, then
updates the remaining columns by the error times row j of the inverse Hessian's upper Cholesky factor U
(``H^-1 = U^T U``): the best correction of the later columns for that error, given the inputs. Columns are taken in
blocks of ``block_size`` (the updates inside a block are applied at once to the columns past it).

The result is the library's ``Int4Group`` layout exactly (compressed-tensors ``pack-quantized``: symmetric codes
in [-8, 7], one scale per row and group of ``group_size`` columns, stored in ``scale_dtype``): a group's scale is
chosen when the loop reaches its first column, from the group's columns as updated so far (``clip="absmax"``:
``absmax / 7.5`` as ``rtn``; ``"mse"``: the clipping search of ``convert.int4_quantize_mse``), and every column is
rounded as ``int4_codes`` rounds it (times the once-rounded reciprocal of the stored scale). So
``Int4Group.dequantize`` of the result is exactly the Q the loop accounted for.

``gptq_quantize`` also takes a batch ([E, N, K] weights, [E, K, K] Hessians: a layer's experts in one column loop).
``HessianCollector`` accumulates H for the linear layers (``nn.Linear`` and ``QuantLinear``) and, per routed expert,
for ``StackedExperts`` (gate / up: the tokens routed to the expert; down: silu(gate)·up of those tokens) while a
model runs calibration batches; ``HessianFile`` reads its saved file for ``python -m mla_quant.convert --method
gptq``. ``gptq_`` quantizes a loaded model in memory, decoder layer by decoder layer, each calibrated on the outputs
of the layers already quantized. Columns that no calibration token touched (a zero diagonal) are rounded to nearest
and pass no error on. See docs/recipes.md "GPTQ".
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .kernels.fp8_quant.reference import reciprocal
from .kernels.int4_quant.reference import (QMAX, QMIN, int4_dequantize_reference, int4_group_scales,
                                           int4_pack_reference, int4_quantize_reference)

CLIPS = ("absmax", "mse")
HESSIAN_SUFFIX, TOKENS_SUFFIX = ".hessian", ".tokens"


# ---------------------------------------------------------------------------------------------- the algorithm
def _group_scale(wg: torch.Tensor, scale_dtype: torch.dtype, clip: str, grid: tuple[float, ...]) -> torch.Tensor:
    """The stored scales [..., N] of one group's columns wg [..., N, g]: absmax / 7.5 (``int4_group_scales``) or the
    clipping search of ``convert.int4_quantize_mse`` over ``grid``."""
    flat = wg.reshape(-1, wg.shape[-1])
    if clip == "mse":
        from .convert import int4_quantize_mse

        scale = int4_quantize_mse(flat, flat.shape[1], scale_dtype, grid)[1]
    else:
        scale = int4_group_scales(flat, flat.shape[1], scale_dtype)
    return scale.reshape(wg.shape[:-1])


def _inverse_factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """U [..., K, K], upper triangular with U^T U = (H + λ I)^-1, λ = ``damp`` · mean(diag H) per matrix (raised
    tenfold, up to 4 times, for a matrix whose H + λ I is not positive definite). Zero-diagonal (never touched)
    columns are decoupled, with 1 on the diagonal."""
    h = hessian.double()
    dead = torch.diagonal(h, dim1=-2, dim2=-1) == 0
    live = (~dead).double()
    h = h * live[..., :, None] * live[..., None, :] + torch.diag_embed(dead.double())
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    lam = damp * torch.diagonal(h, dim1=-2, dim2=-1).mean(-1)               # [...]
    for _ in range(5):
        chol, info = torch.linalg.cholesky_ex(h + lam[..., None, None] * eye)
        failed = info != 0
        if not failed.any():
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True).float()
        lam = torch.where(failed, lam * 10, lam)
    raise ValueError(f"hessian: not positive definite even with damping {lam.max().item():.3g} (damp={damp})")


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int = 32,
                  scale_dtype: torch.dtype = torch.bfloat16, *, damp: float = 0.01, block_size: int = 128,
                  clip: str = "absmax", grid: tuple[float, ...] | None = None,
                  act_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ-round w [..., N, K] for inputs whose Hessian is ``hessian`` [..., K, K] (``X^T X`` up to a positive
    factor; the same leading dimensions: e.g. all experts of a layer at once, whose column loop then runs once).

    Returns ``(weight_packed int32 [..., N, K/8], weight_scale [..., N, K/group_size] scale_dtype)``, the
    ``Int4Group`` tensors. ``damp``: the fraction of the mean diagonal added to H; ``block_size``: columns per lazy
    update (a multiple of ``group_size``); ``clip``: "absmax" or "mse" (``grid``: the clipping factors, default
    ``convert.MSE_GRID``). ``act_order``: round the columns by decreasing Hessian diagonal (the inputs' energy), with
    every group's scale fixed first from w as given, so the groups and the stored layout stay as without it
    (compressed-tensors' ``actorder: "weight"``). With a diagonal Hessian nothing is passed on, and the result equals
    round-to-nearest (``clip="absmax"``) or the MSE search (``"mse"``) bit for bit, in either order."""
    if w.dim() < 2:
        raise ValueError(f"w: expected [..., N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    if tuple(hessian.shape) != (*lead, k, k):
        raise ValueError(f"hessian: shape {tuple(hessian.shape)}, expected {(*lead, k, k)} for w of shape "
                         f"{tuple(w.shape)}")
    if group_size <= 0 or k % group_size or k % 8:
        raise ValueError(f"group_size: {group_size} must divide K = {k} (and K must be a multiple of 8)")
    if block_size <= 0 or block_size % group_size:
        raise ValueError(f"block_size: {block_size} must be a positive multiple of group_size {group_size}")
    if clip not in CLIPS:
        raise ValueError(f"clip: {clip!r} not in {CLIPS}")
    if not (torch.isfinite(hessian).all() and torch.isfinite(w).all()):
        raise ValueError("w and hessian must be finite")
    if grid is None:
        from .convert import MSE_GRID as grid  # noqa: N811 - the converter's grid, one definition
    hessian = hessian.to(w.device)
    work = w.float().transpose(-1, -2).contiguous()   # [..., K, N]: a column of w is a contiguous row here
    codes = torch.empty(*lead, k, n, dtype=torch.int8, device=w.device)
    scales = torch.empty(*lead, k // group_size, n, dtype=scale_dtype, device=w.device)
    if act_order:  # the loop runs over permuted columns; each column keeps its own group's scale, fixed first
        perm = torch.argsort(torch.diagonal(hessian, dim1=-2, dim2=-1), dim=-1, descending=True, stable=True)
        rows = perm[..., :, None].expand(*lead, k, k)
        hessian = hessian.gather(-2, rows).gather(-1, perm[..., None, :].expand(*lead, k, k))
        groups = work.reshape(*lead, k // group_size, group_size, n).transpose(-1, -2)   # [..., G, N, g]
        scales = _group_scale(groups, scale_dtype, clip, grid)                           # [..., G, N]
        by_row = perm[..., :, None].expand(*lead, k, n)
        column_scales = scales.float().repeat_interleave(group_size, dim=-2).gather(-2, by_row)
        work = work.gather(-2, by_row)
    u = _inverse_factor(hessian, damp)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        block, ub = work[..., b0:b1, :].clone(), u[..., b0:b1, b0:b1]
        errors = torch.empty_like(block)
        for j in range(b1 - b0):
            col = b0 + j
            if act_order:
                s = column_scales[..., col, :]
            elif col % group_size == 0:  # the group's scale, from its columns as updated so far
                g = col // group_size
                scales[..., g, :] = _group_scale(block[..., j:j + group_size, :].transpose(-1, -2), scale_dtype,
                                                 clip, grid)
                s = scales[..., g, :].float()
            if act_order or col % group_size == 0:  # a zero scale (an all-zero group) gives codes 0, as int4_codes
                zero, recip = s == 0, reciprocal(s.masked_fill(s == 0, 1.0))
            q = torch.where(zero, 0.0, torch.round(block[..., j, :] * recip)).clamp_(QMIN, QMAX)
            codes[..., col, :] = q.to(torch.int8)
            err = (block[..., j, :] - q * s) / ub[..., j, j, None]
            block[..., j:, :] -= ub[..., j, j:, None] * err[..., None, :]  # the block's later columns take it
            errors[..., j, :] = err
        work[..., b1:, :] -= u[..., b0:b1, b1:].transpose(-1, -2) @ errors   # the columns past the block, at once
    if act_order:  # the codes back in the weight's own column order
        codes = torch.empty_like(codes).scatter_(-2, by_row, codes)
    packed = int4_pack_reference(codes.transpose(-1, -2).reshape(-1, k)).reshape(*lead, n, k // 8)
    # a fresh row-major scale tensor (.contiguous() keeps odd strides on a size-1 dimension)
    scale = torch.empty(*lead, n, k // group_size, dtype=scale_dtype, device=w.device)
    return packed, scale.copy_(scales.transpose(-1, -2))


def output_error(w: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> dict[str, float]:
    """The error a weight's outputs see on the calibration inputs: ``tr((W − Ŵ) H (W − Ŵ)^T)`` against
    ``tr(W H W^T)`` as a relative error (square root of the ratio) and an SQNR in dB."""
    d, w64, h = (w.double() - approx.double()), w.double(), hessian.double().to(w.device)
    noise = ((d @ h) * d).sum().item()
    signal = ((w64 @ h) * w64).sum().item()
    rel = math.sqrt(max(noise, 0.0) / signal) if signal > 0 else 0.0
    sqnr = math.inf if noise <= 0 else 10 * math.log10(signal / noise) if signal > 0 else -math.inf
    return {"out_rel_err": rel, "out_sqnr_db": sqnr}


# ---------------------------------------------------------------------------------------------- calibration
def _targets(model: nn.Module, pattern: str | None) -> list[tuple[str, nn.Module]]:
    """The modules whose inputs GPTQ needs, matching ``pattern`` (``re.search``; None: all): linear layers
    (``nn.Linear``, ``QuantLinear``) by name, ``StackedExperts`` by their first expert's ``.0.gate_proj`` name."""
    from .modules.experts import StackedExperts
    from .modules.linear import QuantLinear

    rx = re.compile(pattern) if pattern else None
    return [(name, m) for name, m in model.named_modules()
            if (isinstance(m, StackedExperts) and (rx is None or rx.search(name + ".0.gate_proj")))
            or (isinstance(m, (nn.Linear, QuantLinear)) and (rx is None or rx.search(name)))]


def _shared_name(name: str) -> str | None:
    """The name under which :class:`HessianCollector` (``all_experts=True``) keeps the one gate / up Hessian every
    expert of a layer shares: ``...experts.{e}.{gate,up}_proj`` -> ``...experts.*.gate_proj``; None for others."""
    match = re.fullmatch(r"((?:.*\.)?experts)\.\d+\.(gate|up)_proj", name)
    return f"{match.group(1)}.*.gate_proj" if match else None


def _with_up_proj(per_layer: dict) -> dict:
    """``per_layer`` with each routed expert's ``up_proj`` entry the same as its ``gate_proj`` one (same inputs)."""
    out = dict(per_layer)
    for name in [n for n in per_layer if re.search(r"(^|\.)experts\.\d+\.gate_proj$", n)]:
        out[name[:-len("gate_proj")] + "up_proj"] = per_layer[name]
    return out


class HessianCollector:
    """Accumulate ``X^T X`` (fp32 on the inputs' device, or ``dtype``) of the linear layers and routed experts of
    ``model`` whose names match ``pattern`` (a regex, ``re.search``; default every one) while the model runs.

        with HessianCollector(model, r"mlp\\.experts") as hc:
            for batch in calibration:
                model(batch)
        hc.save("hessians.safetensors")          # convert --method gptq --hessians hessians.safetensors

    Names are the model's module names; a ``StackedExperts`` module ``...mlp.experts`` yields one per expert and
    projection, ``...mlp.experts.{e}.{gate,up,down}_proj`` as the checkpoints name them (gate and up share one
    Hessian tensor: the same inputs). ``hessians()`` returns ``{name: H / tokens}`` and ``tokens()`` the rows each
    saw. ``targets`` (``[(name, module)]``, instead of matching ``pattern``) hooks exactly those modules. Memory: K²
    floats per layer (7168² · 4 B = 205 MB for one of Kimi's gate / up inputs), so a real model is calibrated layer
    by layer (a pattern per layer), not all at once.

    ``all_experts``: every calibration token goes to every routed expert, for the Hessians only (the layer's output
    is the routed one): each expert's gate / up Hessian is the layer's whole input (one tensor, shared; saved once
    as ``...experts.*.gate_proj``) and its down Hessian is of silu(gate) · up of every token. An expert then sees
    all T calibration rows instead of ``T · top_k / E`` (docs/recipes.md "How much calibration text"), at E times
    the routed experts' compute while calibrating."""

    def __init__(self, model: nn.Module, pattern: str | None = None, dtype: torch.dtype = torch.float32, *,
                 targets: list[tuple[str, nn.Module]] | None = None, all_experts: bool = False):
        from .modules.experts import StackedExperts

        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.all_experts = all_experts
        self._dtype, self._handles, self._experts = dtype, [], {}  # StackedExperts name -> its expert count
        for name, module in _targets(model, pattern) if targets is None else targets:
            if isinstance(module, StackedExperts):
                self._handles.append(module.register_forward_pre_hook(self._experts_hook(name), with_kwargs=True))
                self._experts[name] = module.num_experts
            else:
                self._handles.append(module.register_forward_pre_hook(self._linear_hook(name)))
        if not self._handles:
            raise ValueError(f"HessianCollector: no linear layer or StackedExperts matches {pattern!r}")

    def _add(self, name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self._dtype)
        if name not in self.sums:
            self.sums[name] = torch.zeros(x.shape[1], x.shape[1], dtype=self._dtype, device=x.device)
            self.counts[name] = 0
        self.sums[name].addmm_(x.T, x)
        self.counts[name] += x.shape[0]

    def _linear_hook(self, name: str):
        def hook(module, args):
            self._add(name, args[0].detach())
        return hook

    def _experts_hook(self, name: str):
        def hook(module, args, kwargs):   # forward(x, topk_weights, topk_ids, shared_out=None), by position or name
            named = dict(zip(("x", "topk_weights", "topk_ids"), args), **kwargs)
            x, topk_ids = named["x"].detach(), named["topk_ids"]
            x = x.reshape(-1, x.shape[-1]).float()
            if self.all_experts:
                self._add(f"{name}.*.gate_proj", x)
            for e in range(module.num_experts) if self.all_experts else torch.unique(topk_ids).tolist():
                xe = x if self.all_experts else x[(topk_ids.reshape(x.shape[0], -1) == e).any(dim=-1)]
                gate = xe @ module.expert_weight(e, "gate_proj").T
                up = xe @ module.expert_weight(e, "up_proj").T
                if not self.all_experts:
                    self._add(f"{name}.{e}.gate_proj", xe)
                self._add(f"{name}.{e}.down_proj", torch.nn.functional.silu(gate) * up)
        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "HessianCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _per_expert(self, per_layer: dict) -> dict:
        """``per_layer`` with a shared ``...experts.*.gate_proj`` entry (``all_experts``) given to every expert."""
        out = {n: v for n, v in per_layer.items() if ".*." not in n}
        for name, experts in self._experts.items():
            if f"{name}.*.gate_proj" in per_layer:
                out.update({f"{name}.{e}.gate_proj": per_layer[f"{name}.*.gate_proj"] for e in range(experts)})
        return _with_up_proj(out)

    def hessians(self) -> dict[str, torch.Tensor]:
        """``{name: X^T X / tokens}``, with ``up_proj`` entries sharing their expert's ``gate_proj`` tensor (and, with
        ``all_experts``, every expert of a layer sharing one gate / up tensor)."""
        return self._per_expert({name: s / max(self.counts[name], 1) for name, s in self.sums.items()})

    def tokens(self) -> dict[str, int]:
        """Rows each layer saw; every projection of a hooked ``StackedExperts`` is listed, 0 for an expert that no
        calibration token was routed to (GPTQ rounds it to nearest: an all-zero Hessian)."""
        counts = {f"{name}.{e}.{p}": 0 for name, experts in self._experts.items() for e in range(experts)
                  for p in ("gate_proj", "down_proj")}
        return self._per_expert({**counts, **self.counts})

    def save(self, path: str | Path) -> None:
        """One safetensors file: ``{name}.hessian`` fp32 [K, K] and ``{name}.tokens`` int64 [1] per layer that saw
        tokens (``up_proj`` entries written as their own copies: safetensors stores no shared tensors; with
        ``all_experts`` the gate / up Hessian every expert shares once, as ``...experts.*.gate_proj``), and only
        ``{name}.tokens`` = 0 for an expert that saw none."""
        tensors = {name + TOKENS_SUFFIX: torch.tensor([count], dtype=torch.int64)
                   for name, count in self.tokens().items()}
        hessians = self.hessians()
        shared = {_shared_name(n) for n in hessians} & {n for n in self.sums if ".*." in n}
        for name, h in hessians.items():
            if _shared_name(name) not in shared:
                tensors[name + HESSIAN_SUFFIX] = h.float().cpu().clone()
        for name in shared:
            tensors[name + HESSIAN_SUFFIX] = (self.sums[name] / max(self.counts[name], 1)).float().cpu()
        save_file(tensors, str(path), metadata={"format": "pt", "content": "mla_quant GPTQ hessians"})


class HessianFile:
    """A file written by :meth:`HessianCollector.save`, read lazily (one layer's Hessian at a time). ``get(name)``
    also finds a checkpoint name whose model name is stored (Kimi K2.6's ``language_model.`` prefix dropped); an
    expert that saw no calibration token gets an all-zero Hessian of ``size``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"hessians: no file {str(self.path)!r}")
        self._file = safe_open(str(self.path), "pt")
        self._keys = set(self._file.keys())
        self.names = {k[:-len(TOKENS_SUFFIX)] for k in self._keys if k.endswith(TOKENS_SUFFIX)}
        self.unseen = {n for n in self.names if self._hessian_key(n) is None}

    def _hessian_key(self, name: str) -> str | None:
        """The stored Hessian of ``name``: its own, or the one its layer's experts share (``all_experts``)."""
        for candidate in (name, _shared_name(name)):
            if candidate and candidate + HESSIAN_SUFFIX in self._keys:
                return candidate + HESSIAN_SUFFIX
        return None

    def find(self, name: str) -> str | None:
        for candidate in (name, name.removeprefix("language_model.")):
            if candidate in self.names:
                return candidate
        return None

    def get(self, name: str, size: int | None = None) -> torch.Tensor:
        found = self.find(name)
        if found is None:
            raise KeyError(f"hessians: no Hessian for {name!r} in {str(self.path)!r} (run the calibration with a "
                           f"pattern that matches it)")
        if found in self.unseen:
            if size is None:
                raise ValueError(f"hessians: {name!r} saw no calibration token; pass size= for its zero Hessian")
            return torch.zeros(size, size)
        return self._file.get_tensor(self._hessian_key(found))


# ---------------------------------------------------------------------------------------------- in memory
EXPERTS_PATTERN = r"mlp\.experts\."   # the routed experts (every expert projection of a StackedExperts)


def _layer_prefix(name: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``model.layers.3.``; a module outside the decoder layers -> ``""``."""
    match = re.match(r"(.*?\blayers\.\d+\.)", name)
    return match.group(1) if match else ""


@torch.no_grad()
def _gptq_experts(experts, name: str, hc: HessianCollector, fmt, batch: int, **options) -> list[dict]:
    """Re-hold a ``StackedExperts`` module's experts in ``fmt`` by GPTQ on ``hc``'s Hessians, ``batch`` experts per
    call (one column loop for them). An expert no calibration token reached rounds to nearest (zero Hessian)."""
    from .modules.experts import PROJECTIONS

    hessians, tokens, count = hc.hessians(), hc.tokens(), experts.num_experts
    dense = {p: [experts.expert_weight(e, p) for e in range(count)] for p in PROJECTIONS}
    experts.convert_format_(fmt)
    rows = []
    for p in PROJECTIONS:
        n, k = experts.proj_shape(p)
        for e0 in range(0, count, batch):
            ids = list(range(e0, min(count, e0 + batch)))
            w = torch.stack([dense[p][e] for e in ids])
            h = torch.stack([hessians.get(f"{name}.{e}.{p}", torch.zeros(k, k, device=w.device)).to(w.device)
                             for e in ids])
            packed, scale = gptq_quantize(w, h, fmt.group_size, fmt.torch_scale_dtype, **options)
            experts.tensors(p)["weight_packed"][e0:e0 + len(ids)] = packed
            experts.tensors(p)["weight_scale"][e0:e0 + len(ids)] = scale
            for i, e in enumerate(ids):
                if f"{name}.{e}.{p}" in hessians:
                    rows.append(_error_row(f"{name}.{e}.{p}", w[i], fmt, (packed[i], scale[i]), h[i],
                                           tokens[f"{name}.{e}.{p}"]))
    return rows


def _error_row(name: str, w: torch.Tensor, fmt, got: tuple, h: torch.Tensor, tokens: int) -> dict:
    """Output errors on the calibration inputs of GPTQ's result and of round-to-nearest, and the calibration rows
    the weight saw (``tokens``: GPTQ fits those inputs; with fewer than a few times K rows it can do worse than
    round-to-nearest on other inputs, docs/recipes.md)."""
    def approx(tensors):
        return int4_dequantize_reference(*tensors, fmt.group_size, torch.float32)

    rtn = int4_quantize_reference(w, fmt.group_size, fmt.torch_scale_dtype)
    return {"name": name, "tokens": tokens, "gptq": output_error(w, approx(got), h),
            "rtn": output_error(w, approx(rtn), h)}


@torch.no_grad()
def gptq_(model: nn.Module, calibration, pattern: str = EXPERTS_PATTERN, fmt=None, *, clip: str = "absmax",
          damp: float = 0.01, act_order: bool = False, expert_batch: int = 32, all_experts: bool = False) -> list[dict]:
    """Quantize ``model``'s layers matching ``pattern`` to INT4 by GPTQ, in memory and in order: decoder layer by
    decoder layer, the Hessians of that layer's matching modules are collected while ``calibration`` runs (an
    iterable of model inputs, run as ``model(batch)``, once per decoder layer), the layer is quantized, and the
    next layer is calibrated on the outputs of the layers already quantized, the inputs it will see when served.
    Only one decoder layer's Hessians are held at a time.

    ``fmt``: an ``Int4Group`` (default group 32); routed experts (``StackedExperts``) go ``expert_batch`` experts
    per ``gptq_quantize`` call (``clip``, ``damp``, ``act_order`` passed on); ``QuantLinear`` layers one at a
    time. ``all_experts``: each routed expert calibrated on every calibration token (:class:`HessianCollector`).
    Returns one row per quantized weight: its calibration rows (``tokens``) and its output error on those inputs
    after GPTQ and after round-to-nearest (``output_error``)."""
    from .formats import Int4Group
    from .modules.experts import StackedExperts

    fmt = fmt or Int4Group(32)
    if not isinstance(fmt, Int4Group):
        raise TypeError(f"gptq_: fmt must be an Int4Group, got {fmt!r}")
    targets = _targets(model, pattern)
    if not targets:
        raise ValueError(f"gptq_: no linear layer or StackedExperts of the model matches {pattern!r}")
    plain = [name for name, m in targets if type(m) is nn.Linear]
    if plain:
        raise TypeError(f"gptq_: {plain[:3]} are plain nn.Linear; hold them as QuantLinear first (quantize_ with "
                        f"BF16())")
    batches = list(calibration)
    layers: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in targets:
        layers.setdefault(_layer_prefix(name), []).append((name, module))
    rows = []
    for prefix in sorted(layers, key=lambda p: (p == "", int(re.findall(r"\d+", p)[-1]) if p else 0)):
        with HessianCollector(model, targets=layers[prefix], all_experts=all_experts) as hc:
            for batch in batches:
                model(batch)
        hessians, tokens = hc.hessians(), hc.tokens()
        for name, module in layers[prefix]:
            if isinstance(module, StackedExperts):
                rows += _gptq_experts(module, name, hc, fmt, expert_batch, clip=clip, damp=damp, act_order=act_order)
            else:
                if name not in hessians:
                    raise ValueError(f"gptq_: {name!r} saw no calibration input (is it on the calibration path?)")
                w, h = module.weight_dequantized(torch.float32), hessians[name]
                got = gptq_quantize(w, h.to(w.device), fmt.group_size, fmt.torch_scale_dtype, clip=clip, damp=damp,
                                    act_order=act_order)
                module.convert_format_(fmt)
                module.weight_packed.data.copy_(got[0])
                module.weight_scale.data.copy_(got[1])
                rows.append(_error_row(name, w, fmt, got, h, tokens[name]))
        del hc, hessians
    return rows
