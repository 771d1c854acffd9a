"""bench ``parallel_decode``: decode-step time of a real-width Kimi K2.6 slice sharded over the GPUs of one
host (TP, EP, TP+EP over NCCL), against ONE GPU running a model of the same per-GPU shapes (the cost of the
collectives) and against the unsharded slice on one GPU. Launched with torchrun (``benchmarks/multi_gpu.sh``)::

    torchrun --nproc_per_node 2 -m benchmarks.bench_parallel --out $OUT/h200x2.json

The slice: the real dimensions with ``--layers`` layers (layer 0 dense, the others MoE with all 384 routed
experts in INT4 g32, the shared expert and attention in BF16 — the release's formats), the embedding and the
LM head (vocabulary 163840), random weights, a BF16 (or ``--kv``) paged cache holding ``--ctx`` tokens for
each of ``concurrency`` requests; one step decodes one token per request.

Cases (DESIGN.md schema): ``case = {mode, world, concurrency, ctx, layers, kv, experts}``; ``median_us`` the
step time (slowest rank); ``peer = "1gpu_same_shapes"``: one GPU running the per-GPU shapes of the mode
(heads / W, MLP widths / W, vocabulary / W for TP; E / W experts with top-k / W for EP) with no collective;
``full_1gpu_us``: the unsharded slice on one GPU; ``collective_bytes``: the payload this rank hands to
collectives in one step (counted by wrapping ``torch.distributed``); ``bytes``: the least a GPU must read in
a step (its weights, routed experts expected to be touched under uniform routing, the KV it attends over).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mla_quant import parallel
from mla_quant.cache import NoopTagTracker, PageAllocator
from mla_quant.models import KimiK26Config
from mla_quant.models.kimi import KimiK26ForCausalLM
from mla_quant.models.random_init import init_random_weights_
from mla_quant.modules.experts import StackedExperts

from .common import Context, case, measure_ceilings, meta

PAGE_SIZE = 64
MODES = ("tp", "ep", "tp_ep")


def run(ctx: Context) -> list[dict]:
    """Single-process entry (``python -m benchmarks``): this bench needs several GPUs under torchrun."""
    ctx.notes.append("parallel_decode: multi-GPU only; run `bash benchmarks/multi_gpu.sh` on a multi-GPU host")
    return []


# ------------------------------------------------------------------------------------------ models
def slice_config(layers: int, smoke: bool = False) -> KimiK26Config:
    return (KimiK26Config.tiny() if smoke else KimiK26Config.full()).replace(num_hidden_layers=layers)


def per_gpu_config(config: KimiK26Config, mode: str, world: int) -> KimiK26Config:
    """One GPU's shapes under ``mode``. TP+EP keeps the shared expert at full width (its width is
    ``moe_intermediate_size × n_shared_experts``, tied to the experts' width): a slight overestimate."""
    c = config
    changes = {}
    if "tp" in mode:
        heads = c.num_attention_heads // world
        changes.update(num_attention_heads=heads, num_key_value_heads=heads,
                       intermediate_size=c.intermediate_size // world, vocab_size=c.vocab_size // world)
        if "ep" not in mode:
            changes["moe_intermediate_size"] = c.moe_intermediate_size // world
    if "ep" in mode:
        changes.update(n_routed_experts=c.n_routed_experts // world,
                       num_experts_per_tok=max(1, c.num_experts_per_tok // world))
    return c.replace(**changes)


def build(config: KimiK26Config, device: torch.device) -> KimiK26ForCausalLM:
    """The slice in the release's formats with random weights, built on ``device`` (same on every rank)."""
    model = KimiK26ForCausalLM(config, dtype=torch.bfloat16, formats="checkpoint", device=device)
    return init_random_weights_(model, seed=0).eval()


def shard(model, mode: str):
    if "ep" in mode:
        parallel.apply_ep(model)
    if "tp" in mode:
        parallel.apply_tp(model)
    return model


# ------------------------------------------------------------------------------------------ a decode step
def decode_step(model, concurrency: int, ctx_len: int, kv: str, device: torch.device):
    """A function running one decode step of ``concurrency`` requests holding ``ctx_len`` tokens each (random
    KV rows), and the step's KV bytes read."""
    c = model.config
    pages = concurrency * (-(-(ctx_len + 1) // PAGE_SIZE))
    cache = model.allocate_cache(num_pages=pages, page_size=PAGE_SIZE, kv_format=kv, device=device)
    alloc = PageAllocator(cache=cache.kv, tracker=NoopTagTracker())
    g = torch.Generator().manual_seed(0)
    for r in range(concurrency):
        alloc.add_request(r, ctx_len)
    slots = torch.cat([alloc.slots(r) for r in range(concurrency)]).to(device)
    for layer in range(c.num_hidden_layers):
        rows = torch.randn(slots.numel(), c.kv_lora_rank + c.qk_rope_head_dim, generator=g)
        cache.kv.append(layer, rows.to(device=device, dtype=torch.bfloat16), slots)
    batch = alloc.plan(list(range(concurrency)), 1)
    ids = torch.randint(0, c.vocab_size, (concurrency,), generator=g).to(device)   # the same on every rank
    kv_bytes = concurrency * (ctx_len + 1) * cache.kv.bytes_per_token()

    def step():
        with torch.no_grad():
            return model(ids, batch=batch, cache=cache)

    return step, kv_bytes


def time_us(fn, iters: int, warmup: int, group_sync: bool, device: torch.device) -> float:
    """Median step time in µs (CUDA events; the host clock on the CPU); with ``group_sync`` the slowest
    rank's median. Every rank runs the same number of steps (a step may hold collectives)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    if group_sync:
        dist.barrier()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in times]
    med = 1e3 * statistics.median(times)
    if group_sync:
        t = torch.tensor([med], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med = float(t)
    return med


@contextlib.contextmanager
def counting_collectives(counter: dict):
    """Count the bytes this rank hands to all_reduce / all_gather / all_to_all_single (payload, not wire)."""
    names = ("all_reduce", "all_gather", "all_to_all_single")
    saved = {n: getattr(dist, n) for n in names}

    def wrap(name):
        def call(*args, **kwargs):
            t = args[1] if name == "all_gather" else args[0] if name == "all_reduce" else args[1]
            counter[name] = counter.get(name, 0) + t.numel() * t.element_size()
            return saved[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield counter
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def weight_bytes_read(model, concurrency: int) -> int:
    """Least weight bytes one step reads on this GPU: every weight except the embedding (only the looked-up
    rows) and the routed experts (those expected to receive a token under uniform routing)."""
    total = 0
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        nbytes = sum(t.numel() * t.element_size() for _, t in own)
        if isinstance(module, StackedExperts):
            experts_global = getattr(module, "num_global_experts", module.num_experts)
            k = model.config.num_experts_per_tok
            touched = 1 - (1 - 1 / experts_global) ** (concurrency * k)
            total += int(nbytes * touched)
        elif isinstance(module, torch.nn.Embedding):
            total += concurrency * module.embedding_dim * module.weight.element_size()
        else:
            total += nbytes
    return total


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_parallel", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU over gloo (checks the script)")
    args = ap.parse_args(argv)

    dist.init_process_group("gloo" if args.smoke else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    ctx = Context(device=str(device))
    if not args.smoke:
        measure_ceilings(ctx)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    config = slice_config(args.layers, args.smoke)
    t0 = time.time()
    full = build(config, device)
    say(f"built the {args.layers}-layer slice in {time.time() - t0:.0f} s "
        f"({sum(p.numel() * p.element_size() for p in full.parameters()) / 1e9:.1f} GB per GPU unsharded)")
    single = {}
    for b in concurrencies:   # every rank times the unsharded slice on its own GPU, no collective
        step, _ = decode_step(full, b, args.ctx, args.kv, device)
        single[b] = time_us(step, args.iters, args.warmup, False, device)
        say(f"  1 GPU unsharded, concurrency {b}: {single[b]:.0f} us")
    cases = []
    for mode in args.modes.split(","):
        model = shard(copy.deepcopy(full), mode)
        torch.cuda.empty_cache()
        peer_model = build(per_gpu_config(config, mode, world), device)
        for b in concurrencies:
            step, kv_bytes = decode_step(model, b, args.ctx, args.kv, device)
            t = time_us(step, args.iters, args.warmup, True, device)
            counted: dict = {}
            with counting_collectives(counted):
                step()
            peer_step, _ = decode_step(peer_model, b, args.ctx, args.kv, device)
            t_peer = time_us(peer_step, args.iters, args.warmup, False, device)
            t_peer_max = torch.tensor([t_peer], device=device)
            dist.all_reduce(t_peer_max, op=dist.ReduceOp.MAX)
            row = case("parallel_decode", {"mode": mode, "world": world, "concurrency": b, "ctx": args.ctx,
                                           "layers": args.layers, "kv": args.kv, "experts": "int4_g32"},
                       t, bytes=weight_bytes_read(model, b) + kv_bytes, peer="1gpu_same_shapes",
                       peer_median_us=float(t_peer_max), full_1gpu_us=round(single[b], 3),
                       speedup_vs_1gpu_full=round(single[b] / t, 3), collective_bytes=counted)
            cases.append(row)
            say(f"  {mode} x{world}, concurrency {b}: {t:.0f} us (1 GPU same shapes {float(t_peer_max):.0f} us, "
                f"unsharded {single[b]:.0f} us), collectives {counted}")
        del model, peer_model
        torch.cuda.empty_cache()
        if rank == 0:  # written after every mode, so a run stopped at its time limit keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            m = meta(ctx)
            m["device"] = f"{world}x {m['device']}"
            args.out.write_text(json.dumps({"meta": m, "cases": cases}, indent=1) + "\n")
    say(f"wrote {len(cases)} cases to {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
