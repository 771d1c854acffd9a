"""Train a small Kimi K2.6-shaped model on real text available offline: the Python standard library's source.

    python -m mla_quant.eval.train --out runs/stdlib --time-budget 290 --qat-time 35     # one H200, ~6 min
    python -m mla_quant.eval.train --out /tmp/smoke --smoke                             # CPU, seconds

So that fidelity (docs/fidelity.md) is measured on real activation statistics rather than random weights.

* Data: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` / ``dist-packages``
  excluded), read as bytes — a byte vocabulary of 256, no tokenizer. A file goes to validation when the
  SHA-1 of its path relative to the stdlib root is 0 mod ``--val-every`` (a fixed split, stable across
  machines for the files they share); files are joined in sorted path order with a NUL byte between them.
* Model: ``KimiK26ForCausalLM`` of this library (MLA with YaRN RoPE in every layer, one dense layer, then MoE
  layers with ``noaux_tc`` routing, a shared expert and routed experts), at a small width (``SIZES``).
  Trained through a differentiable plain forward (:func:`train_forward`): the same modules, with attention
  through ``F.scaled_dot_product_attention`` (the Triton prefill kernel has no backward) and routed experts
  through ``StackedExperts``' differentiable per-expert torch path (taken whenever autograd is active).
  Aux-loss-free load balancing as DeepSeek-V3: after each step ``e_score_correction_bias += γ · sign(mean
  load − load)``.
* Optimisation: AdamW (β = 0.9, 0.95; weight decay on matrices), linear warm-up then cosine decay to 10 %,
  gradient clipping, bf16 autocast on the GPU, a fixed seed. ``--time-budget`` fixes the number of steps
  from the measured speed of the first steps (printed), so the schedule ends within the budget.
* Optional QAT phase (``--qat-time`` / ``--qat-steps``): the routed experts switch to INT4 fake quantization
  (``modules.qat.enable_qat_``), only they train, distilled from the BF16 model (KL to its next-byte
  distribution), then ``export_qat_`` gives real Int4Group experts, saved as a second checkpoint.

Writes under ``--out``: ``model/`` (``save_pretrained``, the real Kimi K2.6 layout, bf16), ``model_qat/``
(INT4 experts, when QAT ran) and ``train.json`` (settings, data, losses, the unigram baseline).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SEPARATOR = 0   # the byte between two files
VOCAB = 256

# name -> KimiK26Config overrides. Every matmul input width is a multiple of 128 (FP8 blocks, activation
# groups) and of 32 (INT4 groups); "small" keeps Kimi's KV row (512 latent + 64 rope: the 656-byte layout).
SIZES = {
    "small": dict(hidden_size=512, intermediate_size=1536, moe_intermediate_size=256, num_hidden_layers=6,
                  num_attention_heads=8, n_routed_experts=16, num_experts_per_tok=4, q_lora_rank=256,
                  kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128),
    "smoke": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=128,
                  kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64),
}
# GLM 5.2-shaped (MLA + DSA lightning indexer, IndexShare): the "small" Kimi widths plus an indexer of 4 heads
# x 128 (rope on its first 64 dims, as GLM), top-k 256 so that the sparse selection acts from context 257 on,
# and GLM's indexer schedule (freq 4, offset 2: layers full, full, shared, shared, shared, full).
GLM_INDEXER = {"glm-small": dict(index_n_heads=4, index_head_dim=128, index_topk=256),
               "glm-smoke": dict(index_n_heads=4, index_head_dim=32, index_topk=16)}
SIZES.update({"glm-small": dict(SIZES["small"], **GLM_INDEXER["glm-small"]),
              "glm-smoke": dict(SIZES["smoke"], num_hidden_layers=3, **GLM_INDEXER["glm-smoke"])})
ARCHS = ("kimi", "glm")


def model_config(size: str):
    """A ``KimiK26Config`` (or, for the ``glm-*`` sizes, a ``Glm52Config``: DSA with GLM's indexer schedule)
    of the given size with a byte vocabulary (the family's other settings kept)."""
    from ..models import Glm52Config, KimiK26Config

    if size not in SIZES:
        raise ValueError(f"size: {size!r} not in {sorted(SIZES)}")
    sizes = SIZES[size]
    common = dict(vocab_size=VOCAB, first_k_dense_replace=1, n_shared_experts=1,
                  num_key_value_heads=sizes["num_attention_heads"], eos_token_id=None, pad_token_id=None, **sizes)
    if size.startswith("glm-"):
        return Glm52Config(quantization_config=None, max_position_embeddings=1 << 20, **common)
    return KimiK26Config(bos_token_id=None, **common)


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Corpus:
    """``train`` / ``val``: uint8 [N] byte streams; ``info``: where they came from."""

    train: torch.Tensor
    val: torch.Tensor
    info: dict


def stdlib_files(root: str | Path | None = None) -> tuple[Path, list[Path]]:
    """The stdlib root and its ``*.py`` files (sorted, installed packages excluded)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"root: no directory {str(root)!r}")
    files = sorted(p for p in root.rglob("*.py") if p.is_file()
                   and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    if not files:
        raise FileNotFoundError(f"root: no *.py files under {str(root)!r}")
    return root, files


def is_validation(rel_path: str, val_every: int) -> bool:
    """The fixed split: SHA-1 of the relative path, 0 mod ``val_every`` -> validation."""
    return int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:8], "little") % val_every == 0


def load_corpus(root: str | Path | None = None, val_every: int = 20, max_files: int | None = None) -> Corpus:
    """Read the stdlib sources into train / validation byte streams (``max_files``: the first ones only)."""
    if val_every < 2:
        raise ValueError(f"val_every: {val_every} must be >= 2")
    root, files = stdlib_files(root)
    files = files[:max_files] if max_files else files
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    for path in files:
        rel = path.relative_to(root).as_posix()
        parts["val" if is_validation(rel, val_every) else "train"].append(path.read_bytes())
    streams = {k: torch.frombuffer(bytearray(bytes([SEPARATOR]).join(v)), dtype=torch.uint8) for k, v in parts.items()}
    if streams["val"].numel() == 0 or streams["train"].numel() == 0:
        raise ValueError(f"max_files / val_every: an empty split ({len(parts['train'])} train, "
                         f"{len(parts['val'])} validation files)")
    info = {"root": str(root), "python": sys.version.split()[0], "files": len(files),
            "train_files": len(parts["train"]), "val_files": len(parts["val"]),
            "train_bytes": streams["train"].numel(), "val_bytes": streams["val"].numel(), "val_every": val_every}
    return Corpus(streams["train"], streams["val"], info)


def windows(data: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` random windows of ``length`` bytes of ``data`` [N] -> int64 [count, length] (on data's device)."""
    if data.numel() < length:
        raise ValueError(f"length: {length} exceeds the {data.numel()} bytes of the stream")
    starts = torch.randint(0, data.numel() - length + 1, (count,), generator=generator)
    idx = starts[:, None] + torch.arange(length)[None]
    return data[idx.to(data.device)].long()


def unigram_loss(train: torch.Tensor, val: torch.Tensor) -> float:
    """Cross-entropy (nats/byte) of ``val`` under the byte frequencies of ``train`` (add-one smoothed)."""
    counts = torch.bincount(train.long().cpu(), minlength=VOCAB).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[val.long().cpu()].mean())


# ----------------------------------------------------------------------------------------------- model
def sdpa_attention(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``MLAttention.forward`` (plain causal, naive form) with the attention itself through
    ``F.scaled_dot_product_attention`` so that it has a backward: x [B, T, hidden] -> [B, T, hidden]."""
    return _sdpa(attn, x, positions)[0]


def _sdpa(attn: nn.Module, x: torch.Tensor, positions: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sdpa_attention` that also returns q, k [B, T, H, nope + rope] (for the indexer's target)."""
    bsz, t, _ = x.shape
    pos = positions.expand(bsz, t)
    q_nope, q_pe = attn.project_q(x, pos)                                     # [B, T, H, dn], [B, T, H, dr]
    latent, k_pe = attn.project_kv(x, pos)                                    # [B, T, c], [B, T, dr]
    k_nope, v = attn.expand_kv(latent)                                        # [B, T, H, dn], [B, T, H, dv]
    q = torch.cat([q_nope, q_pe], dim=-1)
    k = torch.cat([k_nope, k_pe[..., None, :].expand(*k_nope.shape[:-1], k_pe.shape[-1])], dim=-1)
    d_qk, d_v = q.shape[-1], v.shape[-1]
    vp = F.pad(v, (0, d_qk - d_v)) if d_v < d_qk else v                      # same head dim: fused kernels
    qc, kc = q.to(vp.dtype), k.to(vp.dtype)
    o = F.scaled_dot_product_attention(qc.transpose(1, 2), kc.transpose(1, 2), vp.transpose(1, 2), is_causal=True,
                                       scale=attn.softmax_scale).transpose(1, 2)[..., :d_v]
    return attn.output(o), q, k


def train_forward(model: nn.Module, input_ids: torch.Tensor, observe=None) -> torch.Tensor:
    """The plain causal forward of a ``KimiK26ForCausalLM`` (``model(input_ids)``), differentiable:
    input_ids [B, T] -> logits [B, T, vocab]. A ``Glm52ForCausalLM`` runs it *dense* (every visible token
    attended, as ``model(ids)`` does up to ``index_topk`` tokens): DSA's dense warm-up, the indexer trained
    beside it (:class:`IndexerDistillation`, passed as ``observe``: called with each layer, its normalised
    input and its q, k)."""
    from ..modules.attention import MLAttention

    x = model.model.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    for layer in model.model.layers:
        if not isinstance(layer.self_attn, MLAttention):
            raise TypeError(f"train_forward: layer {layer.layer_idx} has {type(layer.self_attn).__name__}; "
                            "only MLA / DSA (Kimi K2.6, GLM 5.2) models train here")
        h = layer.input_layernorm(x)
        o, q, k = _sdpa(layer.self_attn, h, positions)
        if observe is not None:
            observe(layer, h, q, k)
        x = x + o
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


class IndexerDistillation:
    """DeepSeek V3.2's dense warm-up of the lightning indexer, as an auxiliary loss beside the LM loss.

    For the first ``rows`` sequences of a batch, the target of each full layer's indexer is the dense
    attention distribution of its layer group (the full layer and the shared layers after it, which reuse
    its top-k): softmax(q·kᵀ · scale) averaged over heads and layers (detached), and the loss is
    KL(target ‖ softmax(index scores)) per query, mean over queries. The indexer's inputs (the layer's
    normalised input and its q latent) are detached, so it trains apart from the model (as DeepSeek V3.2).
    Use: ``d = IndexerDistillation(rows)``; ``train_forward(model, ids, d)``; ``d.loss()``.
    """

    def __init__(self, rows: int):
        if rows < 1:
            raise ValueError(f"rows: {rows} must be >= 1")
        self.rows = rows
        self.groups: list[dict] = []

    def __call__(self, layer: nn.Module, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        from ..modules.dsa import DSAttention

        attn = layer.self_attn
        if not isinstance(attn, DSAttention):
            return
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            qf, kf = q[:self.rows].float(), k[:self.rows].float()               # [b, T, H, D]
            logits = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * attn.softmax_scale
            t = logits.shape[-1]
            causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).mean(1)   # [b, T, T]
        if attn.indexer is not None:
            self.groups.append({"attn": attn, "h": h[:self.rows].detach(), "probs": [probs]})
        elif self.groups:
            self.groups[-1]["probs"].append(probs)

    def loss(self) -> torch.Tensor:
        """Mean KL (nats) over the full layers and the queries; clears the collected targets."""
        if not self.groups:
            raise ValueError("IndexerDistillation: no DSA layer seen (call train_forward with it first)")
        total, groups = 0.0, self.groups
        self.groups = []
        for g in groups:
            attn, h = g["attn"], g["h"]
            with torch.no_grad():
                q_latent = attn.q_latent(h)
            index = attn.indexer.scores(h, q_latent).float()                     # [b, T, T], -inf above
            target = torch.stack(g["probs"]).mean(0)
            logq = torch.log_softmax(index, dim=-1)
            visible = torch.isfinite(index)
            ce = -(target * torch.where(visible, logq, 0.0)).sum(-1)
            entropy = -(target * torch.where(target > 0, target.log(), 0.0)).sum(-1)
            total = total + (ce - entropy).mean()
        return total / len(groups)


@torch.no_grad()
def init_weights_(model: nn.Module, seed: int) -> nn.Module:
    """Random weights for training from scratch: ``init_random_weights_`` (std K^-0.5), then unit norm gains,
    zero norm biases (the indexer's LayerNorm) and routing biases, and the residual branches' output
    projections scaled by (2 · layers)^-0.5."""
    from ..models import init_random_weights_

    init_random_weights_(model, seed)
    depth = (2 * model.config.num_hidden_layers) ** -0.5
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith(".bias") else 1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "down_proj_weight")):
            p.mul_(depth)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.zero_()
    return model


