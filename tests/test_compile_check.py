"""``benchmarks/compile_check.py``: its pure checks, (slow) a real sm_90 compile of two cheap ops, and the ws FP8 GEMM's
wgmma pipeline in the sm_90 SASS (``benchmarks.fp8_gemm_sass``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compile_check import HOPPER_SMEM_LIMIT, OPS, Compiled, kernels_pkg_ops, parse_ptxas_log, smem_error

ROOT = Path(__file__).resolve().parents[1]

PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_moe_gemm_kernel' for 'sm_90a'
ptxas info    : Function properties for _moe_gemm_kernel
    1048 bytes stack frame, 1040 bytes spill stores, 1096 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 400 bytes cmem[0]
ptxas info    : Compile time = 22.536 ms
"""


def test_smem_limit_fails_only_past_the_hopper_block_limit():
    config = {"BLOCK_N": 64, "BLOCK_K": 128, "num_stages": 3}
    assert smem_error(Compiled("_moe_gemm_kernel", config, HOPPER_SMEM_LIMIT)) is None
    err = smem_error(Compiled("_moe_gemm_kernel", config, 245760))  # the fused-MoE tile the tool found
    assert err is not None and "_moe_gemm_kernel" in err and "245760" in err and "'BLOCK_K': 128" in err
    assert smem_error(Compiled("k", {}, 1000), limit=999) is not None


def test_parse_ptxas_log():
    assert parse_ptxas_log(PTXAS_LOG) == (255, 1040 + 1096)
    assert parse_ptxas_log(PTXAS_LOG.replace("1040 bytes spill stores, 1096", "0 bytes spill stores, 0")) == (255, 0)
    assert parse_ptxas_log("ptxas fatal   : Unsupported .version 9.4") == (None, None)


def test_every_op_folder_has_compile_cases():
    assert set(kernels_pkg_ops()) == set(OPS)


@pytest.mark.slow
def test_compiles_topk_and_kv_append_for_sm90():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_check", "topk", "kv_append"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for op in ("topk", "kv_append"):
        line = next((ln for ln in lines if ln.startswith(f"OK   {op}:")), None)
        assert line is not None, done.stdout
        assert " 0 kernels" not in line, line  # the launchers really took the Triton path


def test_rows_gemv_with_unaligned_activations_compiles_for_sm90():
    """The one-token rows GEMV with x not 16-byte aligned (its scalar activation loads, ``load_k`` with no mask)
    compiles for sm_90 (fake Hopper, a subprocess): the CPU interpreter runs it either way, and before session 30
    this path failed only on the GPU ("`other` cannot be provided without `mask`"). So does the half2 GEMV's path for
    such an x (a pair_order launch, then the GEMV on pairs)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_check", "w4a16_gemm", "-k", "unaligned",
                           "--no-ptxas"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK   w4a16_gemm: 3 cases, 4 kernels" in done.stdout, done.stdout


def test_mla_decode_tiles_get_num_stages_minus_one_buffers_on_sm90():
    """Compiled for sm_90 (fake Hopper, a subprocess): the bf16 decode's latent tile gets num_stages - 1 shared-memory
    buffers — the guard on the block table read per chunk of tiles (a page lookup back in the tile loop makes the
    pipeliner keep one, whatever num_stages says) — and TMA_CONFIG's TMA and tail loops two each, also with the
    diagnostic timeline stamps on (PROBE: at least one %globaltimer read per stamp)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.mla_decode_sass", "--buffers"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    stamps = got.pop("probe_stamps")
    assert got == {"tma_config": [2, 2], "m16n32w8s3": [2], "m16n32w8s4": [3], "m16n64w8s2": [1],
                   "tma_config_probe": [2, 2]}, got
    assert stamps >= 7, stamps


