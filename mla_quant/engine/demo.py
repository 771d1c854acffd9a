"""The main job (``python -m mla_quant``): serve a batch of requests through the seed's asymmetric recipe and
print what was measured (docs/engine.md, "The main job").

A tiny Kimi K2.6-shaped model with random weights (or ``--checkpoint PATH``) is served by the engine with
prefill in FP8 block weights + BF16 KV and decode in INT4 experts + FP8 KV (two instances, the KV pages
handed off and converted after prefill), page tags on. Half of the requests share a prompt prefix; requests
arrive one per step. Then the fp32 (or BF16) reference model is run on the same tokens and the recipe's
next-token distributions are compared with it (KL divergence, top-1 agreement).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time

import torch

from ..formats import BF16, FP8Block, Int4Group, KVFormat
from ..formats.plan import Phase, PhaseRecipe, QuantPlan
from .engine import Engine
from .request import SamplingParams

WEIGHTS = {"bf16": None, "fp8": FP8Block(), "int4": Int4Group(32)}
KV_KINDS = ("bf16", "fp8_e4m3", "fp8_ds_mla")
EXPERTS = r"re:.*mlp\.experts"
KIMI_LAYERS, KIMI_LATENT, KIMI_ROPE = 61, 512, 64   # for the bytes-per-token line at the real width


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mla_quant", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="number of requests")
    p.add_argument("--prompt-len", type=int, default=48, help="prompt tokens per request")
    p.add_argument("--shared-prefix", type=int, default=32,
                   help="tokens of prompt prefix shared by the first half of the requests")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--arrive-every", type=int, default=1, help="engine steps between arrivals (0: all at once)")
    p.add_argument("--prefill-weights", choices=["bf16", "fp8"], default="fp8",
                   help="prefill pool: every linear layer but lm_head in this format (fp8: 128x128 blocks, W8A8)")
    p.add_argument("--decode-experts", choices=["bf16", "fp8", "int4"], default="int4",
                   help="decode pool: routed experts in this format (int4: group 32), the rest as loaded")
    p.add_argument("--prefill-kv", choices=KV_KINDS, default="bf16", help="prefill pool KV format")
    p.add_argument("--decode-kv", choices=KV_KINDS, default="fp8_e4m3", help="decode pool KV format")
    p.add_argument("--reference", choices=["fp32", "bf16"], default="fp32",
                   help="the model the recipe's distributions are compared with (same weights, no quantization)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=0, help="pages per pool (0: room for every request at once)")
    p.add_argument("--max-batched-tokens", type=int, default=128, help="prefill tokens per step (chunked prefill)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--checkpoint", default=None,
                   help="a Kimi K2.6 / GLM 5.2 checkpoint folder instead of random weights")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU intra-op threads (0: 1 on the CPU, where this model's ops are too small to share)")
    p.add_argument("--no-tags", action="store_true", help="switch page tags off")
    p.add_argument("--inject-fault", action="store_true",
                   help="corrupt a page-table entry of one request mid-run: the tags abort exactly that request")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress line on stderr (default: when stderr is a terminal)")
    p.add_argument("--json", default=None, help="also write the measurements to this JSON file")
    args = p.parse_args(argv)
    if args.requests < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        p.error("--requests, --prompt-len and --new-tokens must be at least 1")
    if not 0 <= args.shared_prefix <= args.prompt_len:
        p.error("--shared-prefix must be within [0, --prompt-len]")
    return args


def build_models(args, device: torch.device):
    """(the model to serve, in bf16; the reference model) with the same weights."""
    from ..models import KimiK26Config, KimiK26ForCausalLM, from_pretrained, init_random_weights_

    ref_dtype = torch.float32 if args.reference == "fp32" else torch.bfloat16
    if args.checkpoint:
        return (from_pretrained(args.checkpoint, dtype=torch.bfloat16, device=device),
                from_pretrained(args.checkpoint, dtype=ref_dtype, device=device))
    config = KimiK26Config.tiny()
    model = KimiK26ForCausalLM(config, dtype=torch.bfloat16, device=device)
    init_random_weights_(model, args.seed)
    if ref_dtype == torch.bfloat16:
        return model, copy.deepcopy(model)
    reference = KimiK26ForCausalLM(config, dtype=ref_dtype, device=device)
    reference.load_state_dict(model.state_dict())
    return model, reference


def make_recipe(args) -> PhaseRecipe:
    prefill = None if WEIGHTS[args.prefill_weights] is None else QuantPlan(
        {"lm_head": None, "_default": WEIGHTS[args.prefill_weights]})
    decode = None if WEIGHTS[args.decode_experts] is None else QuantPlan({EXPERTS: WEIGHTS[args.decode_experts]})
    return PhaseRecipe(prefill=Phase(prefill, args.prefill_kv), decode=Phase(decode, args.decode_kv))


def make_prompts(args, vocab_size: int, avoid: set[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    ok = torch.tensor([t for t in range(vocab_size) if t not in avoid])

    def draw(n: int) -> list[int]:
        return ok[torch.randint(len(ok), (n,), generator=g)].tolist()

    prefix = draw(args.shared_prefix)
    sharing = -(-args.requests // 2)
    return [(prefix if i < sharing else draw(args.shared_prefix)) + draw(args.prompt_len - args.shared_prefix)
            for i in range(args.requests)]


class Progress:
    """One self-overwriting stderr line."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.t0 = enabled, total, time.perf_counter()

    def update(self, engine: Engine, done: int) -> None:
        if not self.enabled:
            return
        s = engine.stats
        sys.stderr.write(f"\r[{time.perf_counter() - self.t0:6.1f}s] step {s.steps}  done {done}/{self.total}  "
                         f"running {len(engine.scheduler.running)}  waiting {len(engine.scheduler.waiting)}  "
                         f"decoded {s.decode_tokens} tok  ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def run(args) -> dict:
    """Build, serve, compare; returns the measurements (what :func:`main` prints)."""
    from ..eval import kl_divergence, top1_agreement

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    t_build = time.perf_counter()
    model, reference = build_models(args, device)
    config = model.config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    stop = tuple(t for t in eos if t is not None)
    prompts = make_prompts(args, config.vocab_size, set(stop))
    ps = args.page_size
    pages = args.num_pages or args.requests * -(-(args.prompt_len + args.new_tokens) // ps) + 1
    recipe = make_recipe(args)
    engine = Engine.from_recipe(model, recipe, num_pages=pages, page_size=ps,
                                max_num_batched_tokens=args.max_batched_tokens, page_tags=not args.no_tags,
                                record_logits=True)
    build_s = time.perf_counter() - t_build

    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, stop_token_ids=stop)
    victim = args.requests // 2 if args.inject_fault else None
    fault_at = None
    progress = Progress(sys.stderr.isatty() if args.progress is None else args.progress, args.requests)
    results, submitted = {}, 0
    t_run = time.perf_counter()
    while len(results) < args.requests:
        while submitted < args.requests and engine.stats.steps >= submitted * args.arrive_every:
            engine.add_request(prompts[submitted], params, request_id=submitted)
            submitted += 1
        live = engine.request(victim) if victim is not None and fault_at is None else None
        if live is not None and len(live.output) >= 2:
            engine.inject_fault(victim)
            fault_at = engine.stats.steps
        for r in engine.step():
            results[r.request_id] = r
        progress.update(engine, len(results))
    progress.close()
    run_s = time.perf_counter() - t_run

    # the reference on the very tokens the recipe produced: the distributions at each sampled position
    kl_first, kl_rest, top1_first, top1_rest = [], [], [], []
    with torch.no_grad():
        for r in results.values():
            if r.finish_reason == "aborted" or not r.output_ids:
                continue
            seq = torch.tensor(r.prompt_ids + r.output_ids[:-1], device=device)[None]
            p = reference(seq)[0, len(r.prompt_ids) - 1:].float().cpu()               # [n_out, vocab]
            kl = kl_divergence(p, r.logits, "none")
            agree = top1_agreement(p, r.logits, "none")
            kl_first.append(kl[:1])
            top1_first.append(agree[:1])
            kl_rest.append(kl[1:])
            top1_rest.append(agree[1:])

    def mean(xs) -> float:
        x = torch.cat(xs).double() if xs else torch.zeros(0)
        return float(x.mean()) if x.numel() else math.nan

    s = engine.stats
    done = [r for r in results.values() if r.finish_reason != "aborted"]
    kv = {pool.name: (pool.cache.kv.formats[0], pool.cache.kv.bytes_per_token()) for pool in engine.pools}
    return {
        "device": str(device), "config": config, "recipe": recipe, "two_pools": engine.scheduler.two_pools,
        "requests": args.requests, "prompt_len": args.prompt_len, "shared_prefix": args.shared_prefix,
        "new_tokens": args.new_tokens, "pages": pages, "page_size": ps, "build_s": build_s, "run_s": run_s,
        "stats": s, "kv": kv, "fault_at": fault_at, "victim": victim,
        "aborted": {r.request_id: r.abort_reason for r in results.values() if r.finish_reason == "aborted"},
        "ttft_s": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot_s": [r.tpot_s for r in done if r.tpot_s is not None],
        "finish": {reason: sum(r.finish_reason == reason for r in results.values())
                   for reason in ("length", "stop", "aborted")},
        "kl_first": mean(kl_first), "top1_first": mean(top1_first), "kl_decode": mean(kl_rest),
        "top1_decode": mean(top1_rest), "kl_all": mean(kl_first + kl_rest), "top1_all": mean(top1_first + top1_rest),
        "positions": sum(x.numel() for x in kl_first + kl_rest), "reference": args.reference,
    }


def _describe_phase(phase: Phase) -> str:
    if phase.weights is None:
        w = "weights as loaded"
    else:
        w = ", ".join(f"{'all linear' if k == '_default' else 'experts' if k == EXPERTS else k}: {_fmt_name(v)}"
                      for k, v in phase.weights.items() if v is not None)
    return f"{w} + {phase.kv.kind} KV"


def _fmt_name(fmt) -> str:
    if isinstance(fmt, FP8Block):
        return "FP8 128x128" + (" W8A8" if fmt.act_quant else "")
    if isinstance(fmt, Int4Group):
        return f"INT4 g{fmt.group_size}"
    return "BF16" if isinstance(fmt, BF16) else repr(fmt)


def report(m: dict) -> str:
    c, s = m["config"], m["stats"]
    ms = lambda xs: 1e3 * sum(xs) / len(xs) if xs else math.nan     # noqa: E731
    lines = [
        f"mla_quant main job on {m['device']}: Kimi K2.6-shaped model, {c.num_hidden_layers} layers, hidden "
        f"{c.hidden_size}, {c.n_routed_experts} experts (top {c.num_experts_per_tok}), MLA latent "
        f"{c.kv_lora_rank}+{c.qk_rope_head_dim}, vocab {c.vocab_size}",
        f"recipe   prefill: {_describe_phase(m['recipe'].prefill)}",
        f"         decode:  {_describe_phase(m['recipe'].decode)}   "
        f"({'two instances, KV handed off' if m['two_pools'] else 'one instance'})",
        f"workload {m['requests']} requests x {m['prompt_len']} prompt tokens (half share a {m['shared_prefix']}-token "
        f"prefix), {m['new_tokens']} new tokens; {m['pages']} pages of {m['page_size']} per pool; built in "
        f"{m['build_s']:.1f} s, served in {m['run_s']:.1f} s ({s.steps} steps)",
        "",
        "throughput",
        f"  prefill   {s.prefill_tokens:6d} tokens  {s.prefill_steps:4d} steps  {s.prefill_tokens_per_s:10.1f} tok/s",
        f"  decode    {s.decode_tokens:6d} tokens  {s.decode_steps:4d} steps  {s.decode_tokens_per_s:10.1f} tok/s"
        f"   (mean batch {s.decode_tokens / max(s.decode_steps, 1):.1f})",
    ]
    if m["two_pools"]:
        lines.append(f"  hand-off  {s.handoffs:6d} requests, {s.handoff_pages} pages "
                     f"{m['kv']['prefill'][0].kind} -> {m['kv']['decode'][0].kind} in {1e3 * s.handoff_s:.1f} ms")
    lines += [f"latency   TTFT mean {ms(m['ttft_s']):.1f} ms, max {1e3 * max(m['ttft_s'], default=math.nan):.1f} ms;"
              f"  time per output token mean {ms(m['tpot_s']):.1f} ms",
              "", f"KV bytes per token (all {c.num_hidden_layers} layers)"]
    for name, (fmt, nbytes) in m["kv"].items():
        lines.append(f"  {name:<8} pool  {fmt.kind:<11} {nbytes:8d} B  ({nbytes // c.num_hidden_layers} per layer)")
    real = {k: KIMI_LAYERS * KVFormat(k).bytes_per_token(KIMI_LATENT, KIMI_ROPE) for k in KV_KINDS}
    lines.append(f"  at Kimi K2.6 width ({KIMI_LATENT}+{KIMI_ROPE}, {KIMI_LAYERS} layers): "
                 + ", ".join(f"{k} {v} B" for k, v in real.items()))
    lines += ["",
              f"prefix sharing  {s.shared_pages} pages shared ({s.cached_tokens} prompt tokens not recomputed); "
              f"preemptions {s.preemptions}",
              f"page tags       {s.tag_checks} batched checks, {s.aborts} aborted"]
    if m["fault_at"] is not None:
        lines.append(f"  fault injected at step {m['fault_at']}: request {m['victim']}'s page-table entry 0 "
                     "points at another request's page")
    for rid, why in m["aborted"].items():
        lines.append(f"  request {rid} aborted: {why}")
    lines.append(f"  finished: {m['finish']['length']} at length, {m['finish']['stop']} at a stop token, "
                 f"{m['finish']['aborted']} aborted")
    lines += ["", f"fidelity against the {m['reference']} reference on the same tokens ({m['positions']} positions)",
              f"  first token (prefill pool)    KL {m['kl_first']:.4f} nats   top-1 {100 * m['top1_first']:5.1f}%",
              f"  later tokens (decode pool)    KL {m['kl_decode']:.4f} nats   top-1 {100 * m['top1_decode']:5.1f}%",
              f"  all                           KL {m['kl_all']:.4f} nats   top-1 {100 * m['top1_all']:5.1f}%"]
    return "\n".join(lines)


def _jsonable(m: dict) -> dict:
    out = {k: v for k, v in m.items() if k not in ("config", "recipe", "stats", "kv")}
    out["stats"] = {**vars(m["stats"]), "prefill_tokens_per_s": m["stats"].prefill_tokens_per_s,
                    "decode_tokens_per_s": m["stats"].decode_tokens_per_s}
    out["recipe"] = m["recipe"].to_dict()
    out["kv_bytes_per_token"] = {k: {"format": f.kind, "bytes": b} for k, (f, b) in m["kv"].items()}
    out["aborted"] = {str(k): v for k, v in m["aborted"].items()}
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    m = run(args)
    print(report(m))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_jsonable(m), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