class LoadBalancer:
    """DeepSeek-V3's aux-loss-free balancing: counts the tokens each routed expert gets (forward hooks on the
    routers) and, at :meth:`step`, moves ``e_score_correction_bias`` by ``gamma`` toward equal load."""

    def __init__(self, model: nn.Module, gamma: float):
        from ..modules.router import Router

        self.gamma = gamma
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.counts = [torch.zeros(r.n_routed_experts, device=r.weight.device) for r in self.routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, i: int):
        def hook(router, _inp, out):
            if router.training:   # validation forwards do not steer the balance
                self.counts[i] += torch.bincount(out[1].reshape(-1), minlength=self.counts[i].numel())
        return hook

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases; returns the worst max/mean load ratio over the layers (1 = balanced)."""
        worst = 1.0
        for r, c in zip(self.routers, self.counts):
            if c.sum() > 0:
                r.e_score_correction_bias += self.gamma * torch.sign(c.mean() - c)
                worst = max(worst, float(c.max() / c.mean()))
            c.zero_()
        return worst

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def build_model(size: str, seed: int, device: torch.device):
    from ..models import Glm52Config, Glm52ForCausalLM, KimiK26ForCausalLM

    config = model_config(size)
    cls = Glm52ForCausalLM if isinstance(config, Glm52Config) else KimiK26ForCausalLM
    return init_weights_(cls(config, dtype=torch.float32, device=device), seed)


# ------------------------------------------------------------------------------------------- training
def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to 10 % at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model: nn.Module, val_windows: torch.Tensor, batch: int, plain: bool = False) -> float:
    """Mean next-byte cross-entropy (nats/byte) over ``val_windows`` [N, T + 1]: through the training forward
    (bf16 autocast on the GPU), or ``plain``: the model's own forward in its dtype (a DSA model sparse)."""
    total, count = 0.0, 0
    for i in range(0, val_windows.shape[0], batch):
        w = val_windows[i:i + batch]
        if plain:
            logits = model(w[:, :-1])
        else:
            with _autocast(w.device):
                logits = train_forward(model, w[:, :-1])
        total += float(F.cross_entropy(logits.float().reshape(-1, VOCAB), w[:, 1:].reshape(-1), reduction="sum"))
        count += w[:, 1:].numel()
    return total / count


