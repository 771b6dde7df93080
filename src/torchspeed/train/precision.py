"""Automatic mixed precision (T21).

`resolve_precision("auto")` picks bf16 autocast where the hardware runs it natively (CPUs
with AVX512-BF16 or AMX, CUDA sm80+), fp16 autocast with a GradScaler on older CUDA GPUs,
and fp32 elsewhere. bf16 keeps fp32's exponent range, so it needs no loss scaling; fp16
does, and the scaler skips steps whose gradients overflowed.

Cost: autocast changes numerics; the bench and the convergence tests check that training
still reaches the same accuracy.

Example:
    >>> p = resolve_precision("auto", device=torch.device("cpu"))
    >>> with p.autocast():
    ...     loss = loss_fn(model(x), y)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from torchspeed.env import DeviceCaps, detect

__all__ = ["Precision", "resolve_precision", "make_grad_scaler", "half_precision", "normalize_precision"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"32": "fp32", "float32": "fp32", "bfloat16": "bf16", "16": "fp16", "float16": "fp16",
            "bf16-mixed": "bf16", "16-mixed": "fp16"}


@dataclass(frozen=True)
class Precision:
    """One precision choice: the autocast dtype (None for fp32) and whether it needs loss scaling."""

    name: str
    device_type: str
    reason: str = ""

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES[self.name]

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self):
        """Context manager running the forward pass (and loss) in this precision."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def half_precision(device: torch.device | str, *, caps: DeviceCaps | None = None) -> str | None:
    """The half precision `device` runs natively: "bf16" (CUDA sm80+, CPUs with AVX512-BF16/AMX),
    "fp16" (older CUDA GPUs: Tensor Cores, no fast bf16), or None (a CPU without bf16 units, where
    emulated bf16 runs slower than fp32). The one home of this rule (fit, bench, hand loop, doctor);
    `caps` injects the device's capabilities (default: this machine's)."""
    return (caps or DeviceCaps.of(device)).half


def normalize_precision(precision: str) -> str:
    """"bf16-mixed" -> "bf16", "32" -> "fp32", ...; an unknown name is a ValueError."""
    key = _ALIASES.get(str(precision).lower(), str(precision).lower())
    if key != "auto" and key not in _DTYPES:
        raise ValueError(f"precision={precision!r} is not one of 'auto', 'fp32', 'bf16', 'fp16'")
    return key


def resolve_precision(precision: str = "auto", *, device: torch.device | str | None = None,
                      caps: DeviceCaps | None = None) -> Precision:
    """Turn "auto" | "fp32" | "bf16" | "fp16" into a `Precision` for `device` by the hardware rule
    (the measured choice is `torchspeed.train.switches`; this rule is its prior)."""
    device = torch.device(device) if device is not None else torch.device(detect().device)
    caps = caps or DeviceCaps.of(device)
    key = normalize_precision(precision)
    if key == "auto":
        half = caps.half
        if caps.device_type == "cuda":
            cc = caps.cuda_capability or (0, 0)
            why = "runs bf16 natively" if half == "bf16" else "has fp16 Tensor Cores but no fast bf16"
            return Precision(half, "cuda", f"CUDA sm{cc[0]}{cc[1]} {why}")
        if half == "bf16":
            return Precision("bf16", "cpu", "CPU has AVX512-BF16/AMX")
        return Precision("fp32", device.type, f"no fast half precision on {device.type}")
    return Precision(key, device.type, "asked for")


def make_grad_scaler(precision: Precision, **kwargs) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 (None otherwise: bf16 and fp32 need no loss scaling)."""
    if not precision.needs_scaler:
        return None
    return torch.amp.GradScaler(precision.device_type, **kwargs)
