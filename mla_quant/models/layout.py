"""The on-disk layout of the real checkpoints: ONE declarative key-mapping table and the weight format of
every linear layer as the checkpoint stores it. ``loading.py`` reads through it, ``saving.py`` writes
through it (the inverse renames), ``docs/models.md`` prints it as the spec.

Key mapping (checkpoint key -> model key; first matching rule wins, a key no rule matches is an error):

====================================================  =================  ========================================
checkpoint key (regex)                                model key          note
====================================================  =================  ========================================
``language_model.model.layers.{L..}.*``  (Kimi K2.6)  skipped            multi-token-prediction layer(s)
``language_model.model.*``               (Kimi K2.6)  ``model.*``
``language_model.lm_head.*``             (Kimi K2.6)  ``lm_head.*``
``vision_tower.*``                       (Kimi K2.6)  skipped            MoonViT vision tower (text model only)
``mm_projector.*``                       (Kimi K2.6)  skipped            multimodal projector (text model only)
``model.layers.{L..}.*``     (GLM 5.2, text-only K2)  skipped            multi-token-prediction layer(s)
``model.*``, ``lm_head.*``   (GLM 5.2, text-only K2)  the same key
====================================================  =================  ========================================

``L`` is ``num_hidden_layers``; the MTP layers are ``L .. L + num_nextn_predict_layers - 1`` (GLM 5.2:
``model.layers.78``). The MTP layer is a speculative-decoding head that the plain causal forward does not
use; it is kept out of the model and a checkpoint that holds it loads without it.

Weight formats (``checkpoint_formats``), per linear layer named by its model key prefix
(``model.layers.3.mlp.experts.17.gate_proj``):

1. ``<name>.weight_scale_inv`` present in the checkpoint -> ``FP8Block(block=weight_block_size,
   act_quant=False)`` (DeepSeek / GLM / Kimi-K2 FP8; weight-only, the exact mode).
2. ``quantization_config.quant_method == "compressed-tensors"``: a ``Linear`` that its ``ignore`` list does
   not match (``re:`` entries are regexes matched at the start of the checkpoint name, others exact
   names) -> ``Int4Group(group_size, scale_dtype=<dtype of the stored weight_scale>)``. For Kimi K2.6
   that is exactly the routed experts.
3. otherwise ``BF16()`` (the model's compute dtype).

Linear layers here are the projections built as ``QuantLinear`` (attention, indexer, MLPs, experts,
``lm_head``); the router ``mlp.gate`` and the embeddings are not ``Linear`` in the reference code and stay
in their own dtypes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..formats import BF16, FP8Block, Int4Group, WeightFormat
from .config import KimiK26Config, ModelConfig

FormatFn = Callable[[str], WeightFormat]


@dataclass(frozen=True)
class KeyRule:
    """Checkpoint keys matching ``pattern`` (a regex, matched at the start) are renamed by replacing
    ``checkpoint_prefix`` with ``model_prefix``; ``model_prefix=None`` skips them, ``note`` says why."""

    pattern: str
    checkpoint_prefix: str
    model_prefix: str | None
    note: str = ""


def _mtp_layers(config: ModelConfig) -> str:
    first = config.num_hidden_layers
    ids = range(first, first + max(int(config.num_nextn_predict_layers or 0), 1))
    return "(?:" + "|".join(str(i) for i in ids) + r")\."


def key_rules(config: ModelConfig) -> list[KeyRule]:
    """The key-mapping table for ``config``'s checkpoint layout (module docstring)."""
    mtp_note = "multi-token-prediction layer (speculative head, not part of the causal forward)"
    if isinstance(config, KimiK26Config) and config.has_language_model_prefix:
        lm = "language_model."
        return [
            KeyRule(re.escape(lm) + r"model\.layers\." + _mtp_layers(config), "", None, mtp_note),
            KeyRule(re.escape(lm) + r"model\.", lm + "model.", "model."),
            KeyRule(re.escape(lm) + r"lm_head\.", lm + "lm_head.", "lm_head."),
            KeyRule(r"vision_tower\.", "", None, "vision tower (this library builds the text model only)"),
            KeyRule(r"mm_projector\.", "", None, "multimodal projector (text model only)"),
        ]
    return [
        KeyRule(r"model\.layers\." + _mtp_layers(config), "", None, mtp_note),
        KeyRule(r"model\.", "model.", "model."),
        KeyRule(r"lm_head\.", "lm_head.", "lm_head."),
    ]


class KeyMap:
    """Applies :func:`key_rules` in both directions."""

    def __init__(self, config: ModelConfig):
        self.rules = key_rules(config)
        self._compiled = [(re.compile(r.pattern), r) for r in self.rules]

    def to_model(self, ckpt_key: str) -> tuple[str | None, KeyRule | None]:
        """(model key or None if skipped, the rule) — (None, None) when no rule matches (unexpected)."""
        for rx, rule in self._compiled:
            if rx.match(ckpt_key):
                if rule.model_prefix is None:
                    return None, rule
                return rule.model_prefix + ckpt_key[len(rule.checkpoint_prefix):], rule
        return None, None

    def to_checkpoint(self, model_key: str) -> str:
        """Checkpoint name of a model key or module name (``lm_head`` -> ``language_model.lm_head``)."""
        dotted = model_key + "."
        for rule in self.rules:
            if rule.model_prefix is not None and dotted.startswith(rule.model_prefix):
                return (rule.checkpoint_prefix + dotted[len(rule.model_prefix):])[:-1]
        raise KeyError(f"no checkpoint name for model key {model_key!r}")


