"""The two pools of the asymmetric recipe as two processes (torch.distributed, gloo on the CPU): rank 0 is
the prefill pool (FP8 weights, BF16 KV), rank 1 the decode pool (INT4 weights, FP8 KV). Rank 0 prefills,
converts each request's pages to the decode pool's KV format on its side (``handoff_kv`` into a small
staging cache: half the bytes on the wire), and sends them; rank 1 writes them into its own pages and
decodes. The result must equal the one-process run of ``06_asymmetric_recipe.py`` bit for bit.

    python examples/06b_two_pools_distributed.py
"""
import importlib.util
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mla_quant.formats.plan import build_pools, handoff_kv

spec = importlib.util.spec_from_file_location("recipe06", Path(__file__).with_name("06_asymmetric_recipe.py"))
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)  # the tiny decoder, RECIPE, new_pool and serve of example 06

LENGTHS = (37, 20, 5)
STEPS = 4


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, ex.HIDDEN, generator=g) for n in LENGTHS]


def send_pages(cache, pages, dst):
    """Every layer's rows (and per-token scales) of ``pages``, as raw bytes (exact whatever the dtype)."""
    idx = torch.as_tensor(pages)
    for layer in cache.layers:
        dist.send(layer.data[idx].contiguous().view(torch.uint8), dst)
        if layer.scale_mode == "token":
            dist.send(layer.scales[idx].contiguous(), dst)


def recv_pages(cache, pages, src):
    idx = torch.as_tensor(pages)
    for layer in cache.layers:
        buf = torch.empty_like(layer.data[idx]).view(torch.uint8)
        dist.recv(buf, src)
        layer.data[idx] = buf.view(layer.data.dtype)
        if layer.scale_mode == "token":
            s = torch.empty_like(layer.scales[idx])
            dist.recv(s, src)
            layer.scales[idx] = s


def prefill_pool(kv):
    model, _ = build_pools(ex.build_model(), ex.RECIPE)  # this rank keeps only the prefill instance
    cache, alloc = ex.new_pool(kv["prefill"])
    staging, staging_alloc = ex.new_pool(kv["decode"])   # the decode pool's format, for the wire
    rids = list(range(len(LENGTHS)))
    with torch.no_grad():
        for r in rids:
            alloc.add_request(r)
        batch = alloc.plan(rids, list(LENGTHS))
        h = model.step(torch.cat(prompts()), batch, cache)
        dist.send(h[batch.cu_seqlens_q[1:].long() - 1].contiguous(), 1)  # each prompt's last hidden state
        for r in rids:
            staging_alloc.add_request(r, LENGTHS[r])
            handoff_kv(cache, staging, alloc.pages(r), staging_alloc.pages(r))   # BF16 -> FP8 here
            send_pages(staging, staging_alloc.pages(r), dst=1)
            alloc.free(r)
            staging_alloc.free(r)
    print(f"[rank 0] prefilled {len(rids)} requests ({sum(LENGTHS)} tokens), sent their pages in "
          f"{kv['decode'][0].kind}")


def decode_pool(kv):
    _, model = build_pools(ex.build_model(), ex.RECIPE)
    cache, alloc = ex.new_pool(kv["decode"])
    rids = list(range(len(LENGTHS)))
    last = torch.empty(len(rids), ex.HIDDEN)
    dist.recv(last, 0)
    with torch.no_grad():
        for r in rids:
            alloc.add_request(r, LENGTHS[r])
            recv_pages(cache, alloc.pages(r), src=0)
        outs = []
        for _ in range(STEPS):
            x = last / last.norm(dim=-1, keepdim=True) * ex.HIDDEN ** 0.5
            last = model.step(x, alloc.plan(rids, 1), cache)
            outs.append(last)
    got = torch.stack(outs)
    prefill_model, decode_model = build_pools(ex.build_model(), ex.RECIPE)
    expected, _, _ = ex.serve(prefill_model.step, decode_model.step, kv, prompts(), STEPS)
    assert torch.equal(got, expected), "two processes must match the one-process pools bit for bit"
    print(f"[rank 1] decoded {STEPS} tokens for {len(rids)} requests: equal to the one-process run, bit for bit")


def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    kv = {ph: ex.RECIPE.phase(ph).kv_formats(ex.build_model()) for ph in ("prefill", "decode")}
    try:
        (prefill_pool if rank == 0 else decode_pool)(kv)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    os.environ.setdefault("MLA_QUANT_BACKEND", "torch")
    mp.spawn(worker, args=(free_port(),), nprocs=2, join=True)
