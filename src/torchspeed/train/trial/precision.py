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
from torchspeed.train.loop.step import backward, optimizer_step

__all__ = ["Precision", "MixedPrecision", "resolve_precision", "make_grad_scaler", "half_precision",
           "normalize_precision"]

_NO_AUTOCAST = contextlib.nullcontext()  # reusable: fp32 has no autocast to enter

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
            return _NO_AUTOCAST
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


class MixedPrecision:
    """The precision axis of one run, as one object (Lightning Fabric's precision-plugin shape): the
    autocast context, the backward (scaled for fp16), the unscale-clip-step-update, and the GradScaler
    with its state. Nothing else in the loop holds the scaler.

    Example:
        >>> amp = MixedPrecision(resolve_precision("auto", device="cuda"))
        >>> with amp.autocast():
        ...     loss = loss_fn(model(x), y)
        >>> amp.backward(loss)
        >>> skipped = amp.step(optimizer, clip_grad_norm=1.0, parameters=model.parameters())
    """

    def __init__(self, precision: Precision):
        self.precision = precision
        self.scaler = make_grad_scaler(precision)

    name = property(lambda self: self.precision.name)
    dtype = property(lambda self: self.precision.dtype)
    device_type = property(lambda self: self.precision.device_type)
    reason = property(lambda self: self.precision.reason)

    def autocast(self):
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, *, accum_steps: int = 1) -> None:
        backward(loss, scaler=self.scaler, accum_steps=accum_steps)

    def step(self, optimizer: torch.optim.Optimizer, *, clip_grad_norm: float | None = None,
             parameters=None, closure=None, **options) -> torch.Tensor:
        """Unscale once, clip, step, update (`options`: `optimizer_step`'s `clip_grad_value`, `before_step`); a
        0-d tensor: 1 if fp16's scaler skipped the step."""
        return optimizer_step(optimizer, scaler=self.scaler, clip_grad_norm=clip_grad_norm, parameters=parameters,
                              closure=closure, **options)

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)


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
    (the measured choice is `torchspeed.train.trial.switches`; this rule is its prior)."""
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
