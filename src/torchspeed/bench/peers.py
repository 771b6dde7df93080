"""Where users would otherwise go: a plain fp32 PyTorch loop and Lightning, as bench rows (T21, T23).

`torchspeed bench` shows, beside its own `naive` and `all` rows and the hand-written ceiling:

- `plain`: the loop most people write: fp32, NCHW, `torch.optim.SGD` as constructed by
  default, `zero_grad()`, the loss read once per round (`bench.hand.HandLoop` with default
  `HandSettings`). `all` must never be slower than this.
- `lightning`: Lightning Fabric with `precision="bf16-mixed"` where the hardware runs bf16
  natively (a CPU with AVX512-BF16/AMX, a CUDA sm80+ GPU), `"16-mixed"` on older GPUs and
  `"32-true"` elsewhere: what a Lightning user switches on for speed. Fabric rather than the
  full `Trainer`, so the row times the training step and not the Trainer's callbacks and
  logging; the precision plugin (autocast, loss scaling) is the same object the Trainer uses.
  Present when `lightning` is installed (the `dev` extra).

Example:
    >>> loop = LightningLoop(model, loader, device, lr=0.05)
    >>> seconds = loop.run(10)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from torchspeed.bench.hand import HandLoop, HandSettings
from torchspeed.train.trial.precision import half_precision

__all__ = ["LightningLoop", "lightning_precision", "lightning_available"]


def lightning_available() -> bool:
    try:
        import lightning.fabric  # noqa: F401
    except Exception:
        return False
    return True


def lightning_precision(device: torch.device) -> str:
    """The Fabric precision a user picks for speed on `device` (see the module docstring)."""
    return {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(half_precision(device), "32-true")


class LightningLoop(HandLoop):
    """The training step a Lightning Fabric user writes: `HandLoop`'s loop (the same data, loss and
    metrics) with Fabric's set-up, its autocast inside the module's forward, and `fabric.backward`."""

    def __init__(self, model: nn.Module, loader: Iterable, device: torch.device, *, lr: float = 0.05,
                 momentum: float = 0.9, weight_decay: float = 5e-4, precision: str | None = None):
        from lightning.fabric import Fabric

        super().__init__(model, loader, device, settings=HandSettings(), lr=lr, momentum=momentum,
                         weight_decay=weight_decay)
        self.precision = precision or lightning_precision(device)
        self.fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1,
                             precision=self.precision)
        opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum, nesterov=True,
                              weight_decay=weight_decay)  # torch's default kernel, as a Fabric user writes it
        self.model, self.opt = self.fabric.setup(self.model, opt)
        self.forward = self.model  # Fabric runs the forward under its precision's autocast

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)  # loss scaling for "16-mixed" happens here
        self.opt.step()
