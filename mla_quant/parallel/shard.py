"""Slicing weights in their formats: the part of a quantized weight one rank keeps, scales included.

A weight ``[N, K]`` is split along its rows (output features: column-parallel) or its columns (input
features: row-parallel). Each tensor of the format is cut at the matching place:

=========  ==========================================  =====================  ======================
format     tensor [rows, cols]                         rows split at           columns split at
=========  ==========================================  =====================  ======================
BF16       ``weight`` [N, K]                           any row                 any column
FP8Block   ``weight`` [N, K] + ``weight_scale_inv``    a multiple of ``bn``    a multiple of ``bk``
           [⌈N/bn⌉, ⌈K/bk⌉]                            (blocks stay whole)     (and of ``act_group``)
Int4Group  ``weight_packed`` [N, K/8] + ``weight_scale`` any row               a multiple of the group
           [N, K/g] (+ ``weight_shape`` rewritten)                             (groups stay whole)
=========  ==========================================  =====================  ======================

Every shard is cloned out of the full tensor, so a rank keeps only its own bytes. Each sliced module records
its :class:`Split` (``module._mq_split``: which dimension, which range); :func:`shards_of` derives from it
the :class:`Shard` of every tensor the module holds now, in the full tensor's coordinates (so the record
stays right after ``quantize_`` converts the module to another format): the loader reads exactly those
slices from the checkpoint, and :func:`sharded_bytes` counts them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..formats import BF16, FP8Block, Int4Group, WeightFormat
from ..modules.experts import PROJECTIONS as EXPERT_PROJECTIONS
from ..modules.experts import StackedExperts
from ..modules.linear import QuantLinear
from .comm import GroupInfo

SPLIT_ATTR = "_mq_split"
TP_ATTR = "_mq_tp"  # set by apply_tp on every module it sharded (guards against applying it twice)
ROWS, COLS, INTERMEDIATE, EXPERTS = "rows", "cols", "intermediate", "experts"


@dataclass(frozen=True)
class Shard:
    """The part of a full tensor that one rank keeps: indices ``[start, stop)`` of dimension ``dim`` out of
    ``full``."""

    dim: int
    start: int
    stop: int
    full: int


@dataclass(frozen=True)
class Split:
    """How a module was split: indices ``[start, stop)`` of ``full`` along ``axis`` — a weight's ``"rows"``
    (output features) or ``"cols"`` (input features), the experts' ``"intermediate"`` features, or the
    ``"experts"`` themselves."""

    axis: str
    start: int
    stop: int
    full: int


def record_split(module: nn.Module, split: Split) -> None:
    module.__dict__[SPLIT_ATTR] = split


def _weight_shards(fmt: WeightFormat, axis: str, start: int, stop: int, full: int, lead: int = 0) -> dict[str, Shard]:
    """Format suffix -> the shard of that stored tensor, for a weight [N, K] split along ``axis``."""
    dim = lead + (0 if axis == ROWS else 1)
    out = {}
    for suffix, (row_div, col_div) in _divisors(fmt).items():
        div = row_div if axis == ROWS else col_div
        out[suffix] = Shard(dim, start // div, -(-stop // div), -(-full // div))
    return out


def shards_of(module: nn.Module) -> dict[str, Shard]:
    """The tensors of ``module`` (its own, not its children's) that a transform sliced: name -> Shard."""
    split: Split | None = getattr(module, SPLIT_ATTR, None)
    if split is None:
        return {}
    own = dict(module.named_parameters(recurse=False))
    if split.axis == EXPERTS:
        return {n: Shard(0, split.start, split.stop, split.full) for n in own}
    out = {}
    if isinstance(module, StackedExperts):
        for proj in EXPERT_PROJECTIONS:
            axis = COLS if proj == "down_proj" else ROWS
            for suffix, shard in _weight_shards(module.fmt, axis, split.start, split.stop, split.full, 1).items():
                out[module._param_name(proj, suffix)] = shard
    elif isinstance(module, QuantLinear):
        out = _weight_shards(module.fmt, split.axis, split.start, split.stop, split.full)
        if split.axis == ROWS and module.bias is not None:
            out["bias"] = Shard(0, split.start, split.stop, split.full)
    else:  # a table split by rows (the vocabulary-parallel embedding)
        out = {n: Shard(0, split.start, split.stop, split.full) for n in own}
    return {n: sh for n, sh in out.items() if n in own}


def _fmt_label(fmt: WeightFormat) -> str:
    if isinstance(fmt, FP8Block):
        return f"FP8Block(block={fmt.block})"
    if isinstance(fmt, Int4Group):
        return f"Int4Group(group_size={fmt.group_size})"
    return type(fmt).__name__


def split_alignment(fmt: WeightFormat, axis: str) -> tuple[int, str]:
    """(the multiple a shard boundary must fall on, why) for splitting a weight in ``fmt`` along ``axis``."""
    if isinstance(fmt, FP8Block):
        bn, bk = fmt.block
        if axis == ROWS:
            return bn, f"FP8 blocks of {bn} rows stay whole"
        align = math.lcm(bk, fmt.act_group) if fmt.act_quant else bk
        return align, f"FP8 blocks of {bk} columns stay whole" + (
            f" and activation groups of {fmt.act_group}" if fmt.act_quant else "")
    if isinstance(fmt, Int4Group) and axis == COLS:
        return fmt.group_size, f"INT4 groups of {fmt.group_size} columns stay whole"
    if not isinstance(fmt, (BF16, FP8Block, Int4Group)):
        raise TypeError(f"no sharding rule for weight format {fmt!r}")
    return 1, ""


def _divisors(fmt: WeightFormat) -> dict[str, tuple[int, int]]:
    """Stored tensor suffix -> (rows of the weight per stored row, columns per stored column)."""
    if isinstance(fmt, FP8Block):
        return {"weight": (1, 1), "weight_scale_inv": fmt.block}
    if isinstance(fmt, Int4Group):
        return {"weight_packed": (1, 8), "weight_scale": (1, fmt.group_size)}
    return {"weight": (1, 1)}


def split_range(full: int, info: GroupInfo, align: int, what: str, why: str = "", unit: str = "") -> tuple[int, int]:
    """Rank ``info.rank``'s equal share ``[start, stop)`` of ``full`` indices; a clear error when ``full``
    does not divide by the world size or a share is not a multiple of ``align``."""
    if full % info.world:
        raise ValueError(f"{what}: {full}{unit} cannot be split evenly over {info.world} ranks")
    size = full // info.world
    if size % align:
        raise ValueError(f"{what}: {full}{unit} over {info.world} ranks gives {size} per rank, not a multiple of "
                         f"{align} ({why}); choose a world size whose shards are multiples of {align}")
    return info.rank * size, (info.rank + 1) * size


def narrow_copy(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """A copy of ``t``'s slice, owning its own storage (the full tensor can be freed)."""
    return t.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    if isinstance(old, nn.Parameter):
        setattr(module, name, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        setattr(module, name, value)


def narrow_weight_(module: nn.Module, names: dict[str, str], fmt: WeightFormat, axis: str, start: int, stop: int,
                   full: int, lead: int = 0) -> None:
    """Slice one weight held by ``module`` in ``fmt`` to rows / columns ``[start, stop)`` of ``full``.

    ``names``: format suffix -> attribute name on the module (``{"weight": "weight"}`` for a QuantLinear,
    ``{"weight": "gate_proj_weight"}`` for stacked experts); ``lead``: leading dims before [N, K] (1 for
    an expert stack [E, N, K])."""
    for suffix, sh in _weight_shards(fmt, axis, start, stop, full, lead).items():
        _replace(module, names[suffix], narrow_copy(getattr(module, names[suffix]), sh.dim, sh.start, sh.stop))


def shard_linear_(linear: QuantLinear, axis: str, info: GroupInfo, what: str, dry: bool = False) -> None:
    """Keep this rank's share of a :class:`QuantLinear`: ``axis="rows"`` splits the output features
    (column-parallel), ``"cols"`` the input features (row-parallel: only rank 0 keeps the bias, the caller
    sums the partial outputs). ``dry``: only check that the split is possible (raise if not)."""
    if not isinstance(linear, QuantLinear):
        raise TypeError(f"{what}: expected a QuantLinear, got {type(linear).__name__}")
    fmt = linear.fmt
    n, k = linear.out_features, linear.in_features
    full = n if axis == ROWS else k
    align, why = split_alignment(fmt, axis)
    label = "output rows" if axis == ROWS else "input columns"
    start, stop = split_range(full, info, align, f"{what} ({_fmt_label(fmt)})", why, f" {label}")
    fmt.check_shape(*((stop - start, k) if axis == ROWS else (n, stop - start)))
    if dry:
        return
    narrow_weight_(linear, {s: s for s in _divisors(fmt)}, fmt, axis, start, stop, full)
    if axis == ROWS:
        linear.out_features = stop - start
        if linear.bias is not None:
            _replace(linear, "bias", narrow_copy(linear.bias, 0, start, stop))
    else:
        linear.in_features = stop - start
        if linear.bias is not None and info.rank != 0:
            linear.bias = None  # the partial outputs are summed: the bias is added once, on rank 0
    if isinstance(fmt, Int4Group):
        shape = torch.tensor([linear.out_features, linear.in_features], dtype=torch.int64)
        linear.weight_shape = (shape.to(linear.weight_shape.device) if linear.weight_shape.device.type != "meta"
                               else torch.empty(2, dtype=torch.int64, device="meta"))
    record_split(linear, Split(axis, start, stop, full))


def shard_experts_intermediate_(experts: StackedExperts, info: GroupInfo, what: str, dry: bool = False) -> None:
    """Tensor parallelism inside every routed expert: ``gate_proj`` / ``up_proj`` keep rows
    ``[r·I/W, (r+1)·I/W)`` of their intermediate dimension, ``down_proj`` the same columns; the caller sums
    the partial outputs. ``dry``: only check."""
    if experts.qat is not None:
        raise NotImplementedError(f"{what}: experts in QAT mode cannot be sharded; call export_qat_() first")
    fmt = experts.fmt
    inter = experts.intermediate_size
    a_rows, why_rows = split_alignment(fmt, ROWS)
    a_cols, why_cols = split_alignment(fmt, COLS)
    why = "; ".join(w for w in (why_rows, why_cols) if w)
    start, stop = split_range(inter, info, math.lcm(a_rows, a_cols), f"{what} ({_fmt_label(fmt)})", why,
                              " intermediate features")
    for proj in EXPERT_PROJECTIONS:
        n, k = experts.proj_shape(proj)
        fmt.check_shape(*((n, stop - start) if proj == "down_proj" else (stop - start, k)))
    if dry:
        return
    for proj in EXPERT_PROJECTIONS:
        axis = COLS if proj == "down_proj" else ROWS
        names = {s: experts._param_name(proj, s) for s in _divisors(fmt)}
        narrow_weight_(experts, names, fmt, axis, start, stop, inter, lead=1)
    experts.intermediate_size = stop - start
    record_split(experts, Split(INTERMEDIATE, start, stop, inter))


def _iter_tensors(module: nn.Module):
    yield from module.named_parameters(recurse=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)


def sharded_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds: ``{"sharded": tensors a transform sliced, "replicated": every other parameter
    and buffer, "storage": bytes of the distinct storages behind them}``. ``storage`` equals the sum of the
    other two unless a tensor is a view into a larger one (a shard that still pins its full tensor)."""
    sharded = replicated = 0
    storages: dict[int, int] = {}
    for module in model.modules():
        records = shards_of(module)
        for name, t in _iter_tensors(module):
            nbytes = t.numel() * t.element_size()
            if name in records:
                sharded += nbytes
            else:
                replicated += nbytes
            if t.device.type != "meta":
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
    return {"sharded": sharded, "replicated": replicated, "storage": sum(storages.values())}


__all__ = ["Shard", "Split", "shards_of", "record_split", "narrow_copy", "split_alignment", "split_range",
           "narrow_weight_", "shard_linear_", "shard_experts_intermediate_", "sharded_bytes", "ROWS", "COLS",
           "INTERMEDIATE", "EXPERTS", "SPLIT_ATTR", "TP_ATTR"]
