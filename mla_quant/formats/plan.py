"""Per-layer and per-phase formats: ``QuantPlan``, ``quantize_``, ``Phase``, ``PhaseRecipe``.

A plan is an ordered list of rules ``{pattern: format | None}`` matched against module names
(``model.named_modules()``):

* ``"re:<regex>"`` — the regex must match the whole name (``re.fullmatch``);
* ``"_default"`` — applies to every module that no other rule matched (wherever it is written);
* any other key — the exact module name.

The first rule that matches a module *and applies to its kind* wins; ``None`` leaves the module as it is.
Two kinds of modules take part, found by duck typing (this layer imports no module class):

* weight holders: any module with a ``convert_format_(fmt)`` method (``QuantLinear``, the stacked MoE
  experts, the DSA indexer's score precision) and plain ``nn.Linear`` (replaced by a ``QuantLinear``).
  Rules whose value is a :class:`WeightFormat` (or None) apply to them. A module whose current ``fmt`` is a
  precision name (``LightningIndexer``: ``"bf16"`` / ``"fp8"``) gets ``BF16()`` -> ``"bf16"``,
  ``FP8Block()`` -> ``"fp8"``. A module that already holds the plan's format is not touched, so expose the
  current format as ``fmt``.
* KV writers: any module with a ``kv_format`` attribute, or an MLA attention module (``kv_lora_rank`` and
  ``forward_paged``) — one per decoder layer. Rules whose value is a :class:`KVFormat` (or None) apply to
  them: :func:`quantize_` sets their ``kv_format`` (through ``set_kv_format_(fmt)`` when they have it), and
  :meth:`QuantPlan.kv_formats` lists one format per KV writer, in model order — what
  ``PagedKVCache(kv_format=[...])`` takes.

So ``QuantPlan({"re:.*mlp\\.experts": Int4Group(32), "re:.*self_attn": KVFormat("fp8_e4m3"),
"_default": FP8Block()})`` puts the routed experts in INT4, every other linear layer in FP8 and the KV cache
in FP8. Rules are tried against every candidate, children of a converted module included, so anchor the
regexes (``.*indexer$`` for the indexer itself, ``.*indexer\\..*`` for its linear layers).

A plan serialises to a dict / JSON (formats by ``to_dict``) and into safetensors metadata
(:meth:`QuantPlan.to_metadata`), so a converted checkpoint says how it was made.

A :class:`PhaseRecipe` pairs a prefill and a decode :class:`Phase` (weights plan + KV format). It is deployed
either as two model instances (:func:`build_pools`: a prefill pool and a decode pool, with
:func:`handoff_kv` moving each request's KV pages between their caches and converting BF16 → FP8 on the
way), or as one instance holding both weight formats (:class:`PhaseSwitch`, or ``recipe.apply(model,
phase)``) where memory allows.
"""
from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import format_from_dict
from .kv import KVFormat
from .weight import WeightFormat

DEFAULT = "_default"
REGEX = "re:"
METADATA_KEY = "mla_quant.plan"
PHASES = ("prefill", "decode")

PlanValue = WeightFormat | KVFormat | None


def _check_value(key: str, value) -> PlanValue:
    if isinstance(value, Mapping):
        value = format_from_dict(value)
    if value is not None and not isinstance(value, (WeightFormat, KVFormat)):
        raise TypeError(f"QuantPlan: rule {key!r} has value {value!r}; expected a weight format, a KVFormat or None")
    return value


def _matcher(key: str) -> Callable[[str], bool]:
    if not isinstance(key, str) or not key:
        raise TypeError(f"QuantPlan: rule key {key!r} must be a non-empty string")
    if key == DEFAULT:
        return lambda name: True
    if key.startswith(REGEX):
        try:
            rx = re.compile(key[len(REGEX):])
        except re.error as e:
            raise ValueError(f"QuantPlan: rule {key!r} is not a valid regex: {e}") from None
        return lambda name: rx.fullmatch(name) is not None
    return lambda name: name == key


def _applies(value: PlanValue, kind: type) -> bool:
    return value is None or isinstance(value, kind)


def is_weight_module(module: nn.Module) -> bool:
    """Takes weight rules: has ``convert_format_`` or is a plain ``nn.Linear``."""
    return callable(getattr(module, "convert_format_", None)) or type(module) is nn.Linear


