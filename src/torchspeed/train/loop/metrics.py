"""Metrics kept on the device (T13).

`loss.item()` every step makes the host wait for the accelerator to finish the step: a
sync point that empties the GPU's queue. `DeviceMeter` adds losses and correct counts into
device tensors and the loop reads them every N steps (`.compute()` is the only sync).

Example:
    >>> meter = DeviceMeter(device)
    >>> meter.update(loss.detach(), n=len(y), correct=(logits.argmax(1) == y).sum())
    >>> meter.compute()  # {'loss': ..., 'acc': ..., 'samples': ...}

`write_metrics` writes the per-epoch history as metrics.json and metrics.csv (atomic).
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import torch

from torchspeed._io import atomic_write_text, write_json

__all__ = ["DeviceMeter", "write_metrics", "jsonable", "train_accuracy", "TRAIN_COUNT_ELEMENTS", "TRAIN_ACC_EVERY"]

# The training loop's per-step correct count reads at most this many output elements (the batch's first samples:
# `batch.count_correct`): every sample of a classification batch up to 1M logits (1024 x 1000 classes), a bounded
# part of a dense output. A plain loop counts nothing; a language model's (8, 64, 50257) logits, counted whole, cost
# 11 ms a step on a 2-core EPYC (the cross-entropy's forward: 34 ms), its first 1M elements 0.4 ms.
TRAIN_COUNT_ELEMENTS = 1 << 20

# Where `train_acc` is only shown (no validation loader, nothing reads it: `train_accuracy`), one step in this many
# counts it (an epoch's first, then every 32nd): the argmax, compare and sum cost 35-40 us a step, 8-10% of a small
# MLP's 0.4 ms step on a 2-core EPYC (165 us of a small CNN's 2.9 ms); one step in 8 still cost 1-2% of it, one in 32
# under 0.5%, and a 32nd of the epoch's batches estimates the accuracy (the loss is still every step's).
TRAIN_ACC_EVERY = 32


class DeviceMeter:
    """Running sums of loss x samples and correct predictions, on the device.

    `correct` / `counted` are device tensors: for classification `counted` is the batch size
    (the default), per token for sequences (padding left out). A batch without `correct`
    (regression, a model that returns only its loss) adds to the loss alone. On the CPU the sums are host
    floats: reading a CPU tensor is not a sync, and a float add costs less than a kernel launch.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.host_reads = self.device.type == "cpu"  # a tensor's value is read without a sync: sums on the host
        self.accuracy_every = 1  # the training loop's steps that count correct predictions: one in this many, 0:
        # none (`train_accuracy`, `counts_now`)
        self.reset()

    def reset(self) -> None:
        self._loss = torch.zeros((), device=self.device, dtype=torch.float64)
        self._correct = torch.zeros((), device=self.device, dtype=torch.float64)
        self._counted = torch.zeros((), device=self.device, dtype=torch.float64)
        self._loss_host = self._correct_host = 0.0  # the sums read on the host (`host_reads`)
        self._counted_host = 0.0  # counts known on the host (one target per sample): no kernel per step
        self._n = 0
        self._has_acc = False
        self._steps = 0  # the steps `counts_now` was asked about this epoch

    def counts_now(self) -> bool:
        """Whether this training step counts correct predictions: never, every step, or the epoch's first and then
        one in `accuracy_every` (`train_accuracy`)."""
        if not self.accuracy_every:
            return False
        self._steps += 1
        return (self._steps - 1) % self.accuracy_every == 0

    def update(self, loss: torch.Tensor, *, n: int, correct: torch.Tensor | None = None,
               counted: torch.Tensor | int | None = None) -> None:
        # No .item() on an accelerator: the adds are queued on the device like any other kernel (in float64).
        host = self.host_reads and loss.numel() == 1
        if host:
            self._loss_host += loss.item() * n
        else:
            self._loss.add_(loss.detach(), alpha=n)
        self._n += n
        if correct is not None:
            if host and correct.numel() == 1:
                self._correct_host += correct.item()
            else:
                self._correct.add_(correct.detach())
            if isinstance(counted, torch.Tensor):
                self._counted.add_(counted.detach())
            else:
                self._counted_host += float(n if counted is None else counted)
            self._has_acc = True

    @property
    def samples(self) -> int:
        return self._n

    def compute(self) -> dict[str, float | None]:
        """Read the means (one host-device sync)."""
        if self._n == 0:
            return {"loss": float("nan"), "acc": None, "samples": 0}
        loss = (self._loss.item() + self._loss_host) / self._n
        counted = self._counted.item() + self._counted_host if self._has_acc else 0.0
        acc = (self._correct.item() + self._correct_host) / counted if counted else None
        return {"loss": loss, "acc": acc, "samples": self._n}

    def state_dict(self) -> dict:
        """The running sums, on the CPU (for checkpoints: a resumed epoch continues its averages)."""
        return {"loss": self._loss.cpu() + self._loss_host, "correct": self._correct.cpu() + self._correct_host,
                "counted": self._counted.cpu() + self._counted_host, "n": self._n, "has_acc": self._has_acc}

    def load_state_dict(self, state: dict) -> None:
        self._loss.copy_(state["loss"])
        self._correct.copy_(state["correct"])
        self._counted.copy_(state["counted"])
        self._loss_host = self._correct_host = self._counted_host = 0.0
        self._n, self._has_acc = int(state["n"]), bool(state["has_acc"])


def train_accuracy(setting: bool | str, *, val_loader, best_metric: str | None, callbacks) -> int:
    """One step in how many counts correct predictions (the epoch row's `train_acc`); 0: none.

    "auto": every step when `best_metric` or a callback's `metric` reads `train_acc`; one step in
    `TRAIN_ACC_EVERY` (an estimate, shown) when the run has no validation loader; else none. With a validation
    loader `val_acc` is the accuracy, as fastai, timm's train script and Hugging Face's Trainer report it: the
    per-step argmax, compare and sum (three kernels a step, 8-10% of a small model's step) are left out and
    `train_acc` is None. True / False: every step / never. A step counts the batch's first samples up to
    `TRAIN_COUNT_ELEMENTS` output elements: exact for classification batches, an estimate from each batch's first
    samples on a dense output (per-pixel or per-token logits)."""
    if setting != "auto":
        return int(bool(setting))
    if best_metric == "train_acc" or any(getattr(cb, "metric", None) == "train_acc" for cb in callbacks):
        return 1
    return TRAIN_ACC_EVERY if val_loader is None else 0


def jsonable(d: dict) -> dict:
    """`d` with every value JSON can hold (others as their str)."""
    return json.loads(json.dumps(d, default=_plain))


def _plain(obj):
    return obj.to_dict() if hasattr(obj, "to_dict") else str(obj)


def write_metrics(out_dir: str | os.PathLike, history: list[dict], *, decisions: dict, config: dict) -> None:
    """metrics.json (history, decisions, config) and metrics.csv (one row per epoch), written atomically."""
    out = Path(out_dir)
    write_json(out / "metrics.json", {"history": history, "decisions": jsonable(decisions), "config": config})
    keys = list(dict.fromkeys(k for row in history for k in row))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(history)
    atomic_write_text(out / "metrics.csv", buf.getvalue())