def test_fragment_kernel_mma_operands_hold_one_element_per_thread_on_sm90():
    """Compiled for sm_90 (fake Hopper, a subprocess): every inline-asm ``mma.sync`` of the W4A16 fragment kernel takes
    and returns tensors of one element per thread with the lanes in order — the layout its hand-built fragments rely
    on (another layout would hand the MMA other lanes' registers) — at 1 and 2 token tiles and every autotuned tile,
    and nothing moves between threads before the last MMA (the fragments are never staged; only the split-K
    epilogue may be re-laid out for its stores, as Triton 3.9 does through shared memory)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gemv_sass", "--fragments"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert {k.split()[0] for k in got} == {"NT1", "NT2"}, got
    for tile, kernel in got.items():
        warps = kernel["num_warps"]
        one_per_thread = (f"#ttg.blocked<{{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}], "
                          "order = [0]}>")
        assert kernel["layouts"] == [one_per_thread], (tile, kernel)
        assert kernel["mma_ops"] > 0 and kernel["staged_before_mma"] == 0, (tile, kernel)


@pytest.mark.slow
def test_host_overhead_times_each_launcher_without_a_gpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", "fp8_linear", "--calls", "5"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("fp8_linear"))
    assert 0 < float(line.split()[1]) < 1e5, line


def _gluon_loop_counts(*flags: str) -> tuple[dict[str, int], int, int]:
    """``benchmarks.mla_decode_sass --gluon [flags]`` in a subprocess (fake Hopper, sm_90): the default setting's row
    -> (its per-attention-warp, per-tile instruction counts by column, registers at launch, spill bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.mla_decode_sass", "--gluon", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("setting")).split("|")[1].split()
    row = next(line for line in lines if line.startswith("ws "))
    regs, spills = (int(v) for v in row.split("|")[0].split()[1:3])
    return dict(zip(header[header.index("instr"):], (int(v) for v in row.split("|")[1].split()))), regs, spills


@pytest.mark.slow
def test_gluon_decode_reads_v_as_words_on_sm90():
    """Compiled for sm_90 (fake Hopper, a subprocess): the Gluon fp8 decode's tile loop per attention warp issues
    exactly its 136 mma.sync (72 score + 64 PV per 64-token tile), converts each e4m3 pair once (276 cvt), builds
    V's operand from 32-bit words (64 PRMT; Triton's own byte-wise lowering was 256 LDS.U8 + 256 PRMT) and the A
    operands of q and P' from whole fragments, without spills and within 128 registers at launch (two programs per
    SM)."""
    counts, regs, spills = _gluon_loop_counts()
    assert (counts["HMMA"], counts["F2FP"], counts["PRMT"]) == (136, 276, 64), counts
    # the A fragments of q and P' read as one LDS.128 each in mma.sync's register order (GLUON_Q_FRAG, GLUON_P_FRAG):
    # 997 instructions, 127 shared loads (q in the row layout: 1383, 163; P' by layout conversion: 1133)
    assert counts["instr"] < 1050 and counts["LDS"] < 140 and spills == 0 and regs <= 128, (counts, regs, spills)


@pytest.mark.slow
def test_gluon_decode_over_ds_mla_pages_on_sm90():
    """The same kernel over fp8_ds_mla pages (FlashMLA's rows): the same 136 mma.sync per attention warp and tile (4
    latent score dots scaled per tile, the rope dot in bf16, 4 PV dots), no spills, 128 registers at launch, and each
    token's four tile scales in one 16-byte load — 5 global loads per tile, not 17 (scalar loads read 0.84-1.01x BF16
    on the H200 where the vector loads read 0.75-0.82x)."""
    counts, regs, spills = _gluon_loop_counts("--scale", "ds_mla")
    assert counts["HMMA"] == 136 and counts["LDG"] <= 6, counts
    assert counts["instr"] < 1200 and spills == 0 and regs <= 128, (counts, regs, spills)


def test_fp8_gemm_ws_pairs_keep_one_wgmma_in_flight_on_sm90():
    """Compiled for sm_90 (fake Hopper, a subprocess): with AHEAD each consumer group's pair of K blocks keeps the
    second wgmma in flight while the first product is promoted — a ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` in the SASS and no
    ptxas C7514 note (the loop-carried form was serialized to 0x0 waits); without AHEAD every wait is 0x0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.fp8_gemm_sass"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["form"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    for form in ("128x128 AHEAD", "KSPLIT AHEAD", "128x128 AHEAD PAIR_SLOTS", "KSPLIT AHEAD PAIR_SLOTS"):
        assert 1 in rows[form]["depbar"] and "C7514" not in rows[form]["ptxas"], rows[form]
    for form in ("128x128", "KSPLIT"):
        assert set(rows[form]["depbar"]) == {0}, rows[form]


def _pdl_audit(op: str, case: str, out: Path) -> list[dict]:
    """``benchmarks.pdl_sass op -k case`` in a subprocess (fake Hopper, sm_90): its rows, none an error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.pdl_sass", op, "-k", case, "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())
    assert not [r for r in rows if "error" in r], rows
    return rows


def test_one_token_gemvs_read_only_weights_before_their_pdl_wait_on_sm90(tmp_path):
    """Compiled for sm_90 (fake Hopper, a subprocess; ``benchmarks.pdl_sass``): with prefetch_weights the rows and the
    half2 GEMV put no float arithmetic before their ``griddepcontrol.wait`` (nothing on x can run before the kernel
    before has written it; with x read by ``ld.global.nc`` ptxas had hoisted 663-860 float ops and 20-39 loads above
    the wait), the rows GEMV has no ``.nc`` load after the wait in its PTX (x is read coherently), and the half2
    GEMVs — dense and fused_moe's — load their first weights before the wait (as ``.nc`` loads ptxas had sunk them
    below it: the gate-up prefetched nothing)."""
    rows = [r for r in _pdl_audit("w4a16_gemm", "prefetch=True", tmp_path / "gemv.json")
            if r["kernel"].startswith("_w4a16_gemv")]
    assert {r["kernel"] for r in rows} == {"_w4a16_gemv_kernel", "_w4a16_gemv_half2_kernel"}, rows
    for r in rows:  # before the wait: addresses and weight loads (a one-chunk half2 tile: 32 loads, ~15 %)
        assert r["fma_before"] <= 2 and r["wait_at"] < 0.25 * r["instructions"], r
        assert r["coherent_before"] >= 8, r  # the prefetched weights, both GEMVs
        if r["kernel"] == "_w4a16_gemv_kernel" and not r["config"].get("PIPE"):
            assert r["ptx_nc_after_wait"] == 0, r  # (pipelined chunks load their later scales after it: weights)
    # fused_moe's one-token half2_prefetch launches (WEIGHTS_FIRST): the gate-up's first K block of words (8 loads,
    # gate and up, even and odd columns) before its main wait, and nothing on the activation pairs
    rows = [r for r in _pdl_audit("fused_moe", "act_quant=False T=1 x=bfloat16", tmp_path / "moe.json")
            if r["config"].get("WEIGHTS_FIRST")]
    assert {r["config"]["GATED"] for r in rows} == {True, False}, rows
    for r in rows:
        assert r["coherent_before"] >= (9 if r["config"]["GATED"] else 5) and r["constant_before"] == 0, r
        assert r["fma_before"] <= 6, r
