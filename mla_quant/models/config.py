"""Model configs whose fields are the keys of the Hugging Face ``config.json`` of the real checkpoints.

``KimiK26Config`` mirrors Kimi K2.6's *text* config (``text_config`` of the ``kimi_k25`` wrapper, a
DeepSeek-V3 architecture); ``Glm52Config`` mirrors GLM 5.2's ``glm_moe_dsa`` config. The defaults are the
real dimensions (``.full()``); ``.tiny()`` keeps the structure at CPU size. ``from_hf`` reads a folder, a
``config.json`` path or a dict in the published layouts; keys this library does not use are kept in
``extra`` so that ``to_hf`` writes them back.

Derived values (head dims, the normalized RoPE parameters, the softmax scale, which layers are MoE, which
GLM layers run their own indexer) are properties, never stored twice.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import ClassVar

KIMI_VISION_CONFIG = {"model_type": "kimi_k25_vision", "patch_size": 14, "num_hidden_layers": 27,
                      "hidden_size": 1152, "num_attention_heads": 16, "intermediate_size": 4304}

KIMI_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:vision_tower.*", "re:mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}

GLM_FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}


def _read_json(path_or_dict: str | os.PathLike | dict) -> dict:
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config: no config.json at {path!r}")
    with open(path) as f:
        return json.load(f)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1·m·ln(factor) + 1`` (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


class _HFConfig:
    """Shared behaviour of the two configs (they are dataclasses whose fields are JSON keys)."""

    model_types: ClassVar[tuple[str, ...]]
    extra: dict

    # ---- construction / serialisation -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict):
        """Known keys become fields, the others go to ``extra`` (kept for ``to_hf``). Absent keys take the
        defaults (the real model's), except ``quantization_config``: absent means unquantized."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        known.setdefault("quantization_config", None)
        extra = {k: v for k, v in d.items() if k not in names}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """The text-model config as a flat dict (JSON keys, ``extra`` merged back)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        d.update(copy.deepcopy(self.extra))
        return d

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    # ---- derived dimensions ----------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values one token of one layer stores in the MLA cache (latent + rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.n_routed_experts > 0

    @property
    def rope_params(self) -> dict:
        """RoPE parameters normalized from ``rope_parameters`` / ``rope_scaling`` / ``rope_theta``:
        ``{"rope_type": "default" | "yarn", "rope_theta": ..., [yarn keys]}``."""
        rp = dict(getattr(self, "rope_parameters", None) or {})
        scaling = dict(self.rope_scaling or {})
        rp.update({k: v for k, v in scaling.items() if k != "type"})
        rope_type = rp.get("rope_type") or scaling.get("type") or "default"
        rp["rope_type"] = rope_type
        if rp.get("rope_theta") is None:
            rp["rope_theta"] = self.rope_theta
        if rp["rope_theta"] is None:
            raise ValueError(f"{type(self).__name__}: no rope_theta in rope_theta / rope_parameters")
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"{type(self).__name__}: rope type {rope_type!r} not supported (default, yarn)")
        if rope_type == "yarn":
            missing = [k for k in ("factor", "original_max_position_embeddings") if rp.get(k) is None]
            if missing:
                raise ValueError(f"{type(self).__name__}: yarn rope_scaling lacks {missing}")
            rp.setdefault("beta_fast", 32.0)
            rp.setdefault("beta_slow", 1.0)
            rp.setdefault("mscale", 1.0)
            rp.setdefault("mscale_all_dim", 0.0)
        return rp

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)²`` under YaRN (HF / DeepSeek rule)."""
        scale = self.qk_head_dim ** -0.5
        rp = self.rope_params
        if rp["rope_type"] == "yarn" and rp.get("mscale_all_dim"):
            m = yarn_mscale(rp["factor"], rp["mscale_all_dim"])
            scale *= m * m
        return scale

    # ---- checks shared by both ---------------------------------------------------------------------
    def _validate(self) -> None:
        name = type(self).__name__
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
        for key in positive:
            if int(getattr(self, key)) <= 0:
                raise ValueError(f"{name}: {key} must be positive, got {getattr(self, key)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{name}: qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"{name}: first_k_dense_replace {self.first_k_dense_replace} not in "
                             f"[0, num_hidden_layers={self.num_hidden_layers}]")
        if self.n_routed_experts:
            if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"{name}: num_experts_per_tok {self.num_experts_per_tok} not in "
                                 f"[1, n_routed_experts={self.n_routed_experts}]")
            if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"{name}: n_group {self.n_group} / topk_group {self.topk_group} do not divide "
                                 f"n_routed_experts {self.n_routed_experts}")
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            raise ValueError(f"{name}: only scoring_func 'sigmoid' with topk_method 'noaux_tc' is supported, got "
                             f"{self.scoring_func!r} / {self.topk_method!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"{name}: hidden_act {self.hidden_act!r} not supported (silu)")
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            raise ValueError(f"{name}: MLA needs num_key_value_heads == num_attention_heads, got "
                             f"{self.num_key_value_heads} != {self.num_attention_heads}")
        self.rope_params  # raises on a malformed rope section


@dataclass
class KimiK26Config(_HFConfig):
    """Kimi K2.6 text model (``text_config`` of ``kimi_k25``; DeepSeek-V3 architecture: MLA + MoE, no DSA).

    ``vision_config`` is the wrapper's vision-tower config: not None means the checkpoint uses the
    multimodal ``kimi_k25`` layout (config nested under ``text_config``, weights under ``language_model.``,
    a vision tower and projector that this library skips). None means a text-only ``kimi_k2`` /
    ``deepseek_v3`` checkpoint (K2-Instruct, K2-Thinking).
    """

    model_types: ClassVar[tuple[str, ...]] = ("kimi_k25", "kimi_k2", "deepseek_v3")

    model_type: str = "kimi_k2"
    architectures: list = field(default_factory=lambda: ["DeepseekV3ForCausalLM"])
    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 1
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    rope_theta: float = 50000.0
    rope_scaling: dict | None = field(default_factory=lambda: {
        "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    attention_bias: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | list | None = 163586
    pad_token_id: int | None = 163839
    torch_dtype: str = "bfloat16"
    quantization_config: dict | None = field(default_factory=lambda: copy.deepcopy(KIMI_QUANTIZATION_CONFIG))
    vision_config: dict | None = field(default_factory=lambda: dict(KIMI_VISION_CONFIG))
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._validate()

    # ---- real layouts ------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> "KimiK26Config":
        """Read a ``kimi_k25`` wrapper (text model in ``text_config``) or a text-only ``kimi_k2`` /
        ``deepseek_v3`` config.json (a folder, a file path, or the parsed dict)."""
        d = _read_json(path_or_dict)
        mt = d.get("model_type")
        if mt == "kimi_k25":
            if not isinstance(d.get("text_config"), dict):
                raise ValueError("KimiK26Config: a kimi_k25 config needs a 'text_config' dict")
            text = dict(d["text_config"])
            if text.get("model_type", "kimi_k2") not in ("kimi_k2", "deepseek_v3"):
                raise ValueError(f"KimiK26Config: text_config.model_type {text.get('model_type')!r} is not "
                                 "kimi_k2 / deepseek_v3")
            text["vision_config"] = d.get("vision_config") or {}
            # the wrapper's own keys (tie_word_embeddings is the text model's, written back from it)
            wrapper_extra = {k: v for k, v in d.items() if k not in ("text_config", "vision_config", "model_type",
                                                                     "architectures", "tie_word_embeddings")}
            cfg = cls.from_dict(text)
            if wrapper_extra:
                cfg.extra["__wrapper__"] = wrapper_extra
            return cfg
        if mt in ("kimi_k2", "deepseek_v3"):
            d.setdefault("vision_config", None)
            return cls.from_dict(d)
        raise ValueError(f"KimiK26Config: model_type {mt!r} is not one of {cls.model_types}")

    def to_hf(self) -> dict:
        """The config.json in the real layout (the ``kimi_k25`` nesting when ``vision_config`` is set)."""
        text = self.to_dict()
        vision = text.pop("vision_config")
        wrapper = text.pop("__wrapper__", {})
        if vision is None:
            return text
        return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "text_config": text, "vision_config": vision, **wrapper,
                "tie_word_embeddings": self.tie_word_embeddings}

    @property
    def has_language_model_prefix(self) -> bool:
        """Weights live under ``language_model.`` (the multimodal K2.5/K2.6 layout)."""
        return self.vision_config is not None

    # ---- sizes -------------------------------------------------------------------------------------
    @classmethod
    def full(cls) -> "KimiK26Config":
        """The real Kimi K2.6 text model (61 layers, 384 experts, hidden 7168; ≈1.026 T parameters)."""
        return cls()

    @classmethod
    def tiny(cls) -> "KimiK26Config":
        """Same structure at CPU size: 1 dense + 2 MoE layers, YaRN, INT4 routed experts; every matmul
        dimension a multiple of 128 (FP8 blocks and activation groups) and of 32 (INT4 groups)."""
        return cls(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                   n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=128, kv_lora_rank=128,
                   qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, max_position_embeddings=262144,
                   bos_token_id=0, eos_token_id=1, pad_token_id=2)


@dataclass
class Glm52Config(_HFConfig):
    """GLM 5.2 (``glm_moe_dsa``): MLA with DeepSeek Sparse Attention and IndexShare, DeepSeek-style MoE.

    ``indexer_types[i]`` is ``"full"`` (layer i runs its own indexer) or ``"shared"`` (layer i reuses the
    top-k indices of the previous full layer and ships no indexer weights). When absent it is derived
    with the Hugging Face rule from ``index_topk_pattern`` (a string of F/S, kept in ``extra``) or
    ``index_topk_freq`` / ``index_skip_topk_offset``:
    ``"full" if max(i - offset + 1, 0) % freq == 0 else "shared"``.
    """

    model_types: ClassVar[tuple[str, ...]] = ("glm_moe_dsa",)

    model_type: str = "glm_moe_dsa"
    architectures: list = field(default_factory=lambda: ["GlmMoeDsaForCausalLM"])
    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    first_k_dense_replace: int = 3
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    head_dim: int = 64
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    q_lora_rank: int | None = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    hidden_act: str = "silu"
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_topk_freq: int = 4
    index_skip_topk_offset: int = 2
    indexer_types: list | None = None
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    max_position_embeddings: int = 1048576
    rope_theta: float | None = 8000000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    attention_bias: bool = False
    moe_router_dtype: str = "float32"
    eos_token_id: int | list | None = field(default_factory=lambda: [154820, 154827, 154829])
    pad_token_id: int | None = 154820
    torch_dtype: str = "bfloat16"
    quantization_config: dict | None = field(default_factory=lambda: dict(GLM_FP8_QUANTIZATION_CONFIG))
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.indexer_types is None:
            self.indexer_types = self.derive_indexer_types(
                self.num_hidden_layers, self.index_topk_freq, self.index_skip_topk_offset,
                self.extra.get("index_topk_pattern"))
        self._validate()
        n = self.num_hidden_layers
        if len(self.indexer_types) != n or set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"Glm52Config: indexer_types must list 'full'/'shared' for each of the {n} layers, "
                             f"got {self.indexer_types}")
        if self.indexer_types[0] != "full":
            raise ValueError("Glm52Config: indexer_types[0] must be 'full' (a 'shared' layer reuses the "
                             "previous full layer's top-k)")
        if self.index_head_dim < self.qk_rope_head_dim or self.index_topk <= 0 or self.index_n_heads <= 0:
            raise ValueError(f"Glm52Config: index_head_dim {self.index_head_dim} must hold the rope dims "
                             f"{self.qk_rope_head_dim}; index_topk / index_n_heads must be positive")
        if self.q_lora_rank is None:
            raise ValueError("Glm52Config: the DSA indexer reads the q latent, q_lora_rank cannot be None")

    @staticmethod
    def derive_indexer_types(num_layers: int, freq: int | None = 1, offset: int | None = 2,
                             pattern: str | list | None = None) -> list[str]:
        """The Hugging Face ``GlmMoeDsaConfig`` rule (pattern first, else freq / offset)."""
        if pattern is not None:
            return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        freq = max(freq if freq is not None else 1, 1)
        offset = 2 if offset is None else offset
        return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]

    def replace(self, **changes) -> "Glm52Config":
        """``dataclasses.replace``; ``indexer_types`` that follow the freq / offset rule are derived again when
        the layer count or the rule's inputs change (explicit lists are kept and must still fit)."""
        schedule = ("num_hidden_layers", "index_topk_freq", "index_skip_topk_offset")
        derived = self.derive_indexer_types(self.num_hidden_layers, self.index_topk_freq,
                                            self.index_skip_topk_offset, self.extra.get("index_topk_pattern"))
        if "indexer_types" not in changes and any(k in changes for k in schedule) and self.indexer_types == derived:
            changes["indexer_types"] = None
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> "Glm52Config":
        d = _read_json(path_or_dict)
        if d.get("model_type") not in cls.model_types:
            raise ValueError(f"Glm52Config: model_type {d.get('model_type')!r} is not one of {cls.model_types}")
        return cls.from_dict(d)

    def to_hf(self) -> dict:
        return self.to_dict()

    def is_full_indexer_layer(self, i: int) -> bool:
        return self.indexer_types[i] == "full"

    @classmethod
    def full(cls) -> "Glm52Config":
        """The real GLM 5.2 (78 layers, 256 experts, hidden 6144, 21 full / 57 shared indexer layers;
        ≈743.4 B parameters without the MTP layer)."""
        return cls()

    @classmethod
    def tiny(cls) -> "Glm52Config":
        """Same structure at CPU size: 1 dense + 3 MoE layers with indexer types full, full, shared, full,
        ``index_topk`` 8 (tests use longer sequences), FP8-block and INT4-compatible dimensions. 16 indexer
        heads: with very few, a key's ReLU-summed score is often exactly 0 and top-k ties become common (any
        pick among tied keys is a valid top-k, so paths that break ties differently would diverge)."""
        return cls(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                   head_dim=32, n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=128, kv_lora_rank=128,
                   qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=16, index_head_dim=64,
                   index_topk=8, index_topk_freq=2, index_skip_topk_offset=2, max_position_embeddings=4096,
                   eos_token_id=[1], pad_token_id=1)


