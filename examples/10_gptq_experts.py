"""INT4 routed experts three ways: round-to-nearest, the MSE clipping search, and GPTQ on calibration text, layer by
layer (``gptq.gptq_``), each against the fp32 model: KL and top-1 of the next-token distributions on other text,
and the output error of each expert weight on its own calibration inputs. Then the file path a real conversion
takes: the Hessians collected and saved, ``python -m mla_quant.convert --method gptq --hessians``, reloaded. Tiny
Kimi K2.6-shaped model with 3 layers (two MoE layers); CPU in seconds.

    python examples/10_gptq_experts.py
"""
import copy
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from mla_quant.eval import kl_divergence, top1_agreement
from mla_quant.formats import Int4Group
from mla_quant.formats.plan import QuantPlan, quantize_
from mla_quant.gptq import HessianCollector, gptq_
from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, from_pretrained, init_random_weights_, save_pretrained

EXPERTS = r"re:.*mlp\.experts"


def compare(name: str, model, reference_logits, ids) -> None:
    with torch.no_grad():
        logits = model(ids).float()
    print(f"{name:22} KL {kl_divergence(reference_logits, logits):.5f}  top-1 "
          f"{100 * top1_agreement(reference_logits, logits):.1f} %")


def main() -> None:
    torch.set_num_threads(1)     # tiny ops: threads only contend
    config = KimiK26Config.tiny().replace(num_hidden_layers=3)
    reference = init_random_weights_(KimiK26ForCausalLM(config, dtype=torch.float32), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    # 4096 calibration tokens: ~1024 rows per expert (top-4 of 16) for K = 256 inputs. With a quarter of that,
    # GPTQ fits the calibration inputs too closely and does worse than rtn on other text (docs/recipes.md "GPTQ")
    calibration = [torch.randint(3, config.vocab_size, (4, 64), generator=g) for _ in range(16)]
    held_out = torch.randint(3, config.vocab_size, (8, 64), generator=g)
    with torch.no_grad():
        ref = reference(held_out).float()

    rtn = quantize_(copy.deepcopy(reference), QuantPlan({EXPERTS: Int4Group(32)}))
    compare("rtn", rtn, ref, held_out)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(reference, f"{tmp}/src")
        subprocess.run([sys.executable, "-m", "mla_quant.convert", f"{tmp}/src", f"{tmp}/mse", "--method", "mse",
                        "--device", "cpu", "--quiet", "--no-compare"], check=True, capture_output=True)
        compare("mse", from_pretrained(f"{tmp}/mse", dtype=torch.float32).eval(), ref, held_out)

        gptq = copy.deepcopy(reference)
        rows = gptq_(gptq, calibration)                 # layer by layer, each on the quantized layers' outputs
        compare("gptq (in memory)", gptq, ref, held_out)
        ordered = copy.deepcopy(reference)
        gptq_(ordered, calibration, act_order=True)
        compare("gptq act-order", ordered, ref, held_out)
        mean = {m: sum(r[m]["out_sqnr_db"] for r in rows) / len(rows) for m in ("rtn", "gptq")}
        print(f"output SQNR on the calibration inputs, mean of {len(rows)} expert weights "
              f"({sum(r['tokens'] for r in rows) / len(rows):.0f} rows each on average): "
              f"rtn {mean['rtn']:.2f} dB, gptq {mean['gptq']:.2f} dB")

        # the file path: Hessians of the source model, saved; the converter reads them tensor by tensor
        with HessianCollector(reference, r"mlp\.experts\.") as hc:
            with torch.no_grad():
                for ids in calibration:
                    reference(ids)
        hc.save(Path(tmp) / "hessians.safetensors")
        done = subprocess.run([sys.executable, "-m", "mla_quant.convert", f"{tmp}/src", f"{tmp}/gptq", "--method",
                               "gptq", "--hessians", f"{tmp}/hessians.safetensors", "--device", "cpu", "--quiet"],
                              check=True, capture_output=True, text=True)
        print(done.stdout.strip())
        compare("gptq (converted)", from_pretrained(f"{tmp}/gptq", dtype=torch.float32).eval(), ref, held_out)


if __name__ == "__main__":
    main()
