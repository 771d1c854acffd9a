"""Multi-process scenarios for the parallelism tests, run by every rank of one process group.

``launch(world, scenarios, ...)`` starts ``world`` processes (gloo on the CPU, forked so torch is not
imported again; with ``MLA_QUANT_DIST_BACKEND=nccl`` spawned NCCL processes on ``cuda:rank``). Every rank
runs the same scenarios in the same order and writes its results to ``rank<r>.json``; the tests assert on
them. Each model is built once per rank from seed 0 on the CPU (identical on every rank and to the
checkpoints the tests save), its single-device logits are the reference, and each parallel mode runs on
a deep copy.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import re
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from mla_quant import parallel
from mla_quant.cache import NoopTagTracker, PageAllocator
from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.formats.plan import QuantPlan, quantize_
from mla_quant.models import Glm52Config, KimiK26Config
from mla_quant.models.glm import Glm52ForCausalLM
from mla_quant.models.kimi import KimiK26ForCausalLM
from mla_quant.models.random_init import init_random_weights_
from mla_quant.testing import rel_err

BACKEND_ENV = "MLA_QUANT_DIST_BACKEND"
MODES = ("tp", "ep", "tp_ep")
KINDS = ("kimi", "glm")
PAGE_SIZE = 16
PROMPT_LENS = (5, 11)     # two requests; GLM's tiny index_topk is 8, so the indexer selects in both paths
DECODE_STEPS = 2


def backend() -> str:
    return os.environ.get(BACKEND_ENV, "gloo")


# ------------------------------------------------------------------------------------------ models
def config(kind: str):
    """The tiny configs with 8 heads, rope 64 and expert width 512: every per-rank shard at 2 and 4 ranks is
    a multiple of the 128-wide FP8 blocks (q_b_proj 128 rows a head, kv_b_proj 128, o_proj 64 columns a
    head, MLP widths 512) and of the INT4 group (32)."""
    dims = dict(num_attention_heads=8, num_key_value_heads=8, qk_rope_head_dim=64, moe_intermediate_size=512)
    return (KimiK26Config.tiny() if kind == "kimi" else Glm52Config.tiny()).replace(**dims)


def kimi_formats():
    """INT4 routed experts (as released) and FP8 blocks (weight-only) for every other linear layer, LM head
    included."""
    fp8 = FP8Block(act_quant=False)
    return lambda name: Int4Group(32) if ".mlp.experts." in name else fp8


def build(kind: str, cfg=None, formats=None):
    """Kimi: INT4 experts + FP8 elsewhere; GLM: the FP8 checkpoint's formats. fp32 compute (exact mode), on
    the CPU (the random weights depend on the device's generator)."""
    cfg = cfg or config(kind)
    if kind == "kimi":
        model = KimiK26ForCausalLM(cfg, dtype=torch.float32, formats=formats or kimi_formats())
    else:
        model = Glm52ForCausalLM(cfg, dtype=torch.float32, formats=formats or "checkpoint")
    return init_random_weights_(model, seed=0).eval()


def build_meta(kind: str, cfg=None, formats=None):
    cfg = cfg or config(kind)
    cls = KimiK26ForCausalLM if kind == "kimi" else Glm52ForCausalLM
    with torch.device("meta"):
        return cls(cfg, dtype=torch.float32, formats=formats or (kimi_formats() if kind == "kimi" else "checkpoint"))


def inputs(cfg, device) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(plain ids [2, 12], prompts of PROMPT_LENS, decode tokens [DECODE_STEPS, 2]), the same on every rank."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in PROMPT_LENS]
    decode = torch.randint(0, cfg.vocab_size, (DECODE_STEPS, len(PROMPT_LENS)), generator=g)
    return ids.to(device), [p.to(device) for p in prompts], decode.to(device)


@torch.no_grad()
def run_paged(model, prompts: list[torch.Tensor], decode: torch.Tensor) -> torch.Tensor:
    """Prefill every prompt in one step, then DECODE_STEPS steps of the given tokens, through a paged cache
    (allocated on this rank: the latent rows are replicated under TP). Returns all logits [T_total, vocab]."""
    cache = model.allocate_cache(num_pages=8, page_size=PAGE_SIZE)
    alloc = PageAllocator(cache=cache.kv, tracker=NoopTagTracker())
    requests = list(range(len(prompts)))
    for r in requests:
        alloc.add_request(r)
    out = [model(torch.cat(prompts), batch=alloc.plan(requests, [len(p) for p in prompts]), cache=cache)]
    for step in decode:
        out.append(model(step, batch=alloc.plan(requests, 1), cache=cache))
    return torch.cat(out)


# ------------------------------------------------------------------------------------------ bytes
def _sharded_names(mode: str) -> re.Pattern:
    """Parameter / buffer names (of the unsharded model) that ``mode`` splits over the ranks — written
    independently of the transforms' own records."""
    tp = (r"self_attn\.(q_b_proj|q_proj|kv_b_proj|o_proj)\.(weight|weight_scale_inv|weight_packed|weight_scale)$",
          r"mlp\.(gate|up|down)_proj\.", r"mlp\.shared_experts\.", r"embed_tokens\.weight$",
          r"^lm_head\.(weight|weight_scale_inv|weight_packed|weight_scale)$")
    pats = (r"mlp\.experts\.",) + (tp if mode != "ep" else ())
    return re.compile("|".join(f"(?:{p})" for p in pats))


def _tensors(model):
    yield from model.named_parameters()
    yield from model.named_buffers()


def bytes_check(base, sharded, mode: str, world: int) -> dict:
    pattern = _sharded_names(mode)
    split = sum(t.numel() * t.element_size() for n, t in _tensors(base)
                if pattern.search(n) and not n.endswith("weight_shape"))
    whole = sum(t.numel() * t.element_size() for _, t in _tensors(base)) - split
    held = sum(t.numel() * t.element_size() for _, t in _tensors(sharded))
    report = parallel.sharded_bytes(sharded)
    return {"split_full": split, "replicated_full": whole, "held": held, "expected": whole + split // world,
            "recorded_sharded": report["sharded"], "storage": report["storage"]}


# ------------------------------------------------------------------------------------------ scenarios
def _shard(model, mode: str):
    if "ep" in mode:
        parallel.apply_ep(model)
    if "tp" in mode:
        parallel.apply_tp(model)
    return model


def base_model(kind: str, device, built: dict):
    """This rank's single-device model of ``kind`` on ``device`` (built once per process, then reused)."""
    if (kind, str(device)) not in built:
        built[kind, str(device)] = build(kind).to(device)
    return built[kind, str(device)]


def scenario_modes(kind: str, world: int, device, built: dict, modes=MODES) -> dict:
    base = base_model(kind, device, built)
    ids, prompts, decode = inputs(base.config, device)
    with torch.no_grad():
        ref = base(ids)
    ref_paged = run_paged(base, prompts, decode)
    out = {}
    for mode in modes:
        model = _shard(copy.deepcopy(base), mode)
        with torch.no_grad():
            y = model(ids)
        paged = run_paged(model, prompts, decode)
        out[mode] = {"plain": rel_err(y, ref), "paged": rel_err(paged, ref_paged),
                     "shape": list(y.shape), "bytes": bytes_check(base, model, mode, world)}
    return out


def scenario_ep_local(kind: str, world: int, rank: int, device, built: dict) -> dict:
    """Data-parallel attention + EP: each rank runs its own batch rows (tokens="local")."""
    base = base_model(kind, device, built)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, base.config.vocab_size, (world, 7), generator=g).to(device)
    with torch.no_grad():
        ref = base(ids)
        model = parallel.apply_ep(copy.deepcopy(base), tokens="local")
        y = model(ids[rank:rank + 1])
    return {"plain": rel_err(y, ref[rank:rank + 1])}


