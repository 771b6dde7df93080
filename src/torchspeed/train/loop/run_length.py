"""How long a run is, in batches and optimizer steps, and how much of it is left after a resume.

The LR schedule (T14) spans the run's optimizer steps: epochs x ceil(batches per epoch /
grad_accum) (T19), capped by max_steps (`schedule.steps_in_run`). With a `BatchRamp` (T17:
batches growing over the run) the epochs differ in length, so the schedule spans the ramp's
true count of batches as one pass. The progress bar and the compile and switch trials count
micro-batches left: from the resumed (epoch, batch) to the end. `run_schedule` builds the
schedule over a run's steps (Schedule-Free AdamW: none, its own warm-up instead).

A loader without len() (a stream, an IterableDataset) has its run bounded by `max_steps`, and the
schedule spans those steps, so the stream is read again, pass after pass, until they are taken, as
Lightning's and Hugging Face's trainers do with `max_steps` (`RunLength.passes`). An iterator that
can be read only once (a generator) and runs out first ends the run there, with a warning that says
so (`ran_out`): its schedule was sized for steps it did not take.

Example:
    >>> length = RunLength(epochs=5, steps_per_epoch=100, grad_accum=2)
    >>> length.schedule_span()                       # (batches per epoch, epochs) for setup_schedule
    (100, 5)
    >>> length.batches_left(2, 40, total_steps=250, step=120)
    260
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torchspeed.train.batch_ramp import BatchRamp
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decision
from torchspeed.train.optim import is_schedule_free, set_schedule_free_warmup
from torchspeed.train.schedule import create_scheduler, schedule_label

__all__ = ["RunLength", "run_schedule", "ran_out"]


@dataclass(frozen=True)
class RunLength:
    """A run of `epochs` passes over a loader of `steps_per_epoch` batches (None: no len(), max_steps bounds it)."""

    epochs: int
    steps_per_epoch: int | None
    grad_accum: int = 1
    ramp: BatchRamp | None = None

    def schedule_span(self) -> tuple[int | None, int]:
        """(batches per epoch, epochs) the LR schedule spans; a ramp's whole run counts as one pass."""
        return (self.ramp.batches_in(self.epochs), 1) if self.ramp else (self.steps_per_epoch, self.epochs)

    def passes(self, max_steps: int | None) -> int:
        """Passes over the loader: `epochs`; for a loader without len() bounded by `max_steps`, as many as those
        steps take (the schedule spans them)."""
        return self.epochs if self.steps_per_epoch is not None or not max_steps else sys.maxsize

    def micro_batches_left(self, total_steps: int | None, step: int) -> int | None:
        """Micro-batches from optimizer step `step` to `total_steps` (None: unknown)."""
        return None if total_steps is None else (total_steps - step) * self.grad_accum

    def batches_left(self, start_epoch: int, start_batch: int, *, total_steps: int | None, step: int) -> int | None:
        """Batches from batch `start_batch` of epoch `start_epoch` to the end of the run."""
        if self.ramp:
            return self.ramp.batches_in(self.epochs - start_epoch, first_epoch=start_epoch) - start_batch
        if self.steps_per_epoch:
            return self.steps_per_epoch * (self.epochs - start_epoch) - start_batch
        return self.micro_batches_left(total_steps, step)


def ran_out(step: int, max_steps: int | None) -> str:
    """The warning for a loader without len() whose pass gave no batch before `max_steps` were taken."""
    return (f"the training data ran out after {step} optimizer steps, before max_steps={max_steps}: a new pass over "
            "the loader gave no batch (a generator or iterator is read once). The LR schedule was sized for "
            f"{max_steps} steps; pass a loader that can be read again (a DataLoader, a list of batches), or "
            f"max_steps={step}")


def run_schedule(optimizer, config: TrainConfig, total: int | None) -> tuple[object | None, Decision | None]:
    """(the LR scheduler over `total` optimizer steps, None; or None and the decision for Schedule-Free AdamW,
    which warms up by itself and has no schedule: T14's alternative)."""
    if is_schedule_free(optimizer):
        warm = set_schedule_free_warmup(optimizer, total, config.warmup_steps)
        return None, Decision(None, f"Schedule-Free AdamW: no LR schedule, {warm} warm-up steps")
    sched = create_scheduler(config.schedule, optimizer, total_steps=total, warmup_steps=config.warmup_steps,
                             min_lr=config.min_lr, interval=config.schedule_interval)
    if not callable(config.schedule):
        return sched, None
    when = "after each epoch" if config.schedule_interval == "epoch" else "after each optimizer step"
    return sched, Decision(schedule_label(config.schedule), f"yours: {type(getattr(sched, 'inner', sched)).__name__}, "
                                                            f"stepped {when}")