ModelConfig = KimiK26Config | Glm52Config


def config_from_hf(path_or_dict: str | os.PathLike | dict) -> ModelConfig:
    """Pick the config class from ``model_type`` (``kimi_k25`` / ``kimi_k2`` / ``deepseek_v3`` / ``glm_moe_dsa``)."""
    d = _read_json(path_or_dict)
    mt = d.get("model_type")
    for cls in (KimiK26Config, Glm52Config):
        if mt in cls.model_types:
            return cls.from_hf(d)
    raise ValueError(f"config: model_type {mt!r} is not supported; expected one of "
                     f"{KimiK26Config.model_types + Glm52Config.model_types}")


# ---------------------------------------------------------------------------------------------------
# parameter counting from dimensions (no allocation)
# ---------------------------------------------------------------------------------------------------
def _mlp_params(hidden: int, inter: int) -> int:
    return 3 * hidden * inter  # gate_proj, up_proj, down_proj


def attention_parameters(config: ModelConfig) -> int:
    """One MLA block (projections and latent norms; no indexer)."""
    c = config
    h, heads = c.hidden_size, c.num_attention_heads
    if c.q_lora_rank:
        q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * heads * c.qk_head_dim
    else:
        q = h * heads * c.qk_head_dim
    kv = h * c.kv_cache_dim + c.kv_lora_rank + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    o = heads * c.v_head_dim * h
    bias = (c.q_lora_rank or heads * c.qk_head_dim) + c.kv_cache_dim + h if c.attention_bias else 0
    return q + kv + o + bias


