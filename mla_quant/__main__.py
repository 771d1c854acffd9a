"""``python -m mla_quant``: the main job (see README)."""
import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "01_formats.py"), run_name="__main__")
