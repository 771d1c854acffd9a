"""Compile every Triton kernel of the library for Hopper (sm_90) on a machine without a GPU.

    python -m benchmarks.compile_check [op ...] [-k TEXT]    # the installed Triton; no op = every op; -k: cases
    PYTHONPATH=. /path/to/venv-triton-3.6/bin/python -m benchmarks.compile_check   # the H200's Triton

How: a fake Triton driver reports an sm_90 CUDA target; ``JITFunction.run`` compiles without launching;
``Autotuner.run`` compiles every config that survives the kernel's own ``early_config_prune``; the library's
dispatch (``_backend.use_triton`` / ``triton_interpreted``, ``num_sms`` and ``torch.cuda.get_device_properties``,
132 SMs, ``_pdl.pdl_launch``) takes the GPU path for CPU tensors. Each op's public launcher is then called on CPU
tensors of representative shapes (``OPS`` below), so the launch code picks its kernels, constexprs and configs as
on the H200, and nothing runs.

Reported per op: the kernels compiled, the largest shared memory one of them needs, registers and spills
(from ``ptxas -v`` on the kernel's PTX). An op FAILS on a compile error or a kernel that needs more shared
memory than a Hopper block may use (``HOPPER_SMEM_LIMIT``: it would raise OutOfResources at launch); the
exit status is 1 then. It cannot tell whether a kernel computes the right thing, nor how fast it is.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator

import torch

HOPPER_SMEM_LIMIT = 232448  # bytes of shared memory per block on the H100/H200 (227 KiB, opt-in maximum)
HOPPER_SMS = 132
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
KV_FORMATS = (("bf16", "token"), ("fp8_e4m3", "token"), ("fp8_e4m3", "tensor"), ("fp8_ds_mla", "token"))
D_LATENT, D_ROPE, PAGE = 512, 64, 64  # DeepSeek/Kimi MLA rows (576 wide) in pages of 64 tokens

Case = tuple[str, Callable[[], object]]  # (label, a call of a public launcher)


# ------------------------------------------------------------------------------------------- records
@dataclass
class Compiled:
    """One compiled kernel: its name, the constexprs and launch options it was compiled with, its needs."""
    kernel: str
    config: dict
    shared: int
    hash: str = ""
    regs: int | None = None
    spills: int | None = None


@dataclass
class CompileLog:
    """What the patched Triton compiled (``kernels``: one entry per launch, cached binaries included) and which
    compiles raised (``errors``)."""
    kernels: list[Compiled] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    ptxas: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)  # kernel hash -> stats


def smem_error(k: Compiled, limit: int = HOPPER_SMEM_LIMIT) -> str | None:
    """The failure message when the kernel needs more shared memory than a block may use, else None."""
    if k.shared <= limit:
        return None
    return f"{k.kernel} {k.config}: shared memory {k.shared} B > {limit} B (OutOfResources at launch)"


def parse_ptxas_log(log: str) -> tuple[int | None, int | None]:
    """(registers, spill store + load bytes) from ``ptxas -v`` output; None where the log has no such line."""
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    return (max(regs) if regs else None), (max(spills) if spills else None)


def ptxas_log(ptx: str) -> str | None:
    """``ptxas -v`` output of the ptxas that Triton uses for sm_90 on one kernel's PTX (the compiler deletes its own
    log); None where ptxas fails."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", f"--gpu-name={sm_arch_from_capability(90)}",
                               src, "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    return done.stderr if done.returncode == 0 else None


def ptxas_stats(ptx: str) -> tuple[int | None, int | None]:
    """(registers, spill bytes) of one kernel's PTX by :func:`ptxas_log`."""
    log = ptxas_log(ptx)
    return parse_ptxas_log(log) if log is not None else (None, None)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tail(message: str, lines: int = 25) -> str:
    return "\n".join(message.strip().splitlines()[-lines:])


