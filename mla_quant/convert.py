"""Convert an FP8 (block, ``weight_scale_inv``) or BF16 safetensors checkpoint: chosen linear layers to INT4.

    python -m mla_quant.convert SRC DST [--plan experts|PLAN.json|'{"rules": ...}'] [--method rtn|mse|gptq]
                                        [--hessians FILE] [--gptq-clip absmax|mse] [--gptq-act-order]
                                        [--group-size 32] [--device cuda] [--no-compare] [--quiet]

Reads ``SRC`` shard by shard (memory: one input shard's converted tensors plus one weight at a time),
applies a :class:`~mla_quant.formats.plan.QuantPlan` to the *checkpoint* module names (the key without
``.weight``, e.g. ``model.layers.3.mlp.experts.17.gate_proj`` or ``language_model.model...`` for Kimi),
and writes ``DST`` with the same shard names:

* layers the plan puts in ``Int4Group`` -> compressed-tensors ``pack-quantized`` ``weight_packed`` int32
  ``[N, K/8]``, ``weight_scale`` ``[N, K/g]`` (bf16), ``weight_shape`` ``[2]``; their ``weight_scale_inv``
  is dropped;
* layers it puts in ``FP8Block`` / ``BF16`` -> those formats (``weight`` + ``weight_scale_inv`` / ``weight``);
* everything else (``None`` or no rule: norms, embeddings, the layers left in FP8) -> copied bit for bit.

The default plan converts the routed experts (``.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj``) to INT4
group 32, as Cloudflare did for GLM 5.2 (705 GB -> 421 GB). ``config.json`` gets a compressed-tensors
``quantization_config`` (one ``Linear`` group: symmetric INT4, strategy group, ``pack-quantized``; an
``ignore`` list of every other linear layer; layers left in FP8 keep ``weight_scale_inv`` as the DeepSeek /
GLM releases store them, their block in ``weight_block_size``); the plan goes into every shard's safetensors
metadata (``QuantPlan.from_checkpoint``); ``conversion_report.json`` lists each tensor's error.

Methods: ``rtn`` rounds to nearest with ``scale = absmax / 7.5`` (compressed-tensors' ``minmax`` observer,
bit-exact with ``Int4Group.quantize``); ``mse`` searches, per group, the clipping ``scale = absmax · c / 7.5``
over a small grid of ``c`` (:data:`MSE_GRID`) and keeps the scale with the least squared error (never worse
than ``rtn``, which is the grid's first entry); ``gptq`` rounds column by column and passes each column's error on
to the columns not yet rounded, weighted by the calibration inputs' Hessian ``X^T X`` (``mla_quant.gptq``; the
Hessians come from ``--hessians``, a file that ``gptq.HessianCollector.save`` wrote while the model ran
calibration text; ``--gptq-clip mse`` picks each group's scale by the MSE search). Each method's error is reported
per tensor (relative error and SQNR against the source weight; with a Hessian for the tensor also the output
error on the calibration inputs, ``out_rel_err`` / ``out_sqnr_db``) unless ``--no-compare``.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .formats import BF16, FP8Block, Int4Group, WeightFormat
from .formats.plan import QuantPlan
from .kernels import fp8_quant
from .kernels.fp8_quant.reference import div_ieee, reciprocal
from .kernels.int4_quant.reference import HALF_RANGE, QMAX, QMIN, int4_codes, int4_pack_reference

INDEX_FILE = "model.safetensors.index.json"
REPORT_FILE = "conversion_report.json"
EXPERTS = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj"
PRESETS = {"experts": lambda g: QuantPlan({EXPERTS: Int4Group(g)})}
METHODS = ("rtn", "mse", "gptq")
OBSERVERS = {"rtn": "minmax", "mse": "mse", "gptq": "minmax"}
# Clipping factors tried by the ``mse`` method, first = plain absmax (ties keep it). 8/7.5 maps the largest
# positive value onto code 7 exactly instead of rounding 7.5 up to 8 and clamping.
MSE_GRID = (1.0, 8 / 7.5) + tuple(round(0.975 - 0.025 * i, 3) for i in range(11))


# ---------------------------------------------------------------------------------------------- quantizers
def int4_quantize_mse(w: torch.Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16,
                      grid: tuple[float, ...] = MSE_GRID) -> tuple[torch.Tensor, torch.Tensor]:
    """MSE-optimal clipping: per group, ``scale = absmax · c / 7.5`` for the ``c`` in ``grid`` with the least
    squared error of ``q · scale`` (scales rounded to ``scale_dtype`` first, as they are stored).

    w: [N, K] -> (weight_packed int32 [N, K/8], weight_scale [N, K/group_size]). With ``grid=(1.0,)`` this
    is exactly the round-to-nearest quantizer (``int4_quantize_reference``)."""
    n, k = w.shape
    wf = w.float()
    wg = wf.reshape(n, k // group_size, group_size)
    absmax = wg.abs().amax(dim=-1)
    best_scale = best_err = None
    for c in grid:
        scale = div_ieee(absmax * c, HALF_RANGE).to(scale_dtype)
        s = scale.float().masked_fill(scale == 0, 1.0)[..., None]  # an all-zero group: codes 0, error 0
        # the codes int4_codes gives (w times the once-rounded reciprocal), then their squared error
        err = (wg * reciprocal(s)).round_().clamp_(QMIN, QMAX).mul_(s).sub_(wg).square_().sum(-1)
        if best_scale is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.where(better, err, best_err)
    return int4_pack_reference(int4_codes(wf, best_scale, group_size)), best_scale


def quantize_weight(w: torch.Tensor, fmt: WeightFormat, method: str = "rtn",
                    dtype: torch.dtype = torch.bfloat16, hessian: torch.Tensor | None = None,
                    gptq_clip: str = "absmax", gptq_act_order: bool = False) -> dict[str, torch.Tensor]:
    """A dense fp32 weight [N, K] in ``fmt``, as checkpoint tensors (suffix -> tensor). ``method`` applies
    to ``Int4Group`` (``rtn`` = ``fmt.quantize``; ``gptq`` needs the layer's ``hessian`` [K, K] and takes
    ``gptq_clip`` and ``gptq_act_order``); ``dtype`` is the stored dtype of a ``BF16`` weight."""
    if method not in METHODS:
        raise ValueError(f"method: {method!r} not in {METHODS}")
    if isinstance(fmt, Int4Group) and method in ("mse", "gptq"):
        fmt.check_shape(*w.shape)
        if method == "gptq":
            if hessian is None:
                raise ValueError("method 'gptq': needs the layer's hessian (calibration inputs' X^T X)")
            from .gptq import gptq_quantize

            packed, scale = gptq_quantize(w, hessian, fmt.group_size, fmt.torch_scale_dtype, clip=gptq_clip,
                                          act_order=gptq_act_order)
        else:
            packed, scale = int4_quantize_mse(w, fmt.group_size, fmt.torch_scale_dtype)
        return {"weight_packed": packed, "weight_scale": scale,
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64, device=w.device)}
    if isinstance(fmt, BF16):
        return fmt.quantize(w, dtype)
    return fmt.quantize(w)


def weight_error(w: torch.Tensor, approx: torch.Tensor) -> dict[str, float]:
    """Relative error ||w - approx|| / ||w|| and SQNR in dB."""
    w, a = w.double(), approx.double()
    noise, signal = (w - a).pow(2).sum().item(), w.pow(2).sum().item()
    rel = math.sqrt(noise / signal) if signal else 0.0
    sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal else -math.inf
    return {"rel_err": rel, "sqnr_db": sqnr}


# ---------------------------------------------------------------------------------------------- checkpoint
class Checkpoint:
    """A folder of safetensors shards (with or without an index), read lazily tensor by tensor."""

    def __init__(self, folder: str | Path, stack: ExitStack):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"SRC: no *.safetensors (and no {INDEX_FILE}) in {str(self.folder)!r}")
            self.weight_map = {}
            for name in files:
                with safe_open(str(self.folder / name), "pt") as f:
                    self.weight_map.update({k: name for k in f.keys()})
        self.shards = sorted(set(self.weight_map.values()))
        self._stack, self._open = stack, {}

    def handle(self, shard: str):
        if shard not in self._open:
            path = self.folder / shard
            if not path.is_file():
                raise FileNotFoundError(f"{INDEX_FILE}: shard {shard!r} is missing from {str(self.folder)!r}")
            self._open[shard] = self._stack.enter_context(safe_open(str(path), "pt"))
        return self._open[shard]

    def keys(self, shard: str) -> list[str]:
        return [k for k, v in self.weight_map.items() if v == shard]

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise KeyError(f"checkpoint: missing tensor {key!r}")
        return self.handle(self.weight_map[key]).get_tensor(key)


def _source_format(ckpt: Checkpoint, module: str, w: torch.Tensor, block: tuple[int, int]) -> WeightFormat:
    if w.dtype == fp8_quant.FP8:
        if module + ".weight_scale_inv" not in ckpt.weight_map:
            raise KeyError(f"checkpoint: FP8 tensor {module + '.weight'!r} has no {module + '.weight_scale_inv'!r}")
        return FP8Block(block=block, act_quant=False)
    return BF16()


def _stored_group(ckpt: Checkpoint, module: str, packed: torch.Tensor) -> int:
    """Group size of an INT4 weight already in the checkpoint, from its ``weight_scale`` shape."""
    key = module + ".weight_scale"
    if key not in ckpt.weight_map:
        raise KeyError(f"checkpoint: {module + '.weight_packed'!r} has no {key!r}")
    cols = ckpt.handle(ckpt.weight_map[key]).get_slice(key).get_shape()[-1]
    return packed.shape[1] * 8 // cols


def _same_storage(a: WeightFormat, b: WeightFormat) -> bool:
    return type(a) is type(b) and (not isinstance(a, FP8Block) or a.block == b.block)


# ---------------------------------------------------------------------------------------------- report
@dataclass
class ConversionReport:
    method: str
    tensors: list[dict] = field(default_factory=list)   # one row per converted weight
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"converted {len(self.tensors)} weights with {self.method!r}: "
                 f"{self.bytes_in / 2**30:.3f} GiB -> {self.bytes_out / 2**30:.3f} GiB in {self.seconds:.1f} s"]
        methods = [m for m in METHODS if any(m in r["errors"] for r in self.tensors)]
        if methods:
            lines.append(f"{'method':8} {'mean rel err':>13} {'mean SQNR dB':>13} {'min SQNR dB':>12} {'tensors':>8}"
                         f" {'mean output SQNR dB':>20}")
            for m in methods:
                rows = [r["errors"][m] for r in self.tensors if m in r["errors"]]
                outs = [r["out_sqnr_db"] for r in rows if "out_sqnr_db" in r]
                lines.append(f"{m:8} {sum(r['rel_err'] for r in rows) / len(rows):13.5f} "
                             f"{sum(r['sqnr_db'] for r in rows) / len(rows):13.2f} "
                             f"{min(r['sqnr_db'] for r in rows):12.2f} {len(rows):8d}"
                             f" {f'{sum(outs) / len(outs):.2f} ({len(outs)})' if outs else '-':>20}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"method": self.method, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "seconds": self.seconds, "tensors": self.tensors}


# ---------------------------------------------------------------------------------------------- config
def _generalise(names: list[str]) -> list[str]:
    """``model.layers.3.x`` -> ``re:model\\.layers\\.\\d+\\.x$``: one regex per distinct pattern."""
    out = []
    for name in names:
        rx = "re:" + r"\.\d+\.".join(re.escape(p) for p in re.split(r"\.\d+\.", name)) + "$"
        if rx not in out:
            out.append(rx)
    return out


def _ct_match(name: str, entries: list[str]) -> bool:
    """compressed-tensors matching: ``re:`` entries are regexes (``re.match``), others exact names."""
    return any(re.match(e[3:], name) if e.startswith("re:") else e == name for e in entries)


def ignore_list(int4: list[str], others: list[str]) -> list[str]:
    """The ``ignore`` entries for the non-INT4 linear layers: generalised over layer / expert indices when
    that matches none of the INT4 layers, else the exact names."""
    rx = _generalise(sorted(others))
    if not any(_ct_match(n, rx) for n in int4):
        return rx
    return sorted(others)


def quantization_config(fmts: dict[str, WeightFormat], method: str, fp8_block: tuple[int, int] | None,
                        observer: str | None = None, actorder: str | None = None) -> dict:
    """compressed-tensors ``pack-quantized`` config for the INT4 layers (``fmts``: module -> format); ``observer``:
    how the scales were chosen (default the method's, ``OBSERVERS``); ``actorder``: "weight" after GPTQ in
    activation order (the stored layout unchanged)."""
    int4 = {n: f for n, f in fmts.items() if isinstance(f, Int4Group)}
    groups = {f.group_size for f in int4.values()}
    if len(groups) != 1:
        raise ValueError(f"plan: the INT4 layers must share one group size, got {sorted(groups)}")
    scheme = {"actorder": actorder, "block_structure": None, "dynamic": False, "group_size": groups.pop(),
              "num_bits": 4, "observer": observer or OBSERVERS[method], "observer_kwargs": {}, "strategy": "group",
              "symmetric": True, "type": "int"}
    qc = {"config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                        "targets": ["Linear"], "weights": scheme}},
          "format": "pack-quantized", "ignore": ignore_list(sorted(int4), [n for n in fmts if n not in int4]),
          "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    if fp8_block is not None:  # layers left in FP8 keep weight_scale_inv (DeepSeek layout); say their block
        qc["weight_block_size"] = list(fp8_block)
    return qc


def _write_config(src: Path, dst: Path, qc: dict | None) -> None:
    path = src / "config.json"
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    if qc is not None:
        holder = cfg["text_config"] if "quantization_config" not in cfg and isinstance(
            cfg.get("text_config"), dict) else cfg
        holder["quantization_config"] = qc
        if holder is not cfg:
            cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- convert
def _progress(enabled: bool) -> Callable[[str, bool], None]:
    tty = sys.stderr.isatty()

    def say(msg: str, final: bool = False) -> None:
        if enabled and (final or tty):
            print(("\r" if tty else "") + msg + ("\n" if final or not tty else ""), end="", file=sys.stderr,
                  flush=True)
    return say


def _block_of(src: Path) -> tuple[int, int]:
    path = src / "config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        for holder in (cfg, cfg.get("text_config") or {}):
            qc = holder.get("quantization_config") or {}
            if qc.get("weight_block_size"):
                return tuple(int(b) for b in qc["weight_block_size"])
    return (128, 128)


def convert_checkpoint(src: str | Path, dst: str | Path, plan: QuantPlan | None = None, method: str = "rtn",
                       device: str | torch.device = "cpu", compare: bool = True,
                       progress: bool = True, hessians: str | Path | None = None,
                       gptq_clip: str = "absmax", gptq_act_order: bool = False) -> ConversionReport:
    """Convert checkpoint folder ``src`` into ``dst`` (created; must not be ``src``). Returns the report.
    ``hessians``: a file of ``gptq.HessianCollector.save`` (needed by ``method="gptq"``, which raises for an INT4
    layer it holds no Hessian for; with another method it adds the output errors of the layers it covers)."""
    src, dst = Path(src), Path(dst)
    plan = plan if plan is not None else PRESETS["experts"](32)
    if method not in METHODS:
        raise ValueError(f"method: {method!r} not in {METHODS}")
    if method == "gptq" and hessians is None:
        raise ValueError("method 'gptq': pass hessians= (--hessians FILE), written by gptq.HessianCollector.save")
    if hessians is not None:
        from .gptq import HessianFile

        hessians = HessianFile(hessians)
    if src.resolve() == dst.resolve():
        raise ValueError("DST: must differ from SRC")
    dst.mkdir(parents=True, exist_ok=True)
    block = _block_of(src)
    report, say, t0 = ConversionReport(method), _progress(progress), time.time()
    fmts: dict[str, WeightFormat] = {}    # every linear layer of the output -> its format
    new_map: dict[str, str] = {}
    with ExitStack() as stack:
        ckpt = Checkpoint(src, stack)
        for i, shard in enumerate(ckpt.shards):
            out: dict[str, torch.Tensor] = {}
            keys = ckpt.keys(shard)
            for j, key in enumerate(keys):
                say(f"[{i + 1}/{len(ckpt.shards)}] {shard}: {j + 1}/{len(keys)} {key}")
                module, _, suffix = key.rpartition(".")
                t = ckpt.get(key)
                report.bytes_in += t.numel() * t.element_size()
                target = plan.format_for(module) if suffix in ("weight", "weight_scale_inv") else None
                if suffix == "weight_packed":  # already INT4 (e.g. Kimi's experts): copied as they are
                    fmts[module] = Int4Group(_stored_group(ckpt, module, t))
                if suffix == "weight_scale_inv":
                    src_fmt = FP8Block(block=block, act_quant=False)
                    if target is not None and not _same_storage(target, src_fmt):
                        continue  # its weight is re-held in another format
                elif suffix == "weight" and t.dim() == 2:
                    src_fmt = _source_format(ckpt, module, t, block)
                    fmts[module] = src_fmt
                    if target is not None and not _same_storage(target, src_fmt):
                        tensors, row = _convert_one(ckpt, module, t, src_fmt, target, method, block, device, compare,
                                                    hessians, {"gptq_clip": gptq_clip,
                                                               "gptq_act_order": gptq_act_order})
                        fmts[module] = target
                        report.tensors.append(row)
                        out.update({f"{module}.{k}": v.cpu().contiguous() for k, v in tensors.items()})
                        continue
                out[key] = t
            save_file(out, str(dst / shard), metadata={"format": "pt", **plan.to_metadata()})
            report.bytes_out += sum(v.numel() * v.element_size() for v in out.values())
            new_map.update({k: shard for k in out})
            say(f"[{i + 1}/{len(ckpt.shards)}] {shard}: {len(keys)} tensors, "
                f"{sum(1 for k in out if k.endswith('.weight_packed'))} INT4 weights", final=True)
    (dst / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": report.bytes_out}, "weight_map": dict(sorted(new_map.items()))}, indent=2) + "\n")
    made_int4 = any(isinstance(fmts[r["name"]], Int4Group) for r in report.tensors)
    fp8_left = any(isinstance(f, FP8Block) for f in fmts.values())
    observer = "mse" if method == "gptq" and gptq_clip == "mse" else None
    actorder = "weight" if method == "gptq" and gptq_act_order else None
    _write_config(src, dst, quantization_config(fmts, method, block if fp8_left else None, observer, actorder)
                  if made_int4 else None)
    for extra in src.iterdir():  # tokenizer, generation config, remote code ...
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (INDEX_FILE, "config.json"):
            shutil.copy2(extra, dst / extra.name)
    report.seconds = time.time() - t0
    (dst / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return report


def _convert_one(ckpt: Checkpoint, module: str, t: torch.Tensor, src_fmt: WeightFormat, target: WeightFormat,
                 method: str, block: tuple[int, int], device, compare: bool, hessians=None,
                 gptq: dict | None = None) -> tuple[dict, dict]:
    """(the tensors of ``module`` in ``target``, its report row)."""
    stored = {"weight": t.to(device)}
    if isinstance(src_fmt, FP8Block):
        stored["weight_scale_inv"] = ckpt.get(module + ".weight_scale_inv").to(device)
    w = src_fmt.dequantize(stored, torch.float32)  # [N, K] fp32, exactly the source values
    int4 = isinstance(target, Int4Group)
    hessian = None
    if int4 and hessians is not None and (method == "gptq" or hessians.find(module) is not None):
        hessian = hessians.get(module, w.shape[1]).to(device)
    tensors = quantize_weight(w, target, method, dtype=t.dtype if t.is_floating_point() and t.element_size() > 1
                              else torch.bfloat16, hessian=hessian, **(gptq or {}))
    row = {"name": module, "shape": list(w.shape), "from": type(src_fmt).__name__, "to": repr(target), "errors": {}}
    methods = [m for m in METHODS if m != "gptq" or hessian is not None] if compare and int4 else [method]
    for m in methods:
        got = tensors if m == method else quantize_weight(w, target, m, hessian=hessian, **(gptq or {}))
        approx = target.dequantize(got, torch.float32)
        row["errors"][m] = weight_error(w, approx)
        if hessian is not None:
            from .gptq import output_error

            row["errors"][m].update(output_error(w, approx, hessian))
    return tensors, row


# ---------------------------------------------------------------------------------------------- CLI
def parse_plan(text: str, group_size: int = 32) -> QuantPlan:
    """A preset name (``experts``), a path to a JSON file, or inline JSON (``QuantPlan.to_dict()``)."""
    if text in PRESETS:
        return PRESETS[text](group_size)
    path = Path(text)
    data = json.loads(path.read_text()) if path.is_file() else json.loads(text)
    return QuantPlan.from_dict(data) if "rules" in data else QuantPlan(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mla_quant.convert", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="checkpoint folder (config.json + *.safetensors [+ index])")
    ap.add_argument("dst", help="output folder")
    ap.add_argument("--plan", default="experts", help="'experts' (default), a plan JSON file, or inline JSON")
    ap.add_argument("--method", default="rtn", choices=METHODS)
    ap.add_argument("--hessians", help="GPTQ: the calibration Hessians (gptq.HessianCollector.save); with another "
                                       "method they add each layer's output error to the report")
    ap.add_argument("--gptq-clip", default="absmax", choices=("absmax", "mse"), help="GPTQ: each group's scale")
    ap.add_argument("--gptq-act-order", action="store_true",
                    help="GPTQ: columns by decreasing Hessian diagonal (group scales fixed first; same layout)")
    ap.add_argument("--group-size", type=int, default=32, help="INT4 group of the 'experts' preset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compare", action="store_true", help="report only the chosen method's error")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    report = convert_checkpoint(args.src, args.dst, parse_plan(args.plan, args.group_size), args.method,
                                args.device, compare=not args.no_compare, progress=not args.quiet,
                                hessians=args.hessians, gptq_clip=args.gptq_clip,
                                gptq_act_order=args.gptq_act_order)
    print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
