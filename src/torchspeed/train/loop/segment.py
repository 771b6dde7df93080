"""Runs that go on: a finished run extended by a new schedule segment, and the best epoch restored (T14, T16).

- `extend_schedule`: resuming the last checkpoint of a finished run with more epochs keeps
  its weights, optimizer state (momentum), history and best epoch, and puts this run's
  optimizer settings back (its peak LR, weight decay, momentum: the old schedule left its
  last, annealed LR and its own keys in the param groups) before a new schedule over the
  added steps only. Without it, the old schedule's state would not fit the new length, and
  a run that had no schedule (too short for one-cycle) left no `initial_lr` for a new one.
- `start_schedule`: the first call's schedule over the run, its shape recorded; `record_stop`: a stop
  requested during the run, recorded (the Trainer applies; these write what happened).
- `BestEpoch`: the best epoch's record (by the checkpoint metric) and, with `restore_best`,
  its weights: a CPU copy taken when an epoch improves on every rank (no rank reads a
  best.pt that rank 0 may be writing), or best.pt for a best epoch from before a resume;
  loaded into the model at the end of `fit`. Cost: one copy of the weights per improvement. With Schedule-Free the
  copy is of its averaged weights (`view`), the ones evaluated and saved in best.pt.

Example:
    >>> defaults = group_settings(opt)                     # before the first schedule is built
    >>> sched, decision = extend_schedule(opt, defaults, config, done=120, total=200)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from torchspeed.train.state.checkpoint import load_checkpoint, update_best
from torchspeed.train.decision import Decision
from torchspeed.train.loop.run_length import run_schedule
from torchspeed.train.schedule import create_scheduler, schedule_label, steps_in_run

__all__ = ["group_settings", "extend_schedule", "schedule_for_call", "BestEpoch"]


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's settings (lr, weight_decay, momentum, ...) without its parameters."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def extend_schedule(optimizer: torch.optim.Optimizer, settings: list[dict], config, *, done: int,
                    total: int):
    """Put `settings` back into the param groups; (a `config.schedule` over steps done..total, its Decision)."""
    for g, s in zip(optimizer.param_groups, settings):
        for k in [k for k in g if k != "params"]:
            del g[k]  # the old schedule's keys (initial_lr, max_lr, ...) and its last LR
        g.update(s)
    sched = create_scheduler(config.schedule, optimizer, total_steps=total - done, warmup_steps=config.warmup_steps,
                             min_lr=config.min_lr, interval=config.schedule_interval)
    return sched, Decision(f"{done} -> {total} steps", f"a finished run extended: a new "
                                                       f"{schedule_label(config.schedule)} schedule segment over the "
                                                       f"{total - done} added steps")


def start_schedule(trainer, steps_per_epoch: int | None, epochs: int) -> None:
    """The run's LR schedule over epochs x steps (or max_steps), and its shape over the run recorded as a
    refinement of the plan's "schedule" (Schedule-Free's warm-up; your own scheduler)."""
    cfg = trainer.config
    trainer.total_steps = steps_in_run(steps_per_epoch, epochs, grad_accum=cfg.grad_accum, max_steps=cfg.max_steps)
    trainer._group_settings = group_settings(trainer.optimizer)  # a finished run extended gets them back
    trainer.scheduler, decision = run_schedule(trainer.optimizer, cfg, trainer.total_steps)
    if decision is not None:
        trainer.decisions.refine("schedule", decision)


def record_stop(decisions, reason: str) -> None:
    """A stop requested during the run (`Trainer.request_stop`): decisions["stopped"], the first reason kept."""
    decisions.setdefault("stopped", Decision(reason, "requested during the run"))


def schedule_for_call(trainer, span: tuple[int | None, int]) -> None:
    """The LR schedule for one `Trainer.fit` call over `span` (batches per epoch, epochs): built over the run at the
    first call; a later call on the same Trainer trains on from its step, so it gets a new segment of the run's
    schedule over its own steps (as a finished run resumed with more steps does), never the first call's
    schedule stepped past its end."""
    cfg = trainer.config
    if trainer.scheduler is None:
        return trainer.setup_schedule(*span)
    added = steps_in_run(span[0], span[1], grad_accum=cfg.grad_accum)
    if cfg.max_steps is not None or added is None or trainer.total_steps is None or \
            trainer.step + added <= trainer.total_steps or callable(cfg.schedule):
        return  # max_steps caps the whole run; an unknown length keeps the schedule; it still covers it; yours goes on
    total = trainer.step + added
    trainer.scheduler, extended = extend_schedule(trainer.optimizer, trainer._group_settings, cfg, done=trainer.step,
                                                  total=total)
    trainer.total_steps = total
    trainer.decisions.refine("extended", Decision(extended.value, f"a second fit of this Trainer: a new "
                                                  f"{schedule_label(cfg.schedule)} schedule segment over its "
                                                  f"{added} steps"))


class BestEpoch:
    """The best epoch so far (`record`, by the checkpoint metric) and, for `restore_best`, its weights: a CPU
    copy taken when it improves; best.pt is read back only for a best epoch from before a resume."""

    def __init__(self, metric: str | None, best_path: Path | None, view: Callable | None = None):
        self.metric, self.best_path = metric, best_path
        self.view = view or contextlib.nullcontext  # the weights as evaluated (Schedule-Free: its averaged ones)
        self.record: dict | None = None
        self.weights: dict | None = None
        self.active = False  # restore at the end of this fit (restore_best)

    def update(self, row: dict, step: int, module: nn.Module) -> bool:
        """Record the epoch `row` if it is the best so far; True when it is (best.pt is then due)."""
        self.record, improved = update_best(self.record, row, self.metric, step=step)
        if improved and self.active:  # in memory on every rank: no rank reads a best.pt another is writing
            with self.view():  # the weights just evaluated, not Schedule-Free's training iterate
                self.weights = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        return improved

    def restore(self, module: nn.Module, history: list[dict], decisions: dict) -> None:
        """Load the best weights into `module` and record it in `decisions` (when active and there is a best)."""
        best, weights = self.record, self.weights
        if not self.active or best is None:
            return
        if weights is None and self.best_path is not None and self.best_path.exists():
            weights = load_checkpoint(self.best_path)["model"]
        if weights is None:
            return
        module.load_state_dict(weights)
        last = history[-1]["epoch"] if history else None
        inside = f" (step {best['step']}, inside the epoch)" if best.get("mid_epoch") else ""  # eval_every
        decisions.refine("restored_best", Decision(f"epoch {best['epoch']} of {last}{inside}", f"{best['metric']} "
                                                   f"{best['value']:.4g}" + (", the last epoch" if best["epoch"] ==
                                                                              last and not inside else "")))