# ------------------------------------------------------------------------------ the fake Hopper GPU
def install_fake_hopper(log: CompileLog, ptxas: bool = True) -> None:
    """Patch Triton, torch.cuda and the library's dispatch so that launchers compile for sm_90 and return."""
    os.environ.pop("TRITON_INTERPRET", None)  # before any @triton.jit runs: compile, do not interpret
    from triton.backends.compiler import GPUTarget
    from triton.runtime import autotuner, driver, jit

    class FakeHopperDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(FakeHopperDriver())
    compile_only = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        config = {k: v for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages")}
        try:
            kernel = compile_only(self, *args, grid=grid, warmup=True, **kwargs)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel  # async compile mode
        except Exception as e:  # noqa: BLE001 - every compiler error is a finding; keep compiling the rest
            log.errors.append(f"{self.__name__} {config}: {type(e).__name__}: {_tail(str(e))}")
            return None
        key = kernel.metadata.hash
        if key not in log.ptxas:
            log.ptxas[key] = ptxas_stats(kernel.asm["ptx"]) if ptxas else (None, None)
        log.kernels.append(Compiled(self.__name__, config, kernel.metadata.shared, key, *log.ptxas[key]))
        return kernel

    def autotune_all(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs)
        self.nargs = None
        for config in configs:
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    jit.JITFunction.run = run
    autotuner.Autotuner.run = autotune_all
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=HOPPER_SMS, name="fake Hopper")

    import mla_quant.kernels as kernels_pkg
    from mla_quant.kernels import _pdl   # every op compiled with PDL, those in _pdl.SKIP too
    for op in kernels_pkg_ops():  # launchers and kernel modules, so that every imported name gets patched
        importlib.import_module(f"mla_quant.kernels.{op}")
        if importlib.util.find_spec(f"mla_quant.kernels.{op}.kernel"):
            importlib.import_module(f"mla_quant.kernels.{op}.kernel")
    patches = {"use_triton": lambda *tensors: True, "triton_interpreted": lambda: False,
               "num_sms": lambda device=None: HOPPER_SMS, "_is_hopper": lambda device=None: True,
               "is_hopper": lambda device=None: True,
               "pdl_launch": lambda device=None, op=None: {"PDL": 2 if _pdl.EARLY else 1, "launch_pdl": True}}
    for name, module in list(sys.modules.items()):
        if name == kernels_pkg.__name__ or name.startswith(kernels_pkg.__name__ + "."):
            for attr, fake in patches.items():
                if callable(getattr(module, attr, None)):
                    setattr(module, attr, fake)


def kernels_pkg_ops() -> list[str]:
    """The op folders of mla_quant/kernels (each a package with a launcher)."""
    import mla_quant.kernels as kernels_pkg
    root = os.path.dirname(kernels_pkg.__file__)
    return sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "__init__.py")))


