"""benchmarks.common.write_results: a partial run (``python -m benchmarks --only ...``) merges into the results file
instead of dropping the rows and notes of earlier runs."""
import json

from benchmarks import common
from benchmarks.common import Context, write_results


def _row(bench, case, us, **extra):
    return {"bench": bench, "case": case, "median_us": us, **extra}


def _file(tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({
        "meta": {"commit": "aaa", "device": "NVIDIA H200", "copy_tbps": 4.2, "bf16_tflops": 700.0,
                 "notes": ["session 1: the first run"]},
        "cases": [_row("mla_decode", {"kv": "bf16", "batch": 1}, 10.0),
                  _row("mla_decode", {"kv": "bf16", "batch": 64}, 90.0),
                  _row("gemm", {"m": 1}, 5.0, commit="bbb")]}))
    return path


def test_partial_run_merges_rows_and_keeps_notes(tmp_path, monkeypatch):
    """The re-timed case is replaced and names the new commit; the same bench's other case, the other bench and the
    earlier notes stay, rows from the earlier full run take its commit; the per-bench writes of one run leave one
    note for it."""
    monkeypatch.setattr(common, "_git_commit", lambda: "ccc")
    path = _file(tmp_path)
    ctx = Context(copy_tbps=4.25, bf16_tflops=710.0, notes=["a bench's note"])
    fresh = [_row("mla_decode", {"batch": 64, "kv": "bf16"}, 80.0)]  # (same case, keys in another order)
    write_results(path, ctx, fresh, replace_benches={"mla_decode"})
    write_results(path, ctx, fresh + [_row("e2e_decode", {"c": 1}, 1800.0)],
                  replace_benches={"mla_decode", "e2e_decode"})
    doc = json.loads(path.read_text())
    rows = {(c["bench"], json.dumps(c["case"], sort_keys=True)): c for c in doc["cases"]}
    assert len(doc["cases"]) == 4
    assert rows[("mla_decode", '{"batch": 64, "kv": "bf16"}')] == {**fresh[0], "commit": "ccc"}
    assert rows[("mla_decode", '{"batch": 1, "kv": "bf16"}')]["commit"] == "aaa"
    assert rows[("gemm", '{"m": 1}')]["commit"] == "bbb"
    assert rows[("e2e_decode", '{"c": 1}')]["commit"] == "ccc"
    assert doc["meta"]["commit"] == "per-row" and doc["meta"]["copy_tbps"] == 4.2
    notes = doc["meta"]["notes"]
    assert notes[0] == "session 1: the first run" and len(notes) == 2
    assert notes[1].startswith("run of ccc on ") and "e2e_decode, mla_decode, 2 cases; a bench's note" in notes[1]


def test_full_run_writes_its_own_meta(tmp_path, monkeypatch):
    """Without --only (replace_benches None) the file is this run's alone."""
    monkeypatch.setattr(common, "_git_commit", lambda: "ddd")
    path = _file(tmp_path)
    write_results(path, Context(copy_tbps=4.2, bf16_tflops=700.0), [_row("gemm", {"m": 2}, 6.0)])
    doc = json.loads(path.read_text())
    assert doc["meta"]["commit"] == "ddd" and doc["meta"]["notes"] == []
    assert doc["cases"] == [_row("gemm", {"m": 2}, 6.0)]