def indexer_parameters(config: Glm52Config) -> int:
    """One DSA lightning indexer: wq_b, wk, k_norm (LayerNorm weight + bias), weights_proj."""
    c = config
    return (c.q_lora_rank * c.index_n_heads * c.index_head_dim + c.hidden_size * c.index_head_dim
            + 2 * c.index_head_dim + c.hidden_size * c.index_n_heads)


def num_parameters(config: ModelConfig, breakdown: bool = False) -> int | dict[str, int]:
    """Logical parameter count of the text model from its dimensions (quantized weights count their
    unpacked elements; scales excluded; the MTP layer excluded). ``breakdown`` returns the parts."""
    c = config
    h, L = c.hidden_size, c.num_hidden_layers
    n_moe = sum(c.is_moe_layer(i) for i in range(L))
    parts = {
        "embeddings": c.vocab_size * h * (1 if c.tie_word_embeddings else 2),
        "attention": L * attention_parameters(c),
        "indexer": sum(indexer_parameters(c) for i in range(L) if c.is_full_indexer_layer(i))
        if isinstance(c, Glm52Config) else 0,
        "dense_mlp": (L - n_moe) * _mlp_params(h, c.intermediate_size),
        "routed_experts": n_moe * c.n_routed_experts * _mlp_params(h, c.moe_intermediate_size),
        "shared_experts": n_moe * _mlp_params(h, c.moe_intermediate_size * c.n_shared_experts),
        "routers": n_moe * (c.n_routed_experts * h + c.n_routed_experts),
        "norms": L * 2 * h + h,
    }
    return parts if breakdown else sum(parts.values())
