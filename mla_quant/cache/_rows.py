"""A growable list of ints with a tensor copy kept in step: the allocator's per-request page lists and the
tracker's records. Element access uses the list; a step's tables are built with one tensor copy per row."""
from __future__ import annotations

from collections.abc import Iterable

import torch


class IntRow:
    __slots__ = ("values", "buf")

    def __init__(self, values: Iterable[int] = (), dtype: torch.dtype = torch.int32):
        self.values: list[int] = []
        self.buf = torch.empty(8, dtype=dtype)    # buf[:len(values)] == values
        self.extend(values)

    def view(self) -> torch.Tensor:
        """The values as a host tensor (a view: do not keep it across changes)."""
        return self.buf[:len(self.values)]

    def tolist(self) -> list[int]:
        return list(self.values)

    def extend(self, values: Iterable[int]) -> None:
        new = [int(v) for v in values]
        n, need = len(self.values), len(self.values) + len(new)
        if need > self.buf.numel():
            grown = torch.empty(max(need, 2 * self.buf.numel()), dtype=self.buf.dtype)
            grown[:n] = self.buf[:n]
            self.buf = grown
        if new:
            self.buf[n:need] = torch.tensor(new, dtype=self.buf.dtype)
        self.values.extend(new)

    def append(self, value: int) -> None:
        self.extend([value])

    def __getitem__(self, i):
        return self.values[i]

    def __setitem__(self, i: int, value: int) -> None:
        j = i + len(self.values) if i < 0 else i
        self.values[i] = int(value)   # raises IndexError out of range
        self.buf[j] = int(value)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return iter(self.values)

    def __eq__(self, other) -> bool:
        return self.values == list(other)

    def __repr__(self) -> str:
        return f"IntRow({self.values})"


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor -> ``device`` without a host sync: through pinned memory and an asynchronous copy on CUDA
    (the caching host allocator keeps the pinned buffer until the copy is done)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
