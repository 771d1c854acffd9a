"""KV-cache formats for MLA latents (one token of one layer = ``kv_lora_rank`` latent + ``rope_dim`` rope).

=============  ==============================================================================================
``bf16``       576 bf16 values: 1152 bytes per token and layer
``fp8_e4m3``   576 e4m3 values + a scale: per token (one fp32 each, 580 bytes) or per tensor (one fp32 for
               the layer, given or calibrated: 576 bytes) — the seed's 2× tokens
``fp8_ds_mla`` FlashMLA's 656-byte token: 512 e4m3 latent + 4 fp32 power-of-two scales (one per 128) +
               64 bf16 rope (unquantized)
=============  ==============================================================================================
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..kernels.kv_layout import KV_KINDS, KV_SCALES


@dataclass(frozen=True)
class KVFormat:
    kind: str = "bf16"
    scale: str = "token"  # fp8_e4m3 only: "token" (one fp32 per token) or "tensor" (one per layer)

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise ValueError(f"KVFormat: kind {self.kind!r} not in {KV_KINDS}")
        if self.scale not in KV_SCALES:
            raise ValueError(f"KVFormat: scale {self.scale!r} not in {KV_SCALES}")

    @classmethod
    def parse(cls, value: "KVFormat | str") -> "KVFormat":
        return value if isinstance(value, KVFormat) else cls(value)

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    def bytes_per_token(self, kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
        """Bytes one token occupies in one layer's pages."""
        d = kv_lora_rank + rope_dim
        if self.kind == "bf16":
            return 2 * d
        if self.kind == "fp8_e4m3":
            return d + (4 if self.scale == "token" else 0)
        if kv_lora_rank % 128:
            raise ValueError(f"fp8_ds_mla: kv_lora_rank {kv_lora_rank} must be a multiple of 128")
        return kv_lora_rank + 4 * (kv_lora_rank // 128) + 2 * rope_dim

    def to_dict(self) -> dict:
        return {"format": "KVFormat", **dataclasses.asdict(self)}
