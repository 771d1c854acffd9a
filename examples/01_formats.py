"""Quantize a real-sized Kimi K2.6 routed expert weight ([2048, 7168]) to each weight format and print
its bytes and SQNR, on Gaussian and on heavy-tailed (Student-t, 3 dof) weights. Runs on the CPU in seconds.

    python examples/01_formats.py
"""
import torch

from mla_quant.formats import BF16, FP8Block, Int4Group
from mla_quant.testing import realistic_tensor, sqnr_db


def main(n: int = 2048, k: int = 7168) -> None:
    formats = [BF16(), FP8Block(), Int4Group(32), Int4Group(64), Int4Group(128)]
    print(f"weight [{n}, {k}] (a Kimi K2.6 routed expert's gate_proj)")
    print(f"{'format':<16} {'MB':>7} {'bits/w':>7} {'x bf16':>7} {'SQNR gauss':>11} {'SQNR heavy':>11}")
    base = BF16().nbytes(n, k)
    weights = {"gauss": realistic_tensor((n, k), seed=0, outlier_frac=0.0) * 0.02,
               "heavy": realistic_tensor((n, k), seed=1, heavy_tail=True, outlier_frac=0.0) * 0.02}
    for fmt in formats:
        sq = {}
        for name, w in weights.items():
            w_ref = w.to(torch.bfloat16).float()  # the checkpoint's bf16 weight is the reference
            deq = fmt.dequantize(fmt.quantize(w_ref) if not isinstance(fmt, BF16) else {"weight": w_ref}, torch.float32)
            sq[name] = sqnr_db(w_ref, deq)
        nbytes = fmt.nbytes(n, k)
        label = f"int4 g{fmt.group_size}" if isinstance(fmt, Int4Group) else fmt.name
        print(f"{label:<16} {nbytes / 1e6:7.2f} {8 * nbytes / (n * k):7.3f} {nbytes / base:7.3f} "
              f"{sq['gauss']:10.2f}dB {sq['heavy']:10.2f}dB")


if __name__ == "__main__":
    main()
