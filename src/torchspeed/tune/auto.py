"""`fit(..., batch_size="auto", lr="auto", loader="auto")`: the tuners' measurements, applied to the user's own loader.

`fit` receives a DataLoader, so the tuned settings are applied by rebuilding it from its
dataset: the same sampler object (so shuffling, its generator and a DistributedSampler's
sharding are kept), the same collate_fn, drop_last, worker_init_fn and generator, with
the new batch size and the tuned worker settings.

- batch_size="auto": the one batch chooser (`tune.batch_choice.choose_run_batch`, the recipe's batch part's
  too, T17): on a run long enough to pay the measurement back, the batch with the least predicted time to a
  target; else the fastest batch `find_batch_size` measures, at most 1/16 of the dataset (an epoch keeps at least
  16 steps); or an int.
- lr="auto": the one LR chooser (`tune.lr_peak.choose_peak_lr`, which the recipe's LR part
  calls too) on the user's loader: the range test's one-cycle pick,
  refined by a short one-cycle trial of it and 2x, 4x, when the schedule is one-cycle;
  otherwise the range test's suggestion.
- lr="auto" is measured at the batch the run trains with (the tuned one, the loader rebuilt for
  it). When the batch changes, a given LR is scaled by the optimizer's rule
  (`schedule.scale_lr_for_batch`: linear for SGD, square root for the Adam family; T17), the
  same rule the recipe's batch part uses.
- loader="auto": `tune_loader` at the final batch size, with the model step as consumer.

Every choice and its reason goes into `FitResult.decisions`. Under torchrun the process group
is set up first, so each tuner measures on rank 0 and every rank gets the same decision. `fit`'s plan runs
each tuner as a stage of its own (`plan/tuners.py`: `tune_batch`, `tune_lr`, `tune_loader`, in that order), and
its last "before" stage rebuilds the loader once. For your own loop, `plan.make_plan(model, loader, TrainConfig(),
batch_size="auto", lr="auto", loader="auto")` runs the same stages and returns the loader, LR and decisions.

Example:
    >>> fit(model, loader, epochs=5, batch_size="auto", lr="auto", loader="auto")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from torchspeed.train.decision import Decision
from torchspeed.train.schedule import lr_rule, scale_lr_for_batch
from torchspeed.train.optim_candidate import candidate_optimizer
from torchspeed.tune.batch_choice import choose_run_batch
from torchspeed.tune.lr_peak import choose_peak_lr

__all__ = ["check_options", "scratch_optimizers", "tune_batch", "tune_lr",
           "tuned_loader"]


def check_options(train_loader: Iterable, *, batch_size: int | str | None, lr: float | str, loader: str | None) -> None:
    """The tuning options' mistakes as errors before the process group or any tuner starts: only "auto" (or a
    number) is a valid setting, and batch or loader tuning needs a torch DataLoader to rebuild."""
    if loader not in (None, "auto"):
        raise ValueError(f"loader={loader!r}: use loader='auto' or leave it out")
    if isinstance(batch_size, str) and batch_size != "auto":
        raise ValueError(f"batch_size={batch_size!r}: use an int, 'auto' or leave it out")
    if isinstance(lr, str) and lr != "auto":
        raise ValueError(f"lr={lr!r}: use a number or 'auto'")
    if (batch_size is not None or loader is not None) and not isinstance(train_loader, DataLoader):
        raise TypeError("batch_size/loader tuning rebuilds the torch DataLoader from its dataset; "
                        f"fit got a {type(train_loader).__name__}: pass a DataLoader or leave these options out")


def scratch_optimizers(model: nn.Module, optimizer: str | torch.optim.Optimizer, *, weight_decay: float | None,
                       options: dict | None) -> Callable[[float], torch.optim.Optimizer]:
    """The optimizer a tuner measures with, at an LR: the tuners restore what they touch; a user optimizer is used
    as is, a name gets a fresh one (`candidate_optimizer`)."""
    return lambda lr0: candidate_optimizer(optimizer, model, lr=lr0, weight_decay=weight_decay, options=options)


def tune_batch(model: nn.Module, train_loader: Iterable, batch_size: int | str | None,
               make_optimizer: Callable[[float], torch.optim.Optimizer], *, total_steps: int | None = None,
               **measure) -> tuple[int | None, dict]:
    """The batch the run trains at and its decisions: "auto", the one batch chooser
    (`batch_choice.choose_run_batch`: the least predicted time to a target on a run of `total_steps` long enough to
    pay it back, else the fastest measured); an int, that batch (given: no decision); None, the loader's."""
    if batch_size == "auto":
        if isinstance(getattr(train_loader, "dataset", None), IterableDataset):
            raise ValueError("batch_size='auto' needs a map-style dataset (len and indexing); got an IterableDataset")
        new, dec = choose_run_batch(model, train_loader, total_steps=total_steps, optimizer=make_optimizer(1e-3),
                                short="fastest", **measure)
        return new or getattr(train_loader, "batch_size", None), {"batch_size": dec}
    if isinstance(batch_size, int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        return batch_size, {}
    return getattr(train_loader, "batch_size", None), {}


def tune_lr(model: nn.Module, loader_at_batch: Iterable, lr: float | str,
            make_optimizer: Callable[[float], torch.optim.Optimizer], *, optimizer: str | torch.optim.Optimizer,
            schedule: str | None, batches: tuple[int | None, int | None], loss_fn: Callable | None,
            step_fn: Callable | None, precision: str, progress: bool) -> tuple[float, dict]:
    """The peak LR the run trains with and its decisions: "auto", measured on `loader_at_batch` (the loader at the
    run's batch: nothing to scale); a number, scaled by the optimizer's rule when the batch changed (`batches`:
    the loader's and the run's). A given optimizer object is set to it."""
    old_batch, new_batch = batches
    decisions: dict = {}
    if lr == "auto":  # measured at the batch the run trains with: nothing to scale
        lr_val, decisions["lr_find"] = _range_test_lr(model, loader_at_batch, make_optimizer, schedule=schedule,
                                                      batch=new_batch, loss_fn=loss_fn, step_fn=step_fn,
                                                      precision=precision, progress=progress)
    else:
        lr_val = float(lr)
    if new_batch != old_batch and old_batch and lr != "auto":
        scaled = scale_lr_for_batch(lr_val, new_batch, old_batch, optimizer)
        decisions["lr"] = Decision(scaled, f"{lr_val:.3g} scaled to batch {new_batch} from {old_batch} by the "
                                           f"{lr_rule(optimizer)} rule (T17)")
        lr_val = scaled
    if lr == "auto" or new_batch != old_batch:
        decisions["peak_lr"] = Decision(lr_val, "the peak LR the run trains with")
        if isinstance(optimizer, torch.optim.Optimizer):
            _set_peak_lr(optimizer, lr_val)
    return lr_val, decisions


def _range_test_lr(model: nn.Module, train_loader: Iterable, make_optimizer: Callable[[float], torch.optim.Optimizer],
                   *, schedule: str | None, batch: int | None, loss_fn: Callable | None, step_fn: Callable | None,
                   precision: str, progress: bool) -> tuple[float, Decision]:
    """lr="auto" (T15): the one LR chooser (`tune.lr_peak.choose_peak_lr`, the recipe's LR part too) on the user's
    loader at the run's batch: the range test, and on a one-cycle run the short trial of its pick and 2x, 4x."""
    choice = choose_peak_lr(model, train_loader, optimizer=make_optimizer(1e-6), schedule=schedule, loss_fn=loss_fn,
                            step_fn=step_fn, precision=precision, progress=progress)  # (a trial on one-cycle runs)
    return choice.lr, Decision(choice.lr, f"{choice.how}{f' at batch {batch}' if batch else ''}; {choice.evidence} "
                                          f"({choice.steps} steps)", measured=choice.measured)


def _set_peak_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """A given optimizer trains at the tuned peak LR (the Trainer uses a given optimizer's own lr): its first
    group gets `lr`, the others keep their ratio to it (all get `lr` when the first group's lr is 0)."""
    base = optimizer.param_groups[0]["lr"] or 1.0
    for g in optimizer.param_groups:
        g["lr"] = lr * (g["lr"] / base if optimizer.param_groups[0]["lr"] else 1.0)


def tuned_loader(model: nn.Module, train_loader: DataLoader, batch_size: int | None, *, loss_fn: Callable | None,
                  device: torch.device, progress: bool) -> tuple[dict, Decision]:
    """loader="auto" (T06-T08): `tune_loader` at the final batch size, with the model step as consumer: (the
    DataLoader settings, the decision that holds them and why)."""
    from torchspeed.tune.loader import tune_loader

    s = tune_loader(train_loader.dataset, batch_size=batch_size, model=model, loss_fn=loss_fn,  # type: ignore[arg-type]
                    device=device, collate_fn=train_loader.collate_fn, progress=progress)
    settings = s.kwargs()
    return settings, Decision(settings, s.reason)
