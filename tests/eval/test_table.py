"""The fidelity-table script runs end to end on the tiny random model (a smoke run of docs/fidelity.md's
command) and orders the formats as expected."""
from __future__ import annotations

import json

import torch

from mla_quant.eval.table import main


def test_table_smoke(tmp_path, capsys):
    torch.save(torch.randint(0, 512, (400,)), tmp_path / "tokens.pt")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main(["--contexts", "40", "--eval-tokens", "8", "--page-size", "8", "--batch", "2", "--device", "cpu",
              "--tokens", str(tmp_path / "tokens.pt"), "--json", str(tmp_path / "t.json"),
              "--variants", "kv bf16", "kv fp8_e4m3 per-token", "kv fp8_e4m3 per-tensor", "experts int4 rtn"])
    finally:
        torch.set_num_threads(before)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert all(r["context"] == 40 and r["positions"] == 16 for r in rows.values())
    assert rows["kv bf16"]["kl"] < 1e-3 < rows["kv fp8_e4m3 per-token"]["kl"] < 0.2
    assert 0 < rows["kv fp8_e4m3 per-tensor"]["kl"] < 0.2 and 0 < rows["experts int4 rtn"]["kl"] < 0.2
    assert "| kv bf16 | 40 |" in capsys.readouterr().out


def test_table_extra_checkpoint(tmp_path, capsys):
    """A checkpoint made elsewhere joins the table: the reference saved as is gives KL 0."""
    from mla_quant.eval.table import load_reference, parse_args
    from mla_quant.models import save_pretrained

    save_pretrained(load_reference(parse_args([]), torch.device("cpu")), tmp_path / "same")
    main(["--contexts", "24", "--eval-tokens", "4", "--page-size", "8", "--device", "cpu", "--variants", "kv bf16",
          "--extra", f"same={tmp_path / 'same'}", "--json", str(tmp_path / "t.json")])
    rows = {r["variant"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert rows["same"]["kl"] == 0.0 and rows["same"]["top1"] == 1.0


def test_table_glm_indexer_fp8(tmp_path):
    """--arch glm: the FP8 indexer row on a tiny random GLM 5.2 (top-k 8 < context 24: the selection acts)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        main(["--arch", "glm", "--contexts", "24", "--eval-tokens", "8", "--page-size", "8", "--batch", "1",
              "--device", "cpu", "--variants", "indexer fp8", "kv bf16", "--json", str(tmp_path / "t.json")])
    finally:
        torch.set_num_threads(before)
    rows = {r["variant"]: r for r in json.loads((tmp_path / "t.json").read_text())["rows"]}
    assert 0 <= rows["indexer fp8"]["kl"] < 0.5 and rows["kv bf16"]["kl"] < 1e-3
