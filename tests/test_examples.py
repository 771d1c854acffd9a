"""The examples and the main job run as scripts (a subprocess each, with a time limit) and print what they
promise. Examples tested elsewhere: 05, 06, 06b (tests/test_recipe_examples.py); 08 needs torchrun."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# generous: the shared CPU is slow (each takes a few seconds alone); on a GPU host the Triton compiles dominate
# (examples/02 took 144 s alone on the H200 host, autotuning included, and timed out beside 14 test workers)
TIMEOUT_S = 900 if torch.cuda.is_available() else 240


def run(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+\.\d+", line)]


def line_of(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def test_02_mla_module():
    out = run("examples/02_mla_module.py")
    assert min(numbers(line_of(out, "bf16"))) > 40                    # only the latents' bf16 rounding
    for kv in ("fp8_e4m3", "fp8_ds_mla"):
        assert 20 < min(numbers(line_of(out, kv))) < 40


def test_03_dsa_module():
    out = run("examples/03_dsa_module.py")
    sqnr_prefill, sqnr_decode, same = numbers(line_of(out, "bf16     bf16"))
    assert sqnr_prefill > 40 and sqnr_decode > 40 and same == 100.0
    assert len([line for line in out.splitlines() if line.startswith(("bf16 ", "fp8 "))]) == 4


def test_04_paged_fp8_decode():
    out = run("examples/04_paged_fp8_decode.py")
    rows = {kv: line_of(out, kv).split() for kv in ("bf16", "fp8_e4m3", "fp8_ds_mla")}
    assert int(rows["fp8_e4m3"][3]) > 1.9 * int(rows["bf16"][3])      # tokens in the same bytes
    assert "686,144" in out and "1,362,816" in out


def test_04b_page_tags_fault():
    out = run("examples/04b_page_tags_fault.py")
    assert "1 aborted" in out and out.count("same as the clean run") == 4
    assert "request 2: aborted after 3 tokens: page tag mismatch" in out
    assert "tags off: 0 aborted" in out


def test_09_research_loop():
    out = run("examples/09_research_loop.py")
    assert numbers(line_of(out, "all bf16"))[0] < numbers(line_of(out, "all fp8 "))[0]


def test_10_gptq_experts():
    """GPTQ (in memory and converted from saved Hessians) lands closer to the fp32 model than round-to-nearest on
    held-out tokens, and raises the experts' output SQNR on their calibration inputs."""
    out = run("examples/10_gptq_experts.py")
    rtn = numbers(line_of(out, "rtn "))[0]
    assert numbers(line_of(out, "gptq (in memory)"))[0] < rtn and numbers(line_of(out, "gptq (converted)"))[0] < rtn
    sqnr_rtn, sqnr_gptq = numbers(line_of(out, "output SQNR"))[-2:]
    assert sqnr_gptq > sqnr_rtn + 0.5
    assert "converted 96 weights with 'gptq'" in out


def test_main_job_with_a_fault():
    out = run("-m", "mla_quant", "--requests", "4", "--new-tokens", "6", "--inject-fault", "--no-progress")
    assert "two instances, KV handed off" in out and "hand-off" in out
    assert re.search(r"request 2 aborted: page tag mismatch", out) and "1 aborted" in out
    assert "finished: 3 at length" in out or "at a stop token" in out
    kl = numbers(line_of(out, "  all "))
    assert 0 < kl[0] < 0.5
    assert re.search(r"prefill +pool +bf16 ", out) and re.search(r"decode +pool +fp8_e4m3 ", out)


def test_main_job_help():
    out = run("-m", "mla_quant", "--help")
    for option in ("--requests", "--prompt-len", "--new-tokens", "--decode-kv", "--seed", "--device",
                   "--checkpoint", "--inject-fault"):
        assert option in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["01_formats.py", "07_load_checkpoint.py"])
def test_other_examples(name):
    run(f"examples/{name}")


def test_main_job_from_a_checkpoint(tmp_path):
    """--checkpoint loads a saved model (here: Kimi's release formats, INT4 experts); --json writes the
    measurements."""
    import json

    import torch

    from mla_quant.models import KimiK26Config, KimiK26ForCausalLM, init_random_weights_, save_pretrained

    model = KimiK26ForCausalLM(KimiK26Config.tiny(), dtype=torch.bfloat16, formats="checkpoint")
    save_pretrained(init_random_weights_(model, 3), tmp_path / "ckpt")
    out = run("-m", "mla_quant", "--checkpoint", str(tmp_path / "ckpt"), "--requests", "3", "--new-tokens", "4",
              "--decode-kv", "fp8_ds_mla", "--json", str(tmp_path / "m.json"))
    assert re.search(r"decode +pool +fp8_ds_mla ", out)
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["requests"] == 3 and m["stats"]["decode_tokens"] > 0 and 0 < m["kl_all"] < 0.5
    assert m["kv_bytes_per_token"]["decode"]["format"] == "fp8_ds_mla"