def scenario_tp_dp_ep(kind: str, world: int, rank: int, device, built: dict) -> dict:
    """A 2-D layout on 4 ranks: TP over pairs {0,1} {2,3} (each pair runs one batch row), EP over all 4 with
    each pair's tokens (tokens="local")."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    base = base_model(kind, device, built)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, base.config.vocab_size, (2, 9), generator=g).to(device)
    row = rank // 2
    with torch.no_grad():
        ref = base(ids)
        model = parallel.apply_ep(copy.deepcopy(base), tokens="local")
        parallel.apply_tp(model, pairs[row])
        y = model(ids[row:row + 1])
    return {"plain": rel_err(y, ref[row:row + 1])}


def scenario_load(kind: str, ckpt: str, mode: str, device, built: dict) -> dict:
    """``load_sharded`` equals the in-memory transforms bit for bit, and reads only the kept bytes."""
    base = base_model(kind, device, built)
    expected = _shard(copy.deepcopy(base), mode)
    stats: dict = {}
    loaded = parallel.load_sharded(ckpt, tp="tp" in mode, ep="ep" in mode, dtype=torch.float32, device=device,
                                   stats=stats)
    want, got = expected.state_dict(), loaded.state_dict()
    differ = sorted(k for k in want if k not in got or got[k].dtype != want[k].dtype
                    or got[k].shape != want[k].shape or not torch.equal(got[k], want[k]))
    ids, _, _ = inputs(base.config, device)
    with torch.no_grad():
        ref = base(ids)
        y = loaded(ids)
    held = sum(t.numel() * t.element_size() for t in got.values())
    return {"keys_differ": differ[:5], "extra_keys": sorted(set(got) - set(want))[:5],
            "bytes_read": stats["bytes_read"], "state_bytes": held, "plain": rel_err(y, ref)}


def scenario_quantize(kind: str, device) -> dict:
    """``quantize_`` commutes with the transforms when the splits respect the target formats' blocks and
    groups: quantize-then-shard and shard-then-quantize hold the same bits."""
    base = build(kind, formats=lambda name: BF16()).to(device)
    plan = QuantPlan({r"re:.*mlp\.experts.*": Int4Group(32), "_default": FP8Block(act_quant=False)})
    out = {}
    for mode in ("tp", "tp_ep"):
        now = _shard(quantize_(copy.deepcopy(base), plan), mode)
        then = quantize_(_shard(copy.deepcopy(base), mode), plan)
        first, second = now.state_dict(), then.state_dict()
        out[mode] = {"keys_differ": sorted(k for k in first if k not in second or first[k].dtype != second[k].dtype
                                           or not torch.equal(first[k], second[k]))[:5],
                     "same_keys": set(first) == set(second),
                     "sharded_bytes": [parallel.sharded_bytes(m)["sharded"] for m in (now, then)]}
    return out


def _error_of(fn) -> dict:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests check the type and message
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


def scenario_errors() -> dict:
    """Splits that must be refused, on models built on ``meta`` (no collective runs)."""
    fp8 = FP8Block(act_quant=False)
    out = {
        "heads": _error_of(lambda: parallel.apply_tp(build_meta("kimi", KimiK26Config.tiny().replace(
            num_attention_heads=3, num_key_value_heads=3)))),
        "fp8_block": _error_of(lambda: parallel.apply_tp(build_meta("kimi", KimiK26Config.tiny(),
                                                                    formats=lambda n: fp8))),
        "int4_group": _error_of(lambda: parallel.apply_tp(build_meta("kimi", config("kimi").replace(
            intermediate_size=96), formats=lambda n: Int4Group(32) if "mlp" in n else fp8))),
        "vocab": _error_of(lambda: parallel.apply_tp(build_meta("kimi", config("kimi").replace(vocab_size=511)))),
        "experts": _error_of(lambda: parallel.apply_ep(build_meta("glm", config("glm").replace(
            n_routed_experts=15)))),
        "tokens": _error_of(lambda: parallel.apply_ep(build_meta("glm"), tokens="everywhere")),
    }
    twice = build_meta("kimi")
    parallel.apply_tp(twice)
    out["tp_twice"] = _error_of(lambda: parallel.apply_tp(twice))
    tp_then_ep = parallel.apply_tp(build_meta("kimi"))
    out["ep_after_tp"] = _error_of(lambda: parallel.apply_ep(tp_then_ep))
    # a refused split leaves the model untouched (every split is checked before any weight changes)
    model = build_meta("kimi", KimiK26Config.tiny(), formats=lambda n: fp8)
    before = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    _error_of(lambda: parallel.apply_tp(model))
    after = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    out["untouched"] = {"same_shapes": before == after,
                        "records": sum(len(parallel.shards_of(m)) for m in model.modules()),
                        "heads": [m.num_heads for m in model.modules() if hasattr(m, "num_heads")]}
    return out


def run_scenario(name: str, world: int, rank: int, device, ckpts: dict[str, str], built: dict) -> dict:
    kind, _, rest = name.partition(":")
    if rest == "modes":
        return scenario_modes(kind, world, device, built)
    if rest == "ep_local":
        return scenario_ep_local(kind, world, rank, device, built)
    if rest == "tp_dp_ep":
        return scenario_tp_dp_ep(kind, world, rank, device, built)
    if rest.startswith("load_"):
        return scenario_load(kind, ckpts[kind], rest[len("load_"):], device, built)
    if rest == "quantize":
        return scenario_quantize(kind, device)
    if name == "errors":
        return scenario_errors()
    raise ValueError(f"unknown scenario {name!r}")


# ------------------------------------------------------------------------------------------ processes
def _worker(rank: int, world: int, backend_name: str, store: str, out_dir: str, scenarios: list[str],
            ckpts: dict[str, str]) -> None:
    torch.set_num_threads(1)
    if backend_name == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend_name, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results, built = {}, {}
    try:
        for name in scenarios:
            start = time.perf_counter()
            try:
                results[name] = run_scenario(name, world, rank, device, ckpts, built)
                results[name]["seconds"] = round(time.perf_counter() - start, 2)
            except Exception:  # noqa: BLE001 - reported per scenario; the test names it
                results[name] = {"exception": traceback.format_exc()}
            Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def launch(world: int, scenarios: list[str], tmp_dir: Path, ckpts: dict[str, str] | None = None) -> list[dict]:
    """Run ``scenarios`` on ``world`` processes; returns each rank's results."""
    import torch.multiprocessing as mp

    name = backend()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    store = tmp_dir / "store"
    method = "spawn" if name == "nccl" else "fork"
    mp.start_processes(_worker, args=(world, name, str(store), str(tmp_dir), scenarios, ckpts or {}),
                       nprocs=world, start_method=method, join=True)
    return [json.loads((tmp_dir / f"rank{r}.json").read_text()) for r in range(world)]
