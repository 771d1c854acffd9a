"""Input checks shared by the kernel launchers: each failure names the argument."""
from __future__ import annotations

from collections.abc import Iterable

import torch


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Iterable[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            raise TypeError(f"{name}: dtype {t.dtype} not supported, expected one of {allowed}")
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed_nd:
            raise ValueError(f"{name}: expected {allowed_nd} dimensions, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (call .contiguous() first)")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"{name}: all tensors must be on one device ({listing})")
    return first


def check_divisible(name: str, value: int, by: int, what: str) -> None:
    if value % by:
        raise ValueError(f"{name}: {value} is not divisible by {what} {by}")
