"""``python -m mla_quant``: the main job — serve requests through the asymmetric recipe and print what was
measured (``python -m mla_quant --help``; docs/engine.md)."""
import sys

from mla_quant.engine.demo import main

if __name__ == "__main__":
    sys.exit(main())