def _optimizer(params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float, device: torch.device):
    decay = [p for _, p in params if p.dim() >= 2]
    other = [p for _, p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _plan_steps(args, step: int, elapsed: float, t_first: float, budget: float) -> int | None:
    """The total step count that fits in ``budget`` seconds at the speed measured since step 2 (None while
    still timing the first ``--calibrate-steps`` steps)."""
    if step < max(3, args.calibrate_steps):
        return None
    per_step = (elapsed - t_first) / (step - 2)
    return step + max(1, int(0.93 * (budget - elapsed) / per_step))   # 7 %: the periodic validations


def run_phase(args, name: str, model: nn.Module, loss_fn, params, corpus_train: torch.Tensor, val_windows,
              steps: int | None, budget: float | None, peak_lr: float, log: list, balancer=None) -> dict:
    """One training loop (pre-training or QAT): returns its summary. ``steps`` fixed, or set from ``budget``."""
    device = corpus_train.device
    if steps is None and not budget:
        raise ValueError(f"{name}: give a step count or a time budget")
    opt = _optimizer(params, peak_lr, args.weight_decay, device)
    gen = torch.Generator().manual_seed(args.seed + (0 if name == "train" else 1))
    warmup = max(1, min(args.warmup, (steps or 10 ** 9) // 10)) if name == "train" else 1
    total, step, t0, t_first = steps, 0, time.time(), 0.0
    tokens = args.batch * args.context
    last = {}
    while total is None or step < total:
        if step == 2:
            t_first = time.time() - t0
        lr = lr_at(step, total or 10 ** 9, peak_lr, warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        w = windows(corpus_train, args.batch, args.context + 1, gen)
        with _autocast(device):
            loss = loss_fn(w)
        loss, extra = loss if isinstance(loss, tuple) else (loss, {})     # extra: more figures to log
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # the DSA indexer trains on its own loss (detached inputs): clipped apart from the model
        grad_norm = float(torch.nn.utils.clip_grad_norm_([p for n, p in params if ".indexer." not in n], args.clip))
        if any(".indexer." in n for n, _ in params):
            torch.nn.utils.clip_grad_norm_([p for n, p in params if ".indexer." in n], args.clip)
        opt.step()
        imbalance = balancer.step() if balancer is not None else float("nan")
        step += 1
        elapsed = time.time() - t0
        if total is None:
            total = _plan_steps(args, step, elapsed, t_first, budget)
            if total is not None:
                print(f"[{name}] {step} steps took {elapsed:.1f}s; planning {total} steps for a {budget:.0f}s budget",
                      flush=True)
        last = {"phase": name, "step": step, "loss": float(loss.detach()), "lr": lr, "grad_norm": grad_norm,
                "tokens_per_s": tokens * max(step - 2, 1) / max(elapsed - t_first, 1e-9) if step > 2 else None,
                "elapsed_s": elapsed, "max_load_ratio": imbalance, **extra}
        done = total is not None and step >= total
        if step % args.eval_every == 0 or done:
            model.eval()
            last["val_loss"] = evaluate(model, val_windows, args.batch)
            model.train()
        if step % args.log_every == 0 or done or "val_loss" in last:
            log.append(dict(last))
            tps = f"{last['tokens_per_s']:.3g} tok/s" if last["tokens_per_s"] else "-"
            val = f" val {last['val_loss']:.4f}" if "val_loss" in last else ""
            val += "".join(f" {k} {v:.4f}" for k, v in extra.items())
            print(f"[{name}] step {step}/{total or '?'} loss {last['loss']:.4f}{val} lr {lr:.2e} "
                  f"|g| {grad_norm:.2f} load {imbalance:.2f} {tps} {elapsed:.0f}s", flush=True)
    return {"steps": step, "seconds": time.time() - t0, "final_loss": last.get("loss"),
            "final_val_loss": last.get("val_loss"), "tokens": step * tokens}


def _kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) per position, mean (nats)."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return F.kl_div(s.reshape(-1, VOCAB), t.reshape(-1, VOCAB), log_target=True, reduction="batchmean")


@contextmanager
def torch_backend():
    """Every op of the library on its pure-torch path while open (``MLA_QUANT_BACKEND=torch``): training
    needs no Triton kernel (attention through SDPA, experts and linears through torch), and the no-grad
    validation forwards then use the very path training differentiates instead of compiling fused kernels."""
    before = os.environ.get("MLA_QUANT_BACKEND")
    os.environ["MLA_QUANT_BACKEND"] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ["MLA_QUANT_BACKEND"]
        else:
            os.environ["MLA_QUANT_BACKEND"] = before


def train(args) -> dict:
    """Train (and optionally QAT-fine-tune), save the checkpoints, return the summary written to train.json."""
    with torch_backend():
        return _train(args)


def _train(args) -> dict:
    from ..models import from_pretrained, save_pretrained
    from ..modules import qat

    torch.manual_seed(args.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus(args.stdlib, args.val_every, args.max_files)
    train_data = corpus.train.to(device)
    val_windows = windows(corpus.val.to(device), args.val_windows, args.context + 1,
                          torch.Generator().manual_seed(args.seed + 7))
    summary = {"args": vars(args), "data": corpus.info, "device": str(device), "torch": torch.__version__,
               "unigram_val_loss": unigram_loss(corpus.train, corpus.val),
               # the baseline on the very bytes the validation loss is measured on (the windows' targets)
               "unigram_val_windows_loss": unigram_loss(corpus.train, val_windows[:, 1:].reshape(-1)), "log": []}
    print(f"data: {json.dumps(corpus.info)}; unigram validation loss {summary['unigram_val_loss']:.4f} nats/byte",
          flush=True)

    model = build_model(args.size, args.seed, device).train()
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    print(f"model: {args.size}, {summary['parameters'] / 1e6:.1f} M parameters, batch {args.batch} x "
          f"context {args.context}", flush=True)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    balancer = LoadBalancer(model, args.balance_gamma)

    has_indexer = any(".indexer." in n for n, _ in params)
    indexer_kl = IndexerDistillation(min(args.indexer_rows, args.batch)) if has_indexer else None

    def lm_loss(w: torch.Tensor):
        logits = train_forward(model, w[:, :-1], indexer_kl)
        lm = F.cross_entropy(logits.float().reshape(-1, VOCAB), w[:, 1:].reshape(-1))
        if indexer_kl is None:
            return lm
        kl = indexer_kl.loss()
        return lm + args.indexer_weight * kl, {"indexer_kl": float(kl.detach())}

    summary["train"] = run_phase(args, "train", model, lm_loss, params, train_data, val_windows, args.steps,
                                 args.time_budget, args.lr, summary["log"], balancer)
    balancer.remove()
    # the checkpoint: bf16 weights in the real Kimi K2.6 layout (the fp32 reference is this, loaded in fp32)
    bf16 = type(model)(model.config, dtype=torch.bfloat16, device=device)
    bf16.load_state_dict(model.state_dict())
    save_pretrained(bf16, out / "model")
    del bf16, model
    reference = from_pretrained(out / "model", dtype=torch.float32, device=device).eval()
    summary["val_loss_saved"] = evaluate(reference, val_windows, args.batch)
    print(f"saved {out / 'model'}: validation loss {summary['val_loss_saved']:.4f} nats/byte (bf16 weights)",
          flush=True)
    if any(".indexer." in n for n, _ in reference.named_parameters()):
        # the served (sparse) model against its dense self, fp32 plain forwards, on the first validation windows
        from .sparse import dense_attention

        sub = val_windows[:args.sparse_val_windows]
        summary["val_loss_sparse"] = evaluate(reference, sub, 4, plain=True)
        with dense_attention(reference):
            summary["val_loss_dense_plain"] = evaluate(reference, sub, 4, plain=True)
        print(f"validation loss on {sub.shape[0]} windows, fp32: sparse (top-{reference.config.index_topk}) "
              f"{summary['val_loss_sparse']:.4f}, dense {summary['val_loss_dense_plain']:.4f}", flush=True)
    _write(out, summary)

    if args.qat_steps or args.qat_time:
        student = copy.deepcopy(reference)
        qat.enable_qat_(student)
        for n, p in student.named_parameters():
            p.requires_grad_(".experts." in n)
        qparams = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
        student.train()

        def distill(w: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                teacher = train_forward(reference, w[:, :-1])
            return _kl_loss(train_forward(student, w[:, :-1]), teacher)

        summary["qat"] = run_phase(args, "qat", student, distill, qparams, train_data, val_windows,
                                   args.qat_steps, args.qat_time, args.qat_lr, summary["log"])
        qat.export_qat_(student.eval())
        save_pretrained(student, out / "model_qat")
        summary["val_loss_qat"] = evaluate(student, val_windows, args.batch)
        print(f"saved {out / 'model_qat'}: INT4 experts (QAT), validation loss {summary['val_loss_qat']:.4f}",
              flush=True)
    _write(out, summary)
    return summary


def _write(out: Path, summary: dict) -> None:
    (out / "train.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mla_quant.eval.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (model/, model_qat/, train.json)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 40 steps on the CPU (a test runs it)")
    p.add_argument("--arch", default="kimi", choices=ARCHS,
                   help="kimi: Kimi K2.6-shaped (MLA); glm: GLM 5.2-shaped (MLA + DSA indexer, size glm-<size>)")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--indexer-rows", type=int, default=4,
                   help="GLM: sequences of each batch whose dense attention distils the indexer")
    p.add_argument("--indexer-weight", type=float, default=1.0, help="GLM: weight of the indexer KL loss")
    p.add_argument("--sparse-val-windows", type=int, default=16,
                   help="GLM: validation windows of the final sparse-vs-dense loss (fp32 plain forwards)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=2048, help="training context (bytes)")
    p.add_argument("--steps", type=int, help="fixed step count (default: from --time-budget)")
    p.add_argument("--time-budget", type=float, default=290.0, help="seconds of pre-training when --steps is unset")
    p.add_argument("--calibrate-steps", type=int, default=12, help="steps timed before the step count is fixed")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--balance-gamma", type=float, default=1e-3)
    p.add_argument("--qat-steps", type=int, help="QAT fine-tune steps (default: from --qat-time)")
    p.add_argument("--qat-time", type=float, default=0.0, help="seconds of QAT fine-tune (0 and no --qat-steps: none)")
    p.add_argument("--qat-lr", type=float, default=5e-4)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--val-windows", type=int, default=64, help="fixed validation windows of --context bytes")
    p.add_argument("--val-every", type=int, default=20, help="1 file in val-every (by path hash) is validation")
    p.add_argument("--max-files", type=int, help="use only the first files (sorted paths)")
    p.add_argument("--stdlib", help="the stdlib folder (default: sysconfig's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        # A fixed step count (never a time budget), enough for any stdlib's first files to clearly beat the
        # unigram baseline (6 steps did so only by chance); 32 validation windows keep that comparison stable.
        args.size, args.batch, args.context, args.steps = "smoke", 4, 64, args.steps or 40
        args.qat_steps, args.max_files = args.qat_steps or 2, args.max_files or 60
        args.val_windows, args.eval_every, args.log_every, args.device = 32, 20, 10, "cpu"
        args.val_every = min(args.val_every, 5)
    if args.arch == "glm" and not args.size.startswith("glm-"):
        args.size = f"glm-{args.size}"
    return args


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
