"""The per-layer plan and asymmetric recipe examples run (they assert their own invariants: the plan
round-trips through checkpoint metadata; one instance equals the two pools bit for bit; two processes
equal one)."""
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["05_per_layer_plan.py", "06_asymmetric_recipe.py"])
def test_example_runs(name, capsys):
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    out = capsys.readouterr().out
    assert "True" in out or "bit for bit" in out


@pytest.mark.slow
def test_two_process_example_runs():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(EXAMPLES / "06b_two_pools_distributed.py")], capture_output=True,
                          text=True, timeout=600, cwd=EXAMPLES.parent, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bit for bit" in done.stdout