def is_kv_module(module: nn.Module) -> bool:
    """Takes KV rules: declares the format of the KV it writes as ``kv_format``, or is an MLA attention
    module (a ``kv_lora_rank`` and a ``forward_paged``; ``MLAttention``, ``DSAttention``)."""
    if isinstance(getattr(module, "kv_format", None), (KVFormat, str)):
        return True
    return hasattr(module, "kv_lora_rank") and callable(getattr(module, "forward_paged", None))


def current_kv_format(module: nn.Module, default: KVFormat | str = "bf16") -> KVFormat:
    return KVFormat.parse(getattr(module, "kv_format", None) or default)


def format_arg(module: nn.Module, fmt: WeightFormat):
    """What ``module.convert_format_`` takes for plan format ``fmt``: the format itself, or — for a module
    whose ``fmt`` is a precision name (the DSA indexer's ``"bf16"`` / ``"fp8"`` scores) — that name."""
    if not isinstance(getattr(module, "fmt", None), str):
        return fmt
    if type(fmt).__name__ == "FP8Block":
        return "fp8"
    if type(fmt).__name__ == "BF16":
        return "bf16"
    raise TypeError(f"quantize_: {type(module).__name__} takes a precision name ('bf16' / 'fp8'); "
                    f"the plan gives it {fmt!r} (use BF16() or FP8Block())")