# ------------------------------------------------------------------------------------ input builders
def _kv_pages(kind: str, scale: str, num_pages: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zeroed MLA pages [num_pages, PAGE, width] of one KV format (values do not matter: nothing runs)."""
    from mla_quant.kernels.kv_layout import kv_data_dtype, kv_row_width
    data = torch.zeros(num_pages, PAGE, kv_row_width(kind, D_LATENT, D_ROPE), dtype=kv_data_dtype(kind))
    if kind != "fp8_e4m3":
        return data, None
    return data, (torch.ones(num_pages, PAGE) if scale == "token" else torch.ones(1))


def _table(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A block table giving each request its own pages, and the int32 lengths."""
    per = -(-max(lengths) // PAGE)
    return torch.arange(len(lengths) * per, dtype=torch.int32).view(len(lengths), per), torch.tensor(
        lengths, dtype=torch.int32)


def cases_fp8_quant() -> Iterator[Case]:
    from mla_quant.kernels import fp8_quant as F
    for dt in (BF16, torch.float32):
        x = torch.randn(64, 1024, dtype=dt)
        for ue8m0 in (False, True):
            yield f"act_quant x={_dt(dt)} ue8m0={ue8m0}", partial(F.act_quant_fp8, x, 128, ue8m0)
        yield f"block_quant w={_dt(dt)}", partial(F.block_quant_fp8, x[:, :640])
        yield f"block_dequant out={_dt(dt)}", partial(F.block_dequant_fp8, torch.zeros(64, 640, dtype=FP8),
                                                 torch.ones(1, 5), (128, 128), dt)
    rows = torch.randn(100, D_LATENT + D_ROPE, dtype=BF16)
    yield "kv_quant per-token", partial(F.kv_quant_fp8, rows)
    yield "kv_quant per-tensor", partial(F.kv_quant_fp8, rows, torch.ones(1))


def cases_int4_quant() -> Iterator[Case]:
    from mla_quant.kernels import int4_quant as I
    for group in (32, 128):
        yield f"quantize group={group}", partial(I.int4_quantize, torch.randn(256, 1024, dtype=BF16), group)
        yield f"dequantize group={group}", partial(I.int4_dequantize, torch.zeros(256, 128, dtype=torch.int32),
                                                   torch.ones(256, 1024 // group, dtype=BF16), group)


def cases_kv_append() -> Iterator[Case]:
    from mla_quant.kernels.kv_append import kv_append
    for kind, scale in KV_FORMATS:
        data, scales = _kv_pages(kind, scale, 4)
        rows = torch.randn(10, D_LATENT + D_ROPE, dtype=BF16)
        yield f"kind={kind} scale={scale}", partial(kv_append, rows, torch.arange(10, dtype=torch.int32), data,
                                                    scales, kind, scale, D_LATENT)


def cases_page_tag_verify() -> Iterator[Case]:
    from mla_quant.kernels.page_tag_verify import page_tag_verify
    table, lens = _table([100, 200, 30])
    tags = torch.zeros(table.numel(), dtype=torch.int64)
    recorded = torch.zeros(table.shape, dtype=torch.int64)
    cu, slots = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([99, 263, 413], dtype=torch.int64)
    yield "tags", partial(page_tag_verify, table, lens, recorded, tags, PAGE)
    yield "tags+slots", partial(page_tag_verify, table, lens, recorded, tags, PAGE, cu, slots)
    yield "tags+slots+holders", partial(page_tag_verify, table, lens, recorded, tags, PAGE, cu, slots,
                                        torch.ones_like(tags))


def cases_mla_decode() -> Iterator[Case]:
    from mla_quant.kernels.mla_decode import mla_decode
    table, lens = _table([100, 200])
    for (kind, scale), heads in ((f, h) for f in KV_FORMATS for h in (16, 128)):
        data, scales = _kv_pages(kind, scale, table.numel())
        q = torch.randn(2, 1, heads, D_LATENT + D_ROPE, dtype=BF16)
        dequants = ("auto", "convert", "bitcast", "fp16") + (("fp8mma", "fp8mma_pv") if kind == "fp8_e4m3" else ())
        dequants += ("gluon",) if kind == "fp8_e4m3" and heads == 16 else ()  # (the Gluon kernel: ≤ 16 query rows)
        for fp8_dequant in dequants if kind != "bf16" else ("auto",):
            yield (f"kind={kind} scale={scale} heads={heads} fp8_dequant={fp8_dequant}",
                   partial(mla_decode, q, data, scales, table, lens, 0.1, kind, D_LATENT, fp8_dequant=fp8_dequant))


def cases_mla_prefill() -> Iterator[Case]:
    from mla_quant.kernels.mla_prefill import mla_prefill
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    for dt, causal in ((BF16, True), (BF16, False), (torch.float32, True)):
        q, k = torch.randn(300, 16, 192, dtype=dt), torch.randn(300, 16, 192, dtype=dt)  # d_qk = 128 + 64 rope
        v = torch.randn(300, 16, 128, dtype=dt)
        yield f"dtype={_dt(dt)} causal={causal}", partial(mla_prefill, q, k, v, cu, cu, 200, 0.1, causal)


def cases_sparse_mla_decode() -> Iterator[Case]:
    from mla_quant.kernels.sparse_mla_decode import sparse_mla_decode
    top_k = 2048
    table, lens = _table([top_k])
    for (kind, scale), (tokens, heads) in ((f, s) for f in KV_FORMATS for s in ((1, 16), (1, 128), (300, 128))):
        data, scales = _kv_pages(kind, scale, table.numel())
        q_nope = torch.randn(tokens, heads, D_LATENT, dtype=BF16)
        q_pe = torch.randn(tokens, heads, D_ROPE, dtype=BF16)
        req = torch.zeros(tokens, dtype=torch.int32)
        idx = torch.arange(top_k, dtype=torch.int32).expand(tokens, top_k)
        yield (f"kind={kind} scale={scale} T={tokens} heads={heads}",
               partial(sparse_mla_decode, q_nope, q_pe, data, scales, kind, table, lens, req, idx, 0.1))


def cases_indexer_k_append() -> Iterator[Case]:
    from mla_quant.kernels.indexer_k_append import indexer_k_append
    k, slots = torch.randn(10, 128, dtype=BF16), torch.arange(10, dtype=torch.int32)
    for cache_dtype, ue8m0 in ((FP8, False), (FP8, True), (BF16, False)):
        cache = torch.zeros(4, PAGE, 128, dtype=cache_dtype)
        scale = torch.ones(4, PAGE) if cache_dtype == FP8 else None
        yield f"cache={_dt(cache_dtype)} ue8m0={ue8m0}", partial(indexer_k_append, k, slots, cache, scale, ue8m0)


def cases_indexer_scores() -> Iterator[Case]:
    from mla_quant.kernels.indexer_scores import indexer_scores
    table, lens = _table([100, 300])
    req, pos = torch.tensor([0, 1], dtype=torch.int32), lens - 1  # one decode token per request
    for q_dtype, k_dtype in ((FP8, FP8), (BF16, BF16), (BF16, FP8), (torch.float32, torch.float32)):
        q = torch.zeros(2, 64, 128, dtype=q_dtype)  # DeepSeek V3.2's indexer: 64 heads of 128
        cache = torch.zeros(table.numel(), PAGE, 128, dtype=k_dtype)
        scale = torch.ones(table.numel(), PAGE) if k_dtype == FP8 else None
        yield f"q={_dt(q_dtype)} keys={_dt(k_dtype)}", partial(indexer_scores, q, torch.ones(2, 64), cache, scale, table,
                                                     req, pos)
    # decode at batch 1 through indexer_topk: the scores kernel with the radix select's first histogram fused
    from mla_quant.kernels.indexer_scores import indexer_topk
    table, lens = _table([65536])
    req, pos = torch.tensor([0], dtype=torch.int32), lens - 1
    cache = torch.zeros(table.numel(), PAGE, 128, dtype=FP8)
    for fused in (True, False):  # fused: the scores kernel counts the radix select's first digit
        yield f"indexer_topk fused={fused}, 64k keys, top-2048", partial(
            indexer_topk, torch.zeros(1, 64, 128, dtype=FP8), torch.ones(1, 64), cache,
            torch.ones(table.numel(), PAGE), table, req, pos, 2048, fused=fused)


def cases_topk() -> Iterator[Case]:
    from mla_quant.kernels.topk import RADIX_MAX_ROWS, topk_indices
    for rows, n in ((1, 65536), (RADIX_MAX_ROWS, 8192), (64, 8192), (3, 3001)):  # "auto"
        yield f"rows={rows} N={n}", partial(topk_indices, torch.randn(rows, n), 2048)
    for rows, n in ((1, 65536), (64, 8192)):                                      # the multi-program radix
        for bits, finish in ((8, "candidates"), (8, "rounds"), (11, "rounds")):
            yield f"radix{bits} {finish} rows={rows} N={n}", partial(
                topk_indices, torch.randn(rows, n), 2048, "radix", bits, finish)


def cases_fp8_gemm() -> Iterator[Case]:
    from mla_quant.kernels.fp8_gemm import TMA_CANDIDATES, WS_CANDIDATES, default_config, fp8_gemm, ws_default_config
    n, k = 512, 1024
    b, b_scale = torch.zeros(n, k, dtype=FP8), torch.ones(n // 128, k // 128)
    for m in (1, 16, 100):
        for out_dtype in (BF16, torch.float32):
            a, a_scale = torch.zeros(m, k, dtype=FP8), torch.ones(m, k // 128)
            yield f"M={m} out={_dt(out_dtype)}", partial(fp8_gemm, a, a_scale, b, b_scale, (128, 128), out_dtype,
                                                         variant="portable")
            # the Hopper (TMA) variant: its default at this M, and every candidate of the sweep at M = 100
            for config in (default_config(m), *(TMA_CANDIDATES if m == 100 else ())):
                yield (f"M={m} out={_dt(out_dtype)} tma {config}",
                       partial(fp8_gemm, a, a_scale, b, b_scale, (128, 128), out_dtype, config=config, variant="tma"))
            # the warp-specialized Gluon variant, likewise
            for config in (ws_default_config(m), *(WS_CANDIDATES if m == 100 else ())):
                yield (f"M={m} out={_dt(out_dtype)} ws {config}",
                       partial(fp8_gemm, a, a_scale, b, b_scale, (128, 128), out_dtype, config=config, variant="ws"))


def _zero_int4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed INT4 words [n, k/8] and group-32 scales [n, k/32] (values do not matter: nothing runs)."""
    return torch.zeros(n, k // 8, dtype=torch.int32), torch.ones(n, k // 32, dtype=BF16)


def cases_w4a16_gemm() -> Iterator[Case]:
    from mla_quant.kernels.w4a16_gemm import w4a16_gemm
    n, k = 512, 1024
    packed, scale = _zero_int4(n, k)
    for m in (1, 16, 100):
        for fast in (0, 1, 2):
            yield f"M={m} fast_dequant={fast}", partial(w4a16_gemm, torch.randn(m, k, dtype=BF16), packed, scale,
                                                        32, fast_dequant=fast)
    # M = 1 in one launch (opt-in), at a Kimi width where split-K runs
    n, k = 2048, 7168
    packed, scale = _zero_int4(n, k)
    for x_dtype in (BF16, torch.float16):  # 2..16 tokens: the fragment kernel ("auto"), the swapped-operand kernel
        for m in (2, 8, 16, 32, 64):   # every launch tile of fragments.frag_tile, 4 token tiles, two chunks
            yield f"M={m} fragments {n}x{k} x={_dt(x_dtype)}", partial(
                w4a16_gemm, torch.randn(m, k, dtype=x_dtype), packed, scale.to(x_dtype), 32, fragments=True)
        for m in (16, 32, 64, 128):  # swap_ab=True: token tiles of 16-128 (X_SPLIT loads past 16)
            yield f"M={m} swap_ab {n}x{k} x={_dt(x_dtype)}", partial(
                w4a16_gemm, torch.randn(m, k, dtype=x_dtype), packed, scale.to(x_dtype), 32, swap_ab=True)
    for x_dtype in (BF16, torch.float16):  # wgmma=True (Gluon): token tiles of 32-128, split-K and not
        for m, (n2, k2) in ((17, (2048, 7168)), (64, (2048, 7168)), (128, (7168, 2048)), (64, (8192, 64))):
            p2, s2 = _zero_int4(n2, k2)
            yield f"M={m} wgmma {n2}x{k2} x={_dt(x_dtype)}", partial(
                w4a16_gemm, torch.randn(m, k2, dtype=x_dtype), p2, s2.to(x_dtype), 32, wgmma=True)
    for x_dtype in (BF16, torch.float32):
        yield f"M=1 gemv=planes1 {n}x{k} x={_dt(x_dtype)}", partial(w4a16_gemm, torch.randn(1, k, dtype=x_dtype),
                                                                   packed, scale, 32, gemv="planes1")
    # M = 1, the whole-row GEMVs: each tile of gemv.gemv_tile and gemv_half2.half2_tile (x in pair order inside the
    # GEMV), plain and with prefetch_weights (PDL)
    for n, k in ((2048, 7168), (4096, 7168), (7168, 2048), (7168, 18432)):
        packed, scale = _zero_int4(n, k)
        for form, early in itertools.product(("rows", "rows_half2"), (False, True)):
            yield f"M=1 gemv={form} {n}x{k} prefetch={early}", partial(
                w4a16_gemm, torch.randn(1, k, dtype=BF16), packed, scale, 32, gemv=form, prefetch_weights=early)
    # x not 16-byte aligned: the rows GEMV's scalar activation loads (VEC off), and the half2 GEMV on pairs from a
    # pair_order launch, which only these cases compile
    for x_dtype, form in ((BF16, "rows"), (torch.float32, "rows"), (BF16, "rows_half2")):
        yield f"M=1 gemv={form} unaligned x={_dt(x_dtype)}", partial(
            w4a16_gemm, torch.randn(1, 2049, dtype=x_dtype)[:, 1:], *_zero_int4(40, 2048), 32, gemv=form)


def cases_moe_align() -> Iterator[Case]:
    from mla_quant.kernels.moe_align import moe_align
    for tokens, block_m in ((1, 16), (64, 16), (256, 64)):
        yield f"T={tokens} block_m={block_m}", partial(moe_align, torch.randint(0, 256, (tokens, 8)), 256, block_m)


def _moe_weights(kind: str, experts: int, n: int, k: int) -> dict[str, torch.Tensor]:
    """Zeroed stacked expert weights [E, N, K] in one format's checkpoint tensors."""
    if kind == "bf16":
        return {"weight": torch.zeros(experts, n, k, dtype=BF16)}
    if kind == "fp8_block":
        return {"weight": torch.zeros(experts, n, k, dtype=FP8),
                "weight_scale_inv": torch.ones(experts, -(-n // 128), -(-k // 128))}
    return {"weight_packed": torch.zeros(experts, n, k // 8, dtype=torch.int32),
            "weight_scale": torch.ones(experts, n, k // 32, dtype=BF16)}


def cases_fused_moe() -> Iterator[Case]:
    from mla_quant.kernels.fused_moe import fused_moe
    experts, hidden, inter, top_k = 16, 1024, 256, 4  # a small MoE; tiles depend on rows per expert, not E
    for kind, act_quant in (("bf16", False), ("fp8_block", False), ("fp8_block", True), ("int4_group", False)):
        gate, up = _moe_weights(kind, experts, inter, hidden), _moe_weights(kind, experts, inter, hidden)
        down = _moe_weights(kind, experts, hidden, inter)
        for tokens in (1, 16, 256, 2048):  # block_m 1 (INT4) or 16, 16, 64, 128
            ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).int()
            for x_dtype in (BF16, torch.float32):
                yield (f"kind={kind} act_quant={act_quant} T={tokens} x={_dt(x_dtype)}",
                       partial(fused_moe, torch.randn(tokens, hidden, dtype=x_dtype), torch.rand(tokens, top_k),
                               ids, gate, up, down, kind=kind, act_quant=act_quant))
                if kind == "int4_group" and tokens > 1:  # the dequantized tile beside the default plane tile
                    yield (f"kind={kind} int4_tile=dequant T={tokens} x={_dt(x_dtype)}",
                           partial(fused_moe, torch.randn(tokens, hidden, dtype=x_dtype), torch.rand(tokens, top_k),
                                   ids, gate, up, down, kind=kind, int4_tile="dequant"))
                if kind == "int4_group" and tokens > 1 and x_dtype == BF16:  # the fragment blocks, 8 and 16 rows
                    for bm in (8, 16):
                        yield (f"kind={kind} int4_tile=fragments block_m={bm} T={tokens}",
                               partial(fused_moe, torch.randn(tokens, hidden, dtype=x_dtype),
                                       torch.rand(tokens, top_k), ids, gate, up, down, kind=kind, block_m=bm,
                                       int4_tile="fragments"))
        # the decode path (block_m == 1; INT4 takes it at T=1 above, fused): with the shared output, the aligned path
        # with its combine launch (decode_fusion=False), and the BF16 / FP8 GEMVs (block_m=1)
        x, ids = torch.randn(1, hidden, dtype=BF16), torch.randperm(experts)[:top_k].int()[None]
        decode = partial(fused_moe, x, torch.rand(1, top_k), ids, gate, up, down, kind=kind, act_quant=act_quant,
                         block_m=1)
        if kind == "int4_group":
            yield f"kind={kind} T=1 shared_out", partial(decode, shared_out=torch.randn(1, hidden, dtype=BF16))
            yield f"kind={kind} T=1 decode_fusion=False", partial(decode, decode_fusion=False)
            yield f"kind={kind} T=1 gemv=fragments shared_out", partial(
                decode, gemv="fragments", shared_out=torch.randn(1, hidden, dtype=BF16))
        else:
            yield f"kind={kind} act_quant={act_quant} T=1 block_m=1", decode


OPS: dict[str, Callable[[], Iterator[Case]]] = {
    "fp8_quant": cases_fp8_quant, "int4_quant": cases_int4_quant, "kv_append": cases_kv_append,
    "page_tag_verify": cases_page_tag_verify, "mla_decode": cases_mla_decode, "mla_prefill": cases_mla_prefill,
    "sparse_mla_decode": cases_sparse_mla_decode, "indexer_k_append": cases_indexer_k_append,
    "indexer_scores": cases_indexer_scores, "topk": cases_topk, "fp8_gemm": cases_fp8_gemm,
    "w4a16_gemm": cases_w4a16_gemm, "moe_align": cases_moe_align, "fused_moe": cases_fused_moe,
}


# ---------------------------------------------------------------------------------------------- run
def check_op(op: str, log: CompileLog, verbose: bool = False, only: str | None = None) -> list[str]:
    """Compile every case of one op (``only``: those whose label contains it); print its summary line; return its
    failures."""
    failures, seen = [], {}  # seen: kernel hash -> (case label, Compiled)
    try:
        cases = [(label, call) for label, call in OPS[op]() if only is None or only in label]
    except Exception as e:  # noqa: BLE001 - building the inputs went wrong: report it, check the other ops
        cases = []
        failures.append(f"{op} [building the inputs]: {type(e).__name__}: {_tail(str(e))}")
    for label, call in cases:
        k0, e0 = len(log.kernels), len(log.errors)
        try:
            call()
        except Exception as e:  # noqa: BLE001 - a launcher that raises is a finding too
            failures.append(f"{op} [{label}]: {type(e).__name__}: {_tail(str(e))}")
        failures += [f"{op} [{label}]: {err}" for err in log.errors[e0:]]
        failures += [f"{op} [{label}]: {err}" for k in log.kernels[k0:] if (err := smem_error(k))]
        seen.update({k.hash: (label, k) for k in log.kernels[k0:] if k.hash not in seen})
    kernels = [k for _, k in seen.values()]
    top = max(kernels, key=lambda k: k.shared, default=None)
    regs = max((k.regs for k in kernels if k.regs is not None), default=None)
    spilling = [(label, k) for label, k in seen.values() if k.spills]
    worst = max(spilling, key=lambda lk: lk[1].spills, default=None)
    spills = (f"{len(spilling)} spilling, worst {worst[1].spills} B ({worst[1].kernel} in [{worst[0]}])"
              if worst else "no spills")
    print(f"{'FAIL' if failures else 'OK  '} {op}: {len(cases)} cases, {len(kernels)} kernels, max smem "
          f"{top.shared if top else 0} B{f' ({top.kernel})' if top else ''}, max regs {regs}, {spills}", flush=True)
    for label, k in seen.values() if verbose else ():
        print(f"     {k.kernel} [{label}] smem {k.shared} B, regs {k.regs}, spills {k.spills} B: {k.config}")
    for failure in failures:
        print("     " + failure.replace("\n", "\n       "), flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", help=f"ops to compile (default: all of {', '.join(OPS)})")
    parser.add_argument("--no-ptxas", action="store_true", help="skip the ptxas -v register/spill report")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every kernel with its config")
    parser.add_argument("-k", "--cases", help="only the cases whose label contains this text")
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(OPS)}")
    log = CompileLog()
    install_fake_hopper(log, ptxas=not args.no_ptxas)
    missing = sorted(set(kernels_pkg_ops()) - set(OPS))
    if missing:
        print(f"note: op folders without compile cases: {missing}")
    import triton
    print(f"Compiling for sm_90 with Triton {triton.__version__}, torch {torch.__version__}", flush=True)
    failures = [f for op in (args.ops or OPS) for f in check_op(op, log, args.verbose, args.cases)]
    print(f"{len(failures)} failure(s)" if failures else "all ops compiled", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