# ---------------------------------------------------------------------------------------------------
# weight formats as the checkpoint stores them
# ---------------------------------------------------------------------------------------------------
def _ct_weight_scheme(qc: dict) -> tuple[dict, list[str]]:
    """(the INT weights scheme of the ``Linear`` targets, the ignore list) of a compressed-tensors config."""
    if qc.get("format") != "pack-quantized":
        raise ValueError(f"quantization_config: compressed-tensors format {qc.get('format')!r} not supported "
                         "(pack-quantized)")
    groups = [g for g in (qc.get("config_groups") or {}).values() if "Linear" in (g.get("targets") or [])]
    if len(groups) != 1:
        raise ValueError("quantization_config: expected one compressed-tensors config group targeting 'Linear', "
                         f"got {len(groups)}")
    w = groups[0].get("weights") or {}
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
    if bad or groups[0].get("input_activations"):
        raise ValueError(f"quantization_config: only symmetric INT4 group weights (weight-only) are supported; "
                         f"got {bad or {'input_activations': groups[0].get('input_activations')}}")
    return w, list(qc.get("ignore") or [])


def ct_ignored(name: str, ignore: Iterable[str]) -> bool:
    """compressed-tensors matching: ``re:`` entries are regexes (``re.match``), others exact names."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif entry == name:
            return True
    return False


def fp8_block(config: ModelConfig) -> tuple[int, int]:
    qc = config.quantization_config or {}
    return tuple(int(b) for b in qc.get("weight_block_size") or (128, 128))


def checkpoint_formats(config: ModelConfig, checkpoint_keys: Iterable[str] | None = None,
                       int4_scale_dtype: torch.dtype | None = None) -> FormatFn:
    """The format function of a checkpoint: model-key prefix of a linear layer -> its ``WeightFormat``.

    ``checkpoint_keys``: the keys of the checkpoint (its index), used to find the FP8 layers by their
    ``weight_scale_inv``. None (a model built from a config, no files) applies the release's rule
    instead: for an ``fp8`` ``quantization_config`` every linear layer is FP8 except ``lm_head`` and the
    indexer's ``weights_proj`` (DeepSeek-V3.2 / GLM-5 FP8 releases).
    """
    qc = config.quantization_config or {}
    method = qc.get("quant_method")
    keymap = KeyMap(config)
    fp8_names: set[str] | None = None
    if checkpoint_keys is not None:
        fp8_names = set()
        for k in checkpoint_keys:
            if k.endswith(".weight_scale_inv"):
                model_key, _ = keymap.to_model(k)
                if model_key is not None:
                    fp8_names.add(model_key[: -len(".weight_scale_inv")])
    elif method != "fp8" and method not in (None, "compressed-tensors"):
        raise ValueError(f"quantization_config: quant_method {method!r} not supported (fp8, compressed-tensors)")
    block = fp8_block(config)
    ct_scheme = ct_ignore = None
    if method == "compressed-tensors":
        ct_scheme, ct_ignore = _ct_weight_scheme(qc)
        scale_dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[
            int4_scale_dtype or torch.bfloat16]

    def fmt_for(name: str) -> WeightFormat:
        if fp8_names is not None and name in fp8_names:
            return FP8Block(block=block, act_quant=False)
        if fp8_names is None and method == "fp8" and not (
                name == "lm_head" or name.endswith("indexer.weights_proj")):
            return FP8Block(block=block, act_quant=False)
        if ct_scheme is not None and not ct_ignored(keymap.to_checkpoint(name), ct_ignore):
            return Int4Group(group_size=int(ct_scheme["group_size"]), scale_dtype=scale_dtype)
        return BF16()

    return fmt_for


def bf16_formats(name: str) -> WeightFormat:
    """Every linear layer unquantized (the default of a model built from a config)."""
    return BF16()


def quantization_config_for(config: ModelConfig, formats: dict[str, WeightFormat]) -> dict | None:
    """The ``quantization_config`` that describes a model whose linear layers hold ``formats``
    (model-key prefix -> format), for saving in the real layout.

    INT4 layers -> a compressed-tensors ``pack-quantized`` group whose ``ignore`` list is the config's own
    when it describes the model exactly (the real Kimi K2.6 list), else the exact names of the other
    linear layers. FP8 blocks (all of one block shape) -> ``quant_method: fp8`` unless INT4 layers exist
    (then the FP8 layers are still told apart by their ``weight_scale_inv``). No quantized layer -> None.
    """
    keymap = KeyMap(config)
    int4 = {n: f for n, f in formats.items() if isinstance(f, Int4Group)}
    fp8 = {n: f for n, f in formats.items() if isinstance(f, FP8Block)}
    if len({f.group_size for f in int4.values()}) > 1:
        raise ValueError("save: INT4 layers with different group sizes cannot share one quantization_config")
    if len({f.block for f in fp8.values()}) > 1:
        raise ValueError("save: FP8 layers with different block shapes cannot share one quantization_config")
    if int4:
        group = next(iter(int4.values())).group_size
        qc = dict(config.quantization_config or {})
        ignore = qc.get("ignore") if qc.get("quant_method") == "compressed-tensors" else None
        ckpt = {n: keymap.to_checkpoint(n) for n in formats}
        if ignore is None or any(ct_ignored(ckpt[n], ignore) != (n not in int4) for n in formats):
            ignore = sorted(ckpt[n] for n in formats if n not in int4)
        scheme = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group,
                  "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                  "symmetric": True, "type": "int"}
        return {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                              "targets": ["Linear"], "weights": scheme}},
                "format": "pack-quantized", "ignore": ignore, "kv_cache_scheme": None,
                "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    if fp8:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(next(iter(fp8.values())).block)}
    return None


__all__ = ["KeyRule", "KeyMap", "key_rules", "checkpoint_formats", "bf16_formats", "ct_ignored",
           "quantization_config_for", "FormatFn"]
