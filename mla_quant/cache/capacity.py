"""How many tokens of MLA KV fit per replica: HBM minus the weights one GPU holds minus a reserve, divided by
the bytes one token takes in every layer (docs/kv_cache.md, "Capacity").

MLA caches one latent row per token and layer, shared by all heads, so tensor parallelism cannot split it:
every TP rank holds the full latent cache of its replica. Per GPU, and so per replica:

    tokens = floor((hbm - weights_per_gpu - reserve) / (page_size · Σ_layers bytes_per_token)) · page_size

With the defaults this reproduces the seed's numbers for Kimi K2.6 on 8×H200 with TP8: ≈686k tokens with a
BF16 cache and ≈1.37M with FP8 (e4m3).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..formats import KVFormat

H200_HBM_GB = 141.0          # marketed HBM3e capacity per H200, in GB (1e9 bytes)
DEFAULT_RESERVE_GB = 16.6    # see kv_capacity's docstring
BF16_BYTES = 2


def _cfg(config, key: str, default=None, required: bool = True):
    """A config field from a dict or an attribute object (a Hugging Face multimodal config's text part when
    the top level has a ``text_config``)."""
    if isinstance(config, Mapping):
        if "text_config" in config and key not in config:
            return _cfg(config["text_config"], key, default, required)
        if key in config and config[key] is not None:
            return config[key]
    else:
        text = getattr(config, "text_config", None)
        if text is not None and not hasattr(config, key):
            return _cfg(text, key, default, required)
        value = getattr(config, key, None)
        if value is not None:
            return value
    if required and default is None:
        raise ValueError(f"config: missing {key!r} (a dict or object with the Hugging Face config keys)")
    return default


def _quantization(config) -> dict:
    q = _cfg(config, "quantization_config", required=False)
    if q is None:
        return {}
    return q if isinstance(q, Mapping) else vars(q)


def _routed_bytes_per_param(config) -> float:
    """Routed experts: compressed-tensors INT-k groups (bf16 scales), FP8 blocks (fp32 scales), or bf16."""
    q = _quantization(config)
    if q.get("quant_method") == "compressed-tensors":
        w = next(iter(q["config_groups"].values()))["weights"]
        return w["num_bits"] / 8 + BF16_BYTES / w["group_size"]
    return _dense_bytes_per_param(config)


def _dense_bytes_per_param(config) -> float:
    """Other decoder linears: FP8 blocks when the checkpoint is FP8, else bf16 (compressed-tensors leaves
    attention, shared experts and dense MLPs in bf16, as Kimi K2.6's ``ignore`` list says)."""
    q = _quantization(config)
    if q.get("quant_method") == "fp8":
        bn, bk = q.get("weight_block_size", (128, 128))
        return 1 + 4 / (bn * bk)
    return BF16_BYTES


def weight_bytes_per_gpu(config, tp: int = 8, ep: int | None = None) -> float:
    """Bytes of checkpoint weights one GPU holds, for a DeepSeek-V3-style MLA + MoE config (Kimi K2.x,
    DeepSeek V3, GLM 5.x), counted from the config's dimensions and ``quantization_config``.

    Sharding (SGLang/vLLM TP of MLA): ``q_b_proj``, ``kv_b_proj``, ``o_proj``, dense and shared-expert MLPs,
    embeddings and LM head are split over ``tp``; ``q_a_proj``, ``kv_a_proj_with_mqa``, norms, routers and a
    DSA indexer are replicated; routed experts are split over ``ep`` (default ``tp``: every replica holds all
    experts). Multi-token-prediction layers and a vision tower are not counted. Embeddings, LM head, norms and
    routers are bf16; the rest follows :func:`_routed_bytes_per_param` / :func:`_dense_bytes_per_param`.
    """
    ep = tp if ep is None else ep
    h, L = _cfg(config, "hidden_size"), _cfg(config, "num_hidden_layers")
    heads, vocab = _cfg(config, "num_attention_heads"), _cfg(config, "vocab_size")
    qr = _cfg(config, "q_lora_rank", required=False)
    kr, rope = _cfg(config, "kv_lora_rank"), _cfg(config, "qk_rope_head_dim")
    nope, v = _cfg(config, "qk_nope_head_dim"), _cfg(config, "v_head_dim")
    dense_layers = min(_cfg(config, "first_k_dense_replace", 0, required=False), L)
    experts = _cfg(config, "n_routed_experts", 0, required=False)
    moe_dim = _cfg(config, "moe_intermediate_size", 0, required=False)
    shared = _cfg(config, "n_shared_experts", 0, required=False)
    inter = _cfg(config, "intermediate_size")
    lin, routed_b = _dense_bytes_per_param(config), _routed_bytes_per_param(config)

    q_split = heads * (nope + rope) * (qr if qr else h)                  # q_b_proj, or q_proj without LoRA
    q_repl = qr * h if qr else 0                                          # q_a_proj
    attn_split = q_split + heads * (nope + v) * kr + h * heads * v        # + kv_b_proj + o_proj
    attn_repl = q_repl + (kr + rope) * h                                  # + kv_a_proj_with_mqa
    norms = (qr or 0) + kr + 2 * h                                        # q_a, kv_a, input, post-attention
    index_heads = _cfg(config, "index_n_heads", 0, required=False)
    indexer = 0
    if index_heads:
        idim = _cfg(config, "index_head_dim")
        indexer = index_heads * idim * (qr or h) + idim * h + index_heads * h + 2 * idim

    moe_layers = L - dense_layers if experts else 0
    per_gpu = L * (attn_split * lin / tp + attn_repl * lin + norms * BF16_BYTES + indexer * BF16_BYTES)
    per_gpu += (L - moe_layers) * 3 * h * inter * lin / tp                              # dense MLPs
    per_gpu += moe_layers * (experts * 3 * h * moe_dim * routed_b / ep                  # routed experts
                             + shared * 3 * h * moe_dim * lin / tp                      # shared experts
                             + experts * h * BF16_BYTES + experts * 4)                  # router + fp32 bias
    tied = _cfg(config, "tie_word_embeddings", False, required=False)
    per_gpu += (1 if tied else 2) * vocab * h * BF16_BYTES / tp + h * BF16_BYTES        # embed, lm_head, norm
    return per_gpu


_derived_weight_bytes = weight_bytes_per_gpu  # kv_capacity's argument of the same name shadows it


def kv_bytes_per_token(config, kv: str | KVFormat | Sequence[str | KVFormat] = "bf16") -> int:
    """Bytes one token takes in the latent cache of all layers (one format, or one per layer)."""
    layers = _cfg(config, "num_hidden_layers")
    kr, rope = _cfg(config, "kv_lora_rank"), _cfg(config, "qk_rope_head_dim")
    fmts = [KVFormat.parse(kv)] * layers if isinstance(kv, (str, KVFormat)) else [KVFormat.parse(f) for f in kv]
    if len(fmts) != layers:
        raise ValueError(f"kv: {len(fmts)} formats for {layers} layers")
    return sum(f.bytes_per_token(kr, rope) for f in fmts)


@dataclass(frozen=True)
class KVCapacity:
    tokens: int                  # tokens of KV per replica (a multiple of page_size)
    bytes_per_token: int         # latent bytes per token, all layers (+ extra_bytes_per_token)
    kv_budget_bytes: float       # HBM left for KV on each GPU
    weight_bytes_per_gpu: float
    reserve_bytes: float
    hbm_bytes: float
    replicas: int                # gpus // tp


def kv_capacity(config, kv: str | KVFormat | Sequence[str | KVFormat] = "bf16", gpus: int = 8, tp: int = 8,
                hbm_gb: float = H200_HBM_GB, weight_bytes_per_gpu: float | None = None,
                reserve_gb: float = DEFAULT_RESERVE_GB, page_size: int = 64, ep: int | None = None,
                extra_bytes_per_token: int = 0) -> KVCapacity:
    """The arithmetic behind :func:`kv_capacity_tokens`, with every term. See there for the arguments."""
    if gpus < 1 or tp < 1 or gpus % tp:
        raise ValueError(f"gpus/tp: {gpus} GPUs cannot hold replicas of TP {tp}")
    if page_size < 1:
        raise ValueError(f"page_size: {page_size} must be positive")
    weights = _derived_weight_bytes(config, tp, ep) if weight_bytes_per_gpu is None else float(weight_bytes_per_gpu)
    per_token = kv_bytes_per_token(config, kv) + int(extra_bytes_per_token)
    hbm, reserve = hbm_gb * 1e9, reserve_gb * 1e9
    budget = hbm - weights - reserve
    pages = max(int(budget // (per_token * page_size)), 0)
    return KVCapacity(pages * page_size, per_token, budget, weights, reserve, hbm, gpus // tp)


def kv_capacity_tokens(config, kv: str | KVFormat | Sequence[str | KVFormat] = "bf16", gpus: int = 8, tp: int = 8,
                       hbm_gb: float = H200_HBM_GB, weight_bytes_per_gpu: float | None = None,
                       reserve_gb: float = DEFAULT_RESERVE_GB, page_size: int = 64, ep: int | None = None,
                       extra_bytes_per_token: int = 0) -> int:
    """Tokens of MLA KV that fit per replica (``gpus // tp`` replicas of ``tp`` GPUs each).

    Args:
        config: a dict or object with the Hugging Face keys (``num_hidden_layers``, ``kv_lora_rank``,
            ``qk_rope_head_dim``; for the weight estimate also the MLA/MoE dimensions and
            ``quantization_config``); a multimodal config's ``text_config`` is used.
        kv: the KV format (``"bf16"``, ``"fp8_e4m3"`` — per-token scales, 580 bytes —, ``"fp8_ds_mla"``, a
            ``KVFormat``, e.g. ``KVFormat("fp8_e4m3", "tensor")`` for 576 bytes) or one per layer.
        hbm_gb: HBM per GPU, GB of 1e9 bytes. Default 141, the H200's.
        weight_bytes_per_gpu: None derives it from the config (:func:`weight_bytes_per_gpu`): for Kimi K2.6
            (INT4 g32 routed experts with bf16 scales — 570.8 GB —, everything else bf16 — 23.4 GB —, 1.026T
            parameters) that is 76.2 GB per GPU at TP8 (74.3 GB of shards + 1.9 GB of replicated MLA down
            projections, norms and routers).
        reserve_gb: HBM kept outside weights and KV on each GPU — CUDA context and library workspaces,
            activations of a prefill chunk and MoE dispatch buffers, CUDA-graph pools, NCCL buffers, allocator
            fragmentation. Default 16.6 GB (11.8% of 141 GB), calibrated so that Kimi K2.6 on 8×H200 with TP8
            gives the seed's measured ≈686k BF16 tokens; with the same reserve FP8 gives ≈1.37M.
        page_size: capacity is counted in whole pages.
        ep: expert-parallel degree for the routed experts (default ``tp``).
        extra_bytes_per_token: other per-token cache bytes summed over layers (e.g. a DSA indexer key cache).

    Kimi K2.6, 8×H200, TP8, defaults: bf16 → 686,144 tokens; fp8_e4m3 (per token) → 1,362,816;
    fp8_e4m3 per tensor → 1,372,288; fp8_ds_mla → 1,204,928.
    """
    return kv_capacity(config, kv, gpus, tp, hbm_gb, weight_bytes_per_gpu, reserve_gb, page_size, ep,
                       extra_bytes_per_token).tokens
