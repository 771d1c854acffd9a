"""The GLM 5.2-shaped (DSA) fidelity pipeline: dense training forward with the indexer distilled beside it,
the dense reference of a sparse model, top-k overlap, the query-chunked plain attention for long contexts,
and the CPU smoke of train --arch glm -> fidelity_run -> benchmarks/fidelity_glm_session.sh."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_quant.eval import fidelity_run, sparse, train
from mla_quant.kernels.mla_prefill.reference import mla_prefill_reference

ROOT = Path(__file__).resolve().parents[2]


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, train.VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def test_glm_size_is_dsa_with_glm_schedule():
    cfg = train.model_config("glm-small")
    assert type(cfg).__name__ == "Glm52Config" and cfg.index_topk == 256 and cfg.vocab_size == 256
    assert cfg.indexer_types == ["full", "full", "shared", "shared", "shared", "full"]   # freq 4, offset 2
    assert train.parse_args(["--out", "x", "--arch", "glm", "--smoke"]).size == "glm-smoke"
    model = train.build_model("glm-smoke", seed=0, device=torch.device("cpu"))
    biases = {n: p for n, p in model.named_parameters() if n.endswith("k_norm.bias")}
    assert biases and all(not p.any() for p in biases.values())     # LayerNorm biases start at 0, not 1


def test_train_forward_is_the_dense_model_forward():
    """The training forward equals model(ids) while the context fits index_topk (DSA is dense there) and the
    model under dense_attention beyond it; outside that context the sparse model differs (top-k acts)."""
    model = train.build_model("glm-smoke", seed=1, device=torch.device("cpu")).eval()
    topk = model.config.index_topk
    short, long = _ids(2, topk), _ids(2, 3 * topk, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(train.train_forward(model, short), model(short), rtol=1e-4, atol=1e-4)
        got = train.train_forward(model, long)
        with sparse.dense_attention(model):
            torch.testing.assert_close(got, model(long), rtol=1e-4, atol=1e-4)
        assert (model(long) - got).abs().max() > 1e-3
    assert all(a.index_topk == topk for a in sparse._dsa_layers(model))   # restored


def test_indexer_distillation_trains_only_the_indexer():
    """The KL loss is >= 0, reaches every indexer weight and nothing else (detached inputs), and falls when
    only the indexer trains on it."""
    torch.manual_seed(0)
    model = train.build_model("glm-smoke", seed=2, device=torch.device("cpu"))
    ids = _ids(2, 40, seed=2)
    distill = train.IndexerDistillation(rows=2)
    train.train_forward(model, ids, distill)
    assert len(distill.groups) == 2 and [len(g["probs"]) for g in distill.groups] == [1, 2]   # full, full+shared
    loss = distill.loss()
    assert loss.item() > 0 and not distill.groups
    loss.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    want = {n for n, _ in model.named_parameters() if ".indexer." in n and not n.endswith("k_norm.bias")}
    assert want <= got and all(".indexer." in n for n in got)
    params = [p for n, p in model.named_parameters() if ".indexer." in n]
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        with torch.no_grad():
            train.train_forward(model, ids, distill)
        kl = distill.loss()
        kl.backward()
        opt.step()
        losses.append(kl.item())
    assert losses[-1] < 0.8 * losses[0]
    with pytest.raises(ValueError, match="rows"):
        train.IndexerDistillation(0)


def test_selection_overlap():
    a = torch.tensor([[3, 1, 2, -1], [0, 1, 2, 3]])
    assert sparse.selection_overlap(a, a.flip(-1)) == 1.0
    b = torch.tensor([[1, 5, -1, -1], [4, 5, 6, 7]])          # row 0: 1 of 2 used; row 1: none
    assert sparse.selection_overlap(a, b) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="other"):
        sparse.selection_overlap(a, b[:1])


def test_chunked_prefill_is_the_same_attention():
    """Chunks of queries, each with the keys it sees, give the unchunked rows: ragged sequences, a cached
    prefix (fewer queries than keys), causal and not; and the model's plain forward is unchanged."""
    from mla_quant.modules import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(13, 2, 8, generator=g), torch.randn(20, 2, 8, generator=g), torch.randn(20, 2, 4, generator=g)
    cu_q, cu_k = torch.tensor([0, 6, 13], dtype=torch.int32), torch.tensor([0, 9, 20], dtype=torch.int32)
    for causal in (True, False):
        want = mla_prefill_reference(q, k, v, cu_q, cu_k, 7, 0.3, causal)
        with sparse.chunked_prefill(max_bytes=4 * 2 * 11 * 2):     # 2 query rows per chunk
            got = attention.mla_prefill(q, k, v, cu_q, cu_k, 7, 0.3, causal, validate=False)
        for w, x in zip(want, got):
            torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-6)
    assert attention.mla_prefill is not None and attention.mla_prefill.__name__ == "mla_prefill"   # restored
    model = train.build_model("smoke", seed=0, device=torch.device("cpu")).eval()
    ids = _ids(2, 30)
    with torch.no_grad():
        want = model(ids)
        with sparse.chunked_prefill(max_bytes=4 * 2 * 30 * 4):
            torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)


