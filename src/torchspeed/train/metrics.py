"""Metrics kept on the device (T13).

`loss.item()` every step makes the host wait for the accelerator to finish the step: a
sync point that empties the GPU's queue. `DeviceMeter` adds losses and correct counts into
device tensors and the loop reads them every N steps (`.compute()` is the only sync).

Example:
    >>> meter = DeviceMeter(device)
    >>> meter.update(loss.detach(), n=len(y), correct=(logits.argmax(1) == y).sum())
    >>> meter.compute()  # {'loss': ..., 'acc': ..., 'samples': ...}
"""

from __future__ import annotations

import torch

__all__ = ["DeviceMeter"]


class DeviceMeter:
    """Running sums of loss x samples and correct predictions, on the device."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        self._loss = torch.zeros((), device=self.device, dtype=torch.float64)
        self._correct = torch.zeros((), device=self.device, dtype=torch.float64)
        self._n = 0
        self._n_acc = 0

    def update(self, loss: torch.Tensor, *, n: int, correct: torch.Tensor | None = None) -> None:
        # No .item() here: the add is queued on the device like any other kernel.
        self._loss += loss.detach().to(torch.float64) * n
        self._n += n
        if correct is not None:
            self._correct += correct.detach().to(torch.float64)
            self._n_acc += n

    @property
    def samples(self) -> int:
        return self._n

    def compute(self) -> dict[str, float | None]:
        """Read the means (one host-device sync)."""
        if self._n == 0:
            return {"loss": float("nan"), "acc": None, "samples": 0}
        loss = self._loss.item() / self._n
        acc = self._correct.item() / self._n_acc if self._n_acc else None
        return {"loss": loss, "acc": acc, "samples": self._n}
