"""Tensor and expert parallelism: TP, EP and TP+EP logits equal the single-process logits (fp32, relative
error < 1e-4; < 1e-3 through the bf16 pages, see TOL_PAGED) for tiny Kimi K2.6 (INT4 experts, FP8 everything
else) and GLM 5.2 (FP8 checkpoint formats, DSA) configs, through the plain forward and through prefill + decode over the paged cache; each rank holds
1/world of the sharded bytes; load_sharded reads only its slices; bad splits raise clear errors.

The processes run on gloo (CPU, forked) — or NCCL on ``cuda:rank`` with ``MLA_QUANT_DIST_BACKEND=nccl``
(``benchmarks/multi_gpu.sh``). All scenarios of one world size run in ONE process group (start-up is
the cost on a small CPU); each test asserts on its scenario's results.
"""
from __future__ import annotations

import pytest
import torch

from mla_quant import parallel
from mla_quant.models.saving import save_pretrained
from tests.parallel import dist_scenarios as S

TOL = 1e-4
# Prefill + decode through the paged cache rounds every cached latent to bf16, so a ~1e-7 change of the summation order
# (what TP's all-reduce is) flips the rounding of a few stored values: in one process, embeddings scaled by
# 1 + 1e-7 * randn moved these logits by 6e-6 - 2.3e-4 (plain forward: 1e-6), and TP read 3.9e-5 on the CI machine's
# CPU and 1.7e-4 on the H200 host's. A sharding bug moves them by O(1).
TOL_PAGED = 1e-3
WORLD2 = ([f"{k}:modes" for k in S.KINDS] + ["kimi:ep_local", "kimi:load_tp_ep", "glm:load_tp", "kimi:quantize",
                                              "errors"])
WORLD4 = [f"{k}:modes" for k in S.KINDS] + ["glm:tp_dp_ep"]


def _needs_devices(world: int) -> None:
    if S.backend() == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL run needs {world} GPUs, found {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    """The tiny models saved in the real checkpoint layout (the same weights every rank builds)."""
    out = {}
    for kind in ("kimi", "glm"):
        path = tmp_path_factory.mktemp(f"{kind}_ckpt")
        save_pretrained(S.build(kind), path, max_shard_bytes=2 * 2**20)  # several files
        out[kind] = str(path)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory, ckpts) -> list[dict]:
    _needs_devices(2)
    return S.launch(2, WORLD2, tmp_path_factory.mktemp("world2"), ckpts)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    _needs_devices(4)
    return S.launch(4, WORLD4, tmp_path_factory.mktemp("world4"))


def _results(ranks: list[dict], scenario: str) -> list[dict]:
    out = []
    for r, res in enumerate(ranks):
        got = res.get(scenario)
        assert got is not None, f"rank {r} did not run {scenario}"
        assert "exception" not in got, f"rank {r}, {scenario}:\n{got['exception']}"
        out.append(got)
    return out


def _check_mode(ranks: list[dict], scenario: str, mode: str, world: int) -> None:
    for r, res in enumerate(_results(ranks, scenario)):
        got = res[mode]
        assert got["plain"] < TOL, f"rank {r} {scenario} {mode}: plain logits rel err {got['plain']:.2e}"
        assert got["paged"] < TOL_PAGED, f"rank {r} {scenario} {mode}: prefill+decode logits rel err {got['paged']:.2e}"
        b = got["bytes"]
        assert b["split_full"] % world == 0
        assert b["held"] == b["expected"], f"rank {r} {scenario} {mode}: holds {b['held']} bytes, expected {b}"
        assert b["recorded_sharded"] * world == b["split_full"], f"rank {r} {mode}: {b}"
        assert b["storage"] == b["held"], f"rank {r} {mode}: a shard pins a larger storage ({b})"


@pytest.mark.parametrize("kind", S.KINDS)
@pytest.mark.parametrize("mode", S.MODES)
def test_logits_and_bytes_2_ranks(world2, kind, mode):
    _check_mode(world2, f"{kind}:modes", mode, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", S.KINDS)
@pytest.mark.parametrize("mode", S.MODES)
def test_logits_and_bytes_4_ranks(world4, kind, mode):
    _check_mode(world4, f"{kind}:modes", mode, 4)


def test_ep_local_tokens(world2):
    for r, res in enumerate(_results(world2, "kimi:ep_local")):
        assert res["plain"] < TOL, f"rank {r}: rel err {res['plain']:.2e}"


@pytest.mark.slow
def test_tp_pairs_with_ep_over_all(world4):
    for r, res in enumerate(_results(world4, "glm:tp_dp_ep")):
        assert res["plain"] < TOL, f"rank {r}: rel err {res['plain']:.2e}"


@pytest.mark.parametrize("scenario", ["kimi:load_tp_ep", "glm:load_tp"])
def test_load_sharded(world2, scenario):
    for r, res in enumerate(_results(world2, scenario)):
        assert not res["keys_differ"] and not res["extra_keys"], f"rank {r}: {res}"
        assert res["bytes_read"] == res["state_bytes"], f"rank {r}: read {res['bytes_read']} bytes, keeps " \
                                                        f"{res['state_bytes']}"
        assert res["plain"] < TOL


@pytest.mark.parametrize("mode", ["tp", "tp_ep"])
def test_quantize_commutes_with_sharding(world2, mode):
    for r, res in enumerate(_results(world2, "kimi:quantize")):
        got = res[mode]
        assert got["same_keys"] and not got["keys_differ"], f"rank {r}: {got}"
        # the split records follow the modules into their new formats
        assert got["sharded_bytes"][0] == got["sharded_bytes"][1] > 0, f"rank {r}: {got}"


@pytest.mark.parametrize("case, exc, words", [
    ("heads", ValueError, ["num_heads", "3 heads", "2 ranks"]),
    ("fp8_block", ValueError, ["q_b_proj", "FP8Block", "192 per rank", "128"]),
    ("int4_group", ValueError, ["down_proj", "Int4Group", "48 per rank", "groups of 32"]),
    ("vocab", ValueError, ["embed_tokens", "511"]),
    ("experts", ValueError, ["n_routed_experts", "15 experts"]),
    ("tokens", ValueError, ["tokens", "everywhere"]),
    ("tp_twice", RuntimeError, ["already tensor-parallel"]),
    ("ep_after_tp", RuntimeError, ["apply_ep first"]),
])
def test_bad_splits_raise(world2, case, exc, words):
    for res in _results(world2, "errors"):
        err = res[case]
        assert err["type"] == exc.__name__, err
        for w in words:
            assert w in err["message"], (w, err["message"])


def test_refused_split_leaves_model_untouched(world2):
    for res in _results(world2, "errors"):
        got = res["untouched"]
        assert got["same_shapes"] and got["records"] == 0 and set(got["heads"]) == {4}, got


def test_needs_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel.apply_tp(S.build_meta("kimi"))
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel.apply_ep(S.build_meta("kimi"))