def test_glm_smoke_train_then_fidelity(tmp_path, one_thread):
    """train --arch glm --smoke, then fidelity_run on it: every DSA variant at both contexts, the right
    references, the sparse selection costing something against the dense model, the FP8 indexer close to
    the full-precision one (high top-k overlap), BF16 pages ≈ exact."""
    run = tmp_path / "run"
    assert train.main(["--out", str(run), "--smoke", "--arch", "glm"]) == 0
    summary = json.loads((run / "train.json").read_text())
    assert summary["val_loss_saved"] < summary["unigram_val_windows_loss"] - 0.2
    kls = [r["indexer_kl"] for r in summary["log"] if "indexer_kl" in r]
    assert kls and all(k >= 0 for k in kls)
    cfg = json.loads((run / "model" / "config.json").read_text())
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["index_topk"] == 16
    assert summary["val_loss_sparse"] > 0 and summary["val_loss_dense_plain"] > 0

    out = tmp_path / "fid"
    assert fidelity_run.main(["--smoke", "--checkpoint", str(run / "model"), "--out", str(out)]) == 0
    result = json.loads((out / "fidelity.json").read_text())
    rows = {(r["variant"], r["context"]): r for r in result["rows"]}
    assert set(rows) == {(n, c) for n in fidelity_run.DSA_DEFAULT for c in (48, 96)} and not result["skipped"]
    assert result["setting"]["dsa"]["index_topk"] == 16
    for c in (48, 96):
        sparse_row = rows["indexer bf16 sparse", c]
        assert sparse_row["reference"] == "dense" and sparse_row["kl_all"] > 1e-4
        fp8 = rows["indexer fp8 sparse", c]
        assert fp8["reference"] == "sparse" and 0 < fp8["kl_all"] < rows["indexer bf16 sparse", c]["kl_all"]
        assert [i for i, _ in fp8["selection_overlap"]] == [0, 1]          # the full layers
        assert all(0.8 < o <= 1 for _, o in fp8["selection_overlap"])
        assert rows["kv bf16", c]["kl"] < 1e-4 and rows["kv bf16", c]["reference"] == "sparse"
        assert rows["kv bf16", c]["by_position"][-1][1] == c
    md = (out / "fidelity.md").read_text()
    assert "| indexer fp8 sparse | sparse | 96 | 1 |" in md and "overlap layer 1" in md
    with pytest.raises(ValueError, match="DSA"):
        fidelity_run.main(["--smoke", "--variants", "indexer fp8 sparse", "--out", str(tmp_path / "x")])


@pytest.mark.slow
def test_glm_session_script_smoke(tmp_path):
    """SMOKE=1 bash benchmarks/fidelity_glm_session.sh: the six files land in $OUT."""
    out = tmp_path / "out"
    env = dict(os.environ, SMOKE="1", OUT=str(out), RUN=str(tmp_path / "run"), PYTHON=sys.executable,
               OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "benchmarks/fidelity_glm_session.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = {"glm_train.log", "glm_train.json", "glm_fidelity.log", "glm_fidelity.json", "glm_fidelity.md"}
    assert names <= {p.name for p in out.iterdir()}, proc.stdout[-2000:]
    assert "train: exit 0" in proc.stdout and "fidelity: exit 0" in proc.stdout
    assert "| indexer fp8 sparse |" in (out / "glm_fidelity.md").read_text()
