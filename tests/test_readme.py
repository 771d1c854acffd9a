"""The README's commands and snippets stay true."""
import re
from pathlib import Path

README = (Path(__file__).parents[1] / "README.md").read_text()


def test_first_look_snippet_runs():
    block = re.search(r"## A first look\n\n```python\n(.*?)```", README, re.S).group(1)
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    assert tuple(ns["logits"].shape) == (2, 16, ns["cfg"].vocab_size)


def test_commands_match_ci():
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    for cmd in ("pip install torch==2.13.0", 'pip install -e ".[test,compat]"', "python -m pytest -q"):
        assert cmd in README and cmd in ci, cmd