class QuantPlan:
    """Ordered ``{"re:<regex>" | exact name | "_default": format | None}``; first match wins (module docstring).

    ``QuantPlan(rules)`` takes a mapping or an iterable of ``(key, value)`` pairs; values may be format
    objects, their ``to_dict()`` dicts, or None. Immutable and hashable; ``repr`` round-trips.
    """

    __slots__ = ("_rules", "_matchers")

    def __init__(self, rules: Mapping[str, PlanValue] | Iterable[tuple[str, PlanValue]] | "QuantPlan" | None = None):
        if isinstance(rules, QuantPlan):
            items = rules.items()
        elif isinstance(rules, Mapping):
            items = tuple(rules.items())
        else:
            items = tuple(tuple(r) for r in (rules or ()))
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"QuantPlan: duplicate rule keys in {keys}")
        self._rules = tuple((k, _check_value(k, v)) for k, v in items)
        self._matchers = tuple((_matcher(k), k, v) for k, v in self._rules)

    # ------------------------------------------------------------------------------------ matching
    def items(self) -> tuple[tuple[str, PlanValue], ...]:
        return self._rules

    @property
    def rules(self) -> dict[str, PlanValue]:
        return dict(self._rules)

    def rule_for(self, name: str, kind: type = WeightFormat) -> str | None:
        """The key of the rule that decides module ``name`` of ``kind`` (WeightFormat or KVFormat), or None."""
        default = None
        for match, key, value in self._matchers:
            if not _applies(value, kind):
                continue
            if key == DEFAULT:
                default = default or key
            elif match(name):
                return key
        return default

    def _value(self, name: str, kind: type) -> PlanValue:
        key = self.rule_for(name, kind)
        return None if key is None else self.rules[key]

    def format_for(self, name: str) -> WeightFormat | None:
        """The weight format the plan gives module ``name`` (None: leave it as it is)."""
        return self._value(name, WeightFormat)

    def kv_format_for(self, name: str) -> KVFormat | None:
        """The KV format the plan gives KV-writing module ``name`` (None: leave it as it is)."""
        return self._value(name, KVFormat)

    def matched(self, model: nn.Module) -> dict[str, PlanValue]:
        """What :func:`quantize_` would change: ``{module name: new format}`` (a dry run)."""
        out = {}
        for name, module in model.named_modules():
            if is_weight_module(module):
                fmt = self.format_for(name)
                if fmt is not None and format_arg(module, fmt) != getattr(module, "fmt", None):
                    out[name] = fmt
            if is_kv_module(module):
                kv = self.kv_format_for(name)
                if kv is not None and kv != current_kv_format(module):
                    out[name] = kv
        return out

    def kv_formats(self, model: nn.Module | Iterable[str], default: KVFormat | str = "bf16") -> list[KVFormat]:
        """One KV format per KV-writing module of ``model`` in model order (= per decoder layer), or per
        name of an iterable of names. A module no KV rule decides keeps its own ``kv_format`` (names fall
        back to ``default``)."""
        default = KVFormat.parse(default)
        if isinstance(model, nn.Module):
            return [self.kv_format_for(n) or current_kv_format(m, default)
                    for n, m in model.named_modules() if is_kv_module(m)]
        return [self.kv_format_for(n) or default for n in model]

    # ------------------------------------------------------------------------------------ serialising
    def to_dict(self) -> dict:
        return {"rules": [[k, None if v is None else v.to_dict()] for k, v in self._rules]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "QuantPlan":
        if "rules" not in d:
            raise ValueError(f"QuantPlan.from_dict: no 'rules' in {sorted(d)}")
        return cls([(k, None if v is None else format_from_dict(v)) for k, v in d["rules"]])

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "QuantPlan":
        return cls.from_dict(json.loads(text))

    def to_metadata(self) -> dict[str, str]:
        """Entries for a safetensors ``__metadata__`` (string to string)."""
        return {METADATA_KEY: self.to_json()}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str] | None) -> "QuantPlan | None":
        """The plan stored by :meth:`to_metadata`, or None when the metadata has none."""
        if not metadata or METADATA_KEY not in metadata:
            return None
        return cls.from_json(metadata[METADATA_KEY])

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike) -> "QuantPlan | None":
        """The plan stored in a checkpoint's safetensors metadata (a ``.safetensors`` file, or a folder:
        its first shard), or None when there is none — how a converted checkpoint says how it was made."""
        from safetensors import safe_open

        path = Path(path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))[:1]
        if not files:
            raise FileNotFoundError(f"path: no .safetensors file at {str(path)!r}")
        with safe_open(str(files[0]), "pt") as f:
            return cls.from_metadata(f.metadata())

    # ------------------------------------------------------------------------------------ dunder
    def __repr__(self) -> str:
        return f"QuantPlan({dict(self._rules)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, QuantPlan) and self._rules == other._rules

    def __hash__(self) -> int:
        return hash(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __or__(self, other: "QuantPlan") -> "QuantPlan":
        """``a | b``: a's rules first, then b's rules whose keys a lacks."""
        other = QuantPlan(other)
        mine = self.rules
        return QuantPlan(list(self._rules) + [(k, v) for k, v in other.items() if k not in mine])


def _as_plan(plan) -> QuantPlan:
    return plan if isinstance(plan, QuantPlan) else QuantPlan(plan)


def _set_kv_format(module: nn.Module, fmt: KVFormat) -> None:
    setter = getattr(module, "set_kv_format_", None)
    if callable(setter):
        setter(fmt)
    else:
        module.kv_format = fmt


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def _convert(model: nn.Module, name: str, module: nn.Module, fmt: WeightFormat) -> nn.Module:
    """Hold ``module``'s weights in ``fmt``: in place through ``convert_format_``; a plain nn.Linear is
    replaced by a QuantLinear (set into its parent). Returns the module now at ``name``."""
    if callable(getattr(module, "convert_format_", None)):
        arg = format_arg(module, fmt)
        if getattr(module, "fmt", None) != arg:  # re-quantizing a format into itself is not always exact
            module.convert_format_(arg)
        return module
    from ..modules.linear import QuantLinear  # the one upward import, only for plain nn.Linear

    new = QuantLinear.from_linear(module, fmt)
    parent, child = _parent(model, name)
    setattr(parent, child, new)
    return new


def _quantize_tree(root: nn.Module, plan: QuantPlan, prefix: str = "") -> nn.Module:
    """Apply ``plan`` to ``root`` and its descendants, matching the names they have under ``prefix`` in
    the whole model. Returns the root (a new object if it was a plain nn.Linear that got replaced)."""
    holder = nn.Module()
    holder.add_module("root", root)
    for rel, module in list(root.named_modules()):
        full = ".".join(p for p in (prefix, rel) if p)
        if is_weight_module(module):
            fmt = plan.format_for(full)
            if fmt is not None:
                _convert(holder, ".".join(p for p in ("root", rel) if p), module, fmt)
        if is_kv_module(module):
            kv = plan.kv_format_for(full)
            if kv is not None:
                _set_kv_format(module, kv)
    return holder.root


def quantize_(model: nn.Module, plan: QuantPlan | Mapping) -> nn.Module:
    """Apply ``plan`` to ``model`` in place (module docstring for the matching rules). Returns the model.

    Modules whose format already equals the plan's are left untouched (bit for bit)."""
    plan = _as_plan(plan)
    if type(model) is nn.Linear:
        raise TypeError("quantize_: the model itself is a plain nn.Linear; wrap it in a module")
    return _quantize_tree(model, plan)


# ---------------------------------------------------------------------------------------------- phases
@dataclass(frozen=True)
class Phase:
    """The formats of one serving phase: the weights plan (None keeps the loaded weights) and the default
    KV format of its cache (KV rules in ``weights`` override it per layer)."""

    weights: QuantPlan | None = None
    kv: KVFormat = KVFormat("bf16")

    def __post_init__(self):
        if self.weights is not None and not isinstance(self.weights, QuantPlan):
            object.__setattr__(self, "weights", QuantPlan(self.weights))
        object.__setattr__(self, "kv", KVFormat.parse(self.kv))

    def kv_formats(self, model: nn.Module | Iterable[str]) -> list[KVFormat]:
        """One KV format per decoder layer for this phase's cache."""
        plan = self.weights or QuantPlan()
        if isinstance(model, nn.Module):
            return [plan.kv_format_for(n) or self.kv for n, m in model.named_modules() if is_kv_module(m)]
        return plan.kv_formats(model, default=self.kv)

    def to_dict(self) -> dict:
        return {"weights": None if self.weights is None else self.weights.to_dict(), "kv": self.kv.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Phase":
        w = d.get("weights")
        return cls(weights=None if w is None else QuantPlan.from_dict(w), kv=format_from_dict(d["kv"]))


@dataclass(frozen=True)
class PhaseRecipe:
    """Formats per serving phase: ``PhaseRecipe(prefill=Phase(weights=plan_fp8, kv="bf16"),
    decode=Phase(weights=plan_int4, kv="fp8_e4m3"))`` — the seed's asymmetric recipe."""

    prefill: Phase = Phase()
    decode: Phase = Phase()

    def __post_init__(self):
        for ph in PHASES:
            if not isinstance(getattr(self, ph), Phase):
                raise TypeError(f"PhaseRecipe: {ph} must be a Phase, got {getattr(self, ph)!r}")

    def phase(self, name: str) -> Phase:
        if name not in PHASES:
            raise ValueError(f"phase: {name!r} not in {PHASES}")
        return getattr(self, name)

    def to_dict(self) -> dict:
        return {ph: self.phase(ph).to_dict() for ph in PHASES}

    @classmethod
    def from_dict(cls, d: Mapping) -> "PhaseRecipe":
        return cls(**{ph: Phase.from_dict(d[ph]) for ph in PHASES})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "PhaseRecipe":
        return cls.from_dict(json.loads(text))

    def apply(self, model: nn.Module, phase: str) -> nn.Module:
        """Switch a one-instance deployment to ``phase``: the first call builds a :class:`PhaseSwitch`
        (both weight copies) and keeps it on the model as ``model.phase_switch``. Returns the model."""
        switch = getattr(model, "phase_switch", None)
        if switch is None or switch.recipe != self:
            switch = PhaseSwitch(model, self)
            object.__setattr__(model, "phase_switch", switch)  # a plain attribute: not a submodule
        switch.use(phase)
        return model


def build_pools(model: nn.Module | Callable[[], nn.Module], recipe: PhaseRecipe) -> tuple[nn.Module, nn.Module]:
    """Two instances for a disaggregated deployment: ``(prefill_model, decode_model)``.

    ``model`` is a built model (the prefill instance is a deep copy, the decode instance is ``model``
    itself, converted in place) or a zero-argument factory called twice (e.g. loading the checkpoint), which
    avoids holding a third copy. Each is quantized with its phase's plan; their caches are built from
    ``recipe.<phase>.kv_formats(instance)``."""
    if isinstance(model, nn.Module):
        prefill, decode = copy.deepcopy(model), model
    else:
        prefill, decode = model(), model()
    for inst, ph in ((prefill, recipe.prefill), (decode, recipe.decode)):
        if ph.weights is not None:
            quantize_(inst, ph.weights)
        _set_default_kv(inst, ph)
    return prefill, decode


def _set_default_kv(model: nn.Module, phase: Phase) -> None:
    for name, module in model.named_modules():
        if is_kv_module(module):
            _set_kv_format(module, (phase.weights.kv_format_for(name) if phase.weights else None) or phase.kv)


class PhaseSwitch:
    """One model instance holding both phases' weight formats.

    For every weight module whose format differs between the two plans, both variants are built from the
    module as loaded (a copy converted to the decode format, the original converted to the prefill format);
    :meth:`use` sets the phase's variants into their parents — a pointer swap, no conversion. Modules both
    phases agree on are shared. Inactive variants are not submodules of the model: call :meth:`to` (not
    only ``model.to``) to move everything.
    """

    def __init__(self, model: nn.Module, recipe: PhaseRecipe):
        self.model, self.recipe = model, recipe
        self.variants: dict[str, dict[str, nn.Module]] = {}
        p_plan, d_plan = recipe.prefill.weights or QuantPlan(), recipe.decode.weights or QuantPlan()
        for name, module in list(model.named_modules()):
            if name == "" or not is_weight_module(module) or self._inside_variant(name):
                continue
            current = getattr(module, "fmt", None)
            p_fmt, d_fmt = p_plan.format_for(name), d_plan.format_for(name)
            p_arg = current if p_fmt is None else format_arg(module, p_fmt)
            d_arg = current if d_fmt is None else format_arg(module, d_fmt)
            if p_arg == d_arg:  # shared (a descendant that differs gets its own variants when visited)
                if p_fmt is not None:
                    _convert(model, name, module, p_fmt)
                continue
            decode = _quantize_tree(copy.deepcopy(module), d_plan, name)  # both from the loaded weights
            prefill = _quantize_tree(module, p_plan, name)
            parent, child = _parent(model, name)
            setattr(parent, child, prefill)
            self.variants[name] = {"prefill": prefill, "decode": decode}
        self.phase = "prefill"

    def _inside_variant(self, name: str) -> bool:
        return any(name.startswith(v + ".") for v in self.variants)

    def use(self, phase: str) -> nn.Module:
        """Set ``phase``'s weight variants and KV formats into the model. Returns the model."""
        ph = self.recipe.phase(phase)
        for name, pair in self.variants.items():
            parent, child = _parent(self.model, name)
            setattr(parent, child, pair[phase])
        _set_default_kv(self.model, ph)
        self.phase = phase
        return self.model

    def kv_formats(self, phase: str | None = None) -> list[KVFormat]:
        return self.recipe.phase(phase or self.phase).kv_formats(self.model)

    def extra_bytes(self) -> int:
        """Bytes held by the inactive variants (the price of one instance serving both phases)."""
        inactive = "decode" if self.phase == "prefill" else "prefill"
        return sum(t.numel() * t.element_size() for pair in self.variants.values()
                   for t in list(pair[inactive].parameters()) + list(pair[inactive].buffers()))

    def to(self, *args, **kwargs) -> "PhaseSwitch":
        self.model.to(*args, **kwargs)
        for pair in self.variants.values():
            for m in pair.values():
                m.to(*args, **kwargs)
        return self


# ---------------------------------------------------------------------------------------------- KV hand-off
def _page_ids(name: str, pages) -> torch.Tensor:
    """Page ids from a list / 1-D tensor, or a block table [B, max_pages] with -1 for unused entries."""
    t = torch.as_tensor(pages, dtype=torch.long)
    if t.dim() == 2:
        t = t[t >= 0]
    if t.dim() != 1:
        raise ValueError(f"{name}: expected page ids [P] or a block table [B, max_pages], got shape {tuple(t.shape)}")
    return t.cpu()


def handoff_kv(src_cache, dst_cache, src_pages, dst_pages) -> torch.Tensor:
    """Move requests' KV from the prefill pool's cache to the decode pool's, converting formats per layer
    (e.g. BF16 → FP8 e4m3) on the way; bytes are copied exactly when a layer's formats agree.

    ``src_pages`` / ``dst_pages``: the pages to copy and where they go, as page-id lists or as block tables
    ``[B, max_pages]`` (int, -1 = unused; both must list the same number of pages, in the same order).
    ``src_cache`` / ``dst_cache`` are ``mla_quant.cache.PagedKVCache`` objects (duck-typed: anything with
    ``copy_pages_to(other, src_pages, dst_pages)``). Returns the destination page ids, flat."""
    src, dst = _page_ids("src_pages", src_pages), _page_ids("dst_pages", dst_pages)
    if src.numel() != dst.numel():
        raise ValueError(f"dst_pages: {dst.numel()} pages for {src.numel()} src_pages")
    copy_to = getattr(src_cache, "copy_pages_to", None)
    if not callable(copy_to):
        raise TypeError(f"src_cache: {type(src_cache).__name__} has no copy_pages_to(other, src_pages, dst_pages)")
    copy_to(dst_cache, src, dst)
    return dst


__all__ = ["QuantPlan", "quantize_", "Phase", "PhaseRecipe", "PhaseSwitch", "build_pools", "handoff_kv",
           "is_weight_module", "is_kv_module", "METADATA_KEY", "DEFAULT"]
