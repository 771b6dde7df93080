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

import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.env import sync

__all__ = ["LightningLoop", "lightning_precision", "lightning_available"]


def lightning_available() -> bool:
    try:
        import lightning.fabric  # noqa: F401
    except Exception:
        return False
    return True


def lightning_precision(device: torch.device) -> str:
    """The Fabric precision a user picks for speed on `device` (see the module docstring)."""
    from torchspeed.train.precision import half_precision

    return {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(half_precision(device), "32-true")


class LightningLoop:
    """The training step a Lightning Fabric user writes; the same interface as `bench.hand.HandLoop`."""

    def __init__(self, model: nn.Module, loader: Iterable, device: torch.device, *, lr: float = 0.05,
                 momentum: float = 0.9, weight_decay: float = 5e-4, precision: str | None = None):
        from lightning.fabric import Fabric

        self.device, self.loader = device, loader
        self.precision = precision or lightning_precision(device)
        self.fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1,
                             precision=self.precision)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=True, weight_decay=weight_decay)
        self.model, self.opt = self.fabric.setup(model, opt)
        self.loss_sum = torch.zeros((), device=device)
        self.samples = 0
        self._it = None

    def _batches(self):
        while True:
            for x, y in self.loader:
                yield self.fabric.to_device(x), self.fabric.to_device(y)

    def restart(self) -> None:
        self._it = None
        self.loss_sum.zero_()
        self.samples = 0

    def run(self, n: int) -> float:
        if self._it is None:
            self._it = self._batches()
        self.model.train()
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = next(self._it)
            logits = self.model(x)  # Fabric runs the forward under its precision's autocast
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
            self.fabric.backward(loss)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.loss_sum += loss.detach().float() * y.shape[0]
            self.samples += y.shape[0]
        sync(self.device)
        return time.perf_counter() - t0

    def train_loss(self) -> float:
        return float(self.loss_sum.item()) / max(self.samples, 1)

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> float:
        self.model.eval()
        correct = total = 0
        for x, y in loader:
            x, y = self.fabric.to_device(x), self.fabric.to_device(y)
            correct += int((self.model(x).argmax(-1) == y).sum())
            total += y.numel()
        return correct / max(total, 1)
