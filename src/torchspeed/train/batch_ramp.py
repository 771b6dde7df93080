"""Batch-size warm-up: batches that grow from a small size to a large one as training goes on (T17).

Early in training the gradient noise scale B_simple (`train/noise.py`) is small: a small batch
learns about as much per step as a large one, for fewer samples. B_simple grows as the loss
falls, and a batch that grows with it keeps each step near the critical batch size: fewer
optimizer steps than a small batch throughout, fewer samples than a large batch throughout
(McCandlish et al. 2018; batch-size warm-up from the noise scale trained a 1B-parameter LM in
43% fewer steps).

`BatchRamp` is a batch sampler for `DataLoader(dataset, batch_sampler=...)`. Its batches grow
linearly from `start` to `end` samples over the first `ramp_samples` samples of the run (each
size a multiple of `multiple`, so a compiled model sees few distinct shapes), then stay at
`end`. Sizes are a pure function of the epoch and the position in it, so a resumed run sees
the same batches, and `batches_in(epochs)` gives a schedule its exact number of steps.
`BatchRamp.from_noise_scale` sets `end` from a measured B_simple (`torchspeed tune noise`
prints one, with the line to use).

The LR follows the batch: `ramp.lr_factor(step, rule)` is the factor for the batch of `step`,
relative to the LR you set for `end` (the linear rule for SGD, the square root for the Adam
family: `schedule.lr_rule`, as the recipe's batch part uses). `BatchRampLR` applies it after each step on top
of any schedule; `torchspeed.fit` adds it by itself when the loader's batch sampler is a
`BatchRamp`, and makes the schedule span the ramp's true number of steps.

Where it pays: where a step of a larger batch costs little more time than a small one (a GPU
below saturation), fewer steps are less time. On a 2-core CPU samples/s hardly grows beyond
batch 64 (docs/recipe.md), so fewer steps there are not less time; docs/recipe.md has the
measurement.

Example:
    >>> ramp = BatchRamp(RandomSampler(ds), start=32, end=256, ramp_samples=20_000)
    >>> loader = DataLoader(ds, batch_sampler=ramp, num_workers=4)
    >>> torchspeed.fit(model, loader, epochs=10, lr=0.4)   # 0.4 is the LR for batches of 256
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sized

from torch.utils.data import Sampler

from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.decision import Decision
from torchspeed.train.schedule import batch_lr_factor, lr_rule

__all__ = ["BatchRamp", "BatchRampLR", "join_ramp"]


class BatchRamp(Sampler[list[int]]):
    """Batches of `sampler`'s indices growing from `start` to `end` over the first `ramp_samples` samples."""

    def __init__(self, sampler: Sampler[int] | Sized, *, start: int, end: int, ramp_samples: int,
                 multiple: int = 8, drop_last: bool = False):
        if start < 1 or end < start:
            raise ValueError(f"BatchRamp needs 1 <= start <= end, got start={start}, end={end}")
        if ramp_samples < 0 or multiple < 1:
            raise ValueError(f"ramp_samples must be >= 0 and multiple >= 1, got {ramp_samples} and {multiple}")
        if len(sampler) == 0:
            raise ValueError("BatchRamp: the sampler is empty (no samples to batch)")
        self.sampler, self.start, self.end, self.ramp_samples = sampler, start, end, ramp_samples
        self.multiple, self.drop_last = multiple, drop_last
        self.epoch = 0
        self._sizes: dict[int, list[int]] = {}

    @classmethod
    def from_noise_scale(cls, sampler: Sampler[int] | Sized, noise_scale: float, *, start: int, max_batch: int,
                         ramp_samples: int, multiple: int = 8, drop_last: bool = False) -> "BatchRamp":
        """A ramp from `start` to the critical batch size `noise_scale` (B_simple), kept within [start, max_batch]."""
        if not math.isfinite(noise_scale) or noise_scale <= 0:
            end = start  # no measurable noise yet: no evidence that larger batches pay
        else:
            end = min(max_batch, max(start, int(noise_scale) // multiple * multiple))
        return cls(sampler, start=start, end=end, ramp_samples=ramp_samples, multiple=multiple, drop_last=drop_last)

    # ------------------------------------------------------------------ sizes
    def size_at(self, seen: int) -> int:
        """The batch size after `seen` samples of the run."""
        if seen >= self.ramp_samples:
            return self.end
        size = self.start + (self.end - self.start) * seen / self.ramp_samples
        step = self.multiple if self.multiple <= self.start else 1
        return max(self.start, min(self.end, int(size) // step * step))

    def sizes(self, epoch: int | None = None) -> list[int]:
        """The batch sizes of one pass (`epoch`, default the current one); a pass starts at epoch x len(sampler)."""
        epoch = self.epoch if epoch is None else epoch
        if epoch not in self._sizes:
            n, pos, out = len(self.sampler), 0, []
            while pos < n:
                b = self.size_at(epoch * n + pos)
                if pos + b > n:
                    if self.drop_last:
                        break
                    b = n - pos
                out.append(b)
                pos += b
            self._sizes[epoch] = out
        return self._sizes[epoch]

    def batches_in(self, epochs: int, *, first_epoch: int = 0) -> int:
        """Batches in `epochs` passes from `first_epoch`: the run's length for its schedule."""
        return sum(len(self.sizes(e)) for e in range(first_epoch, first_epoch + epochs))

    def size_of_batch(self, index: int) -> int:
        """The size of the run's `index`-th batch (counted over every pass from epoch 0)."""
        for e in itertools.count():
            sizes = self.sizes(e)
            if index < len(sizes):
                return sizes[index]
            index -= len(sizes)
        raise AssertionError("unreachable")

    def lr_factor(self, index: int, rule: str = "linear") -> float:
        """The LR factor for the `index`-th batch, relative to the LR for `end` ("linear" or "sqrt")."""
        return batch_lr_factor(self.size_of_batch(index), self.end, rule)

    # ------------------------------------------------------------------ the Sampler protocol
    def set_epoch(self, epoch: int) -> None:
        """Which pass comes next (the trainer calls it; an own loop may leave it: passes count themselves)."""
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        indices = iter(self.sampler)
        for b in self.sizes():
            batch = list(itertools.islice(indices, b))
            if len(batch) < b:  # a sampler shorter than its len(): stop at what it gave
                if batch and not self.drop_last:
                    yield batch
                return
            yield batch
        self.epoch += 1  # a full pass: the next one continues the ramp (set_epoch overrides)

    def __len__(self) -> int:
        return len(self.sizes())

    def __repr__(self) -> str:
        return (f"BatchRamp(start={self.start}, end={self.end}, ramp_samples={self.ramp_samples}, "
                f"multiple={self.multiple})")


class BatchRampLR(Callback):
    """Scales each step's LR to its batch's size (the LR set, or scheduled, is the one for `ramp.end`).

    With a schedule, the factor multiplies the LR the schedule has just set; without one, the
    LR the run started with. `rule` None: from the optimizer (square root for the Adam family).
    """

    def __init__(self, ramp: BatchRamp, rule: str | None = None):
        self.ramp, self.rule = ramp, rule
        self._base: list[float] | None = None

    def _apply(self, trainer) -> None:
        opt = trainer.optimizer
        if self._base is None:
            self._base = [g["lr"] for g in opt.param_groups]
        rule = self.rule or lr_rule(opt)
        factor = self.ramp.lr_factor(trainer.step * trainer.config.grad_accum, rule)
        for g, base in zip(opt.param_groups, self._base):
            g["lr"] = (g["lr"] if trainer.scheduler is not None else base) * factor

    def on_train_start(self, trainer) -> None:  # after a resume: the base LR comes from the checkpoint
        self._apply(trainer)

    def state_dict(self) -> dict:
        return {"base_lr": self._base}

    def load_state_dict(self, state: dict) -> None:
        self._base = state.get("base_lr")

    def on_step_end(self, trainer) -> None:
        self._apply(trainer)


def join_ramp(loader, callbacks, optimizer, decisions: dict) -> "BatchRamp | None":
    """The loader's BatchRamp, if it has one: its LR scaling joins the trainer's `callbacks` (once) and the
    decision is recorded; None for a loader without one."""
    ramp = getattr(loader, "batch_sampler", None)
    if not isinstance(ramp, BatchRamp):
        return None
    if not any(isinstance(cb, BatchRampLR) for cb in callbacks):
        callbacks.add(BatchRampLR(ramp))
    decisions.refine("batch_ramp", Decision(
        f"{ramp.start}->{ramp.end}", f"the loader's BatchRamp over {ramp.ramp_samples:,} samples; the LR "
        f"scales with the batch ({lr_rule(optimizer)} rule, the LR set is the one for {ramp.end})"))
    return ramp
