"""The recipe's batch size: the batch with the least predicted time to a target, from the gradient noise scale (T17).

`find_batch_size` (batch.py) measures samples/s per batch; the fastest batch is not the one
that reaches an accuracy soonest, because a larger batch needs more samples for the same
progress. McCandlish et al. (2018, "An empirical model of large-batch training") give the
trade-off from the simple noise scale B_noise (train/noise.py): a run at batch B needs

    samples(B) = samples_min * (1 + B / B_noise)      steps(B) = steps_min * (1 + B_noise / B)

so its wall time is proportional to `(1 + B / B_noise) / samples_per_s(B)`. `pick_batch_size`
takes the batch that minimises it among the measured ones, and moves off the loader's own batch
only when the prediction gains at least `BATCH_MARGIN`. `choose_batch_size` measures both inputs
on the user's model: the noise scale (after the recipe's short LR trial when it ran, since at
the initial weights the noise scale is far below its value later in training), and samples/s
at one, two and four times the loader's batch. The LR then follows the batch
(`train/schedule.scale_lr_for_batch`): linearly for SGD and LARS (Goyal et al. 2017), by the square root for
Adam-family optimizers (Malladi et al. 2022).

Only larger batches are taken. The noise scale grows as the loss falls, so the value measured
early is a lower bound for the run. A larger batch predicted sooner at the lower bound is
sooner still at the true value (its sample penalty 1 + B/B_noise only shrinks), but a smaller
batch's predicted gain may vanish. Measured on the digits: the noise scale after the LR trial
(~91) predicted batch 32 1.13x sooner than 64, and batch 32 needed 5,120 samples to 0.97
against 4,096 at 64 (docs/recipe.md). Runs shorter than `BATCH_MIN_STEPS` keep their batch:
the measurement (a few dozen steps at several batch sizes) would not pay back.

`choose_run_batch` is the one batch chooser: this, on a run long enough to pay it back; else, for
`batch_size="auto"`, the fastest batch measured (`fastest_batch`), or for the recipe the loader's batch kept.

Example:
    >>> batch, decision = choose_batch_size(model, loader, total_steps=2000, noise_scale=350.0)
    >>> loader = rebuild_loader(loader, batch_size=batch)
    >>> lr = scale_lr_for_batch(lr, batch, 64, "sgd")
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from torchspeed.train.decision import Decision
from torchspeed.train.noise import measure_noise_scale
from torchspeed.tune._common import decide_once

__all__ = ["BATCH_MIN_STEPS", "BATCH_MARGIN", "predicted_time", "pick_batch_size", "choose_batch_size",
           "choose_run_batch", "fastest_batch"]

BATCH_MIN_STEPS = 300   # shorter runs keep the loader's batch: the measurement costs a few seconds
BATCH_MARGIN = 0.10     # another batch must be predicted at least this much sooner to the target
BATCH_FACTORS = (1, 2, 4)  # the batches measured, as multiples of the loader's own (only larger ones are taken)


def predicted_time(batch: int, noise_scale: float, samples_per_s: float, *, world_size: int = 1) -> float:
    """Seconds to a target, up to a constant: samples needed (1 + B/B_noise, B the global batch) / samples per second."""
    return (1.0 + batch * world_size / noise_scale) / samples_per_s


def pick_batch_size(current: int, noise_scale: float, rates: Mapping[int, float], *, world_size: int = 1,
                    margin: float = BATCH_MARGIN, smaller: bool = False) -> tuple[int, dict[int, float]]:
    """The batch among `rates` (batch -> samples/s per process) with the least predicted time to a target.

    Returns (batch, {batch: predicted time relative to `current`}). `current` stays unless another
    batch is predicted at least `margin` sooner, or when the noise scale or `current`'s rate is unknown.
    Batches below `current` are taken only with `smaller=True`: from a noise scale measured early
    (a lower bound), only the prediction for a larger batch is safe.
    """
    if current not in rates or not rates[current] or not (noise_scale > 0 and math.isfinite(noise_scale)):
        return current, {}
    base = predicted_time(current, noise_scale, rates[current], world_size=world_size)
    rel = {b: predicted_time(b, noise_scale, r, world_size=world_size) / base for b, r in rates.items() if r}
    best = min((b for b in rel if smaller or b >= current), key=lambda b: (rel[b], b != current))
    if best != current and rel[best] <= 1.0 - margin:
        return best, rel
    return current, rel


def _rebuildable(loader) -> str | None:
    """Why `loader` cannot be rebuilt with another batch size, or None when it can."""
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__}, not a torch DataLoader"
    if loader.batch_size is None:
        return "the DataLoader has no batch_size (its dataset or sampler makes the batches)"
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset (no len and indexing to build other batch sizes from)"
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        return f"a custom batch_sampler ({type(loader.batch_sampler).__name__})"
    return None


def _candidates(b0: int, n_samples: int) -> tuple[int, int, int]:
    """(min_batch, max_batch, multiple) for find_batch_size: b0 .. 4 b0, an epoch of at least 16 steps."""
    lo = b0
    multiple = 8 if lo % 8 == 0 else 1
    hi = max(b0, min(int(b0 * max(BATCH_FACTORS)), n_samples // 16 // multiple * multiple))
    return lo, hi, multiple


def choose_batch_size(model: nn.Module, loader, *, total_steps: int | None, noise_scale: float | None = None,
                      optimizer: torch.optim.Optimizer | None = None, precision: str = "auto",
                      loss_fn: Callable | None = None, step_fn: Callable | None = None, world_size: int = 1,
                      min_steps: int = BATCH_MIN_STEPS, progress: bool = False) -> tuple[int | None, Decision]:
    """The recipe's batch part: (the new batch, or None to keep the loader's, and the Decision).

    `noise_scale` is B_simple measured after some training (the recipe passes the one measured at
    the end of its LR trial); None measures it at the current weights. Under DDP rank 0 measures.
    The model, its optimizer state and RNGs are left as they were (the tuners restore them).
    """
    from torchspeed.tune.batch import find_batch_size  # read when called: tests inject a measured search

    b0 = getattr(loader, "batch_size", None)
    why_not = _rebuildable(loader)
    if why_not:
        return None, Decision(b0, f"kept: {why_not}")
    if total_steps is None:
        return None, Decision(b0, "kept: the run's length is unknown (no len() and no max_steps), so whether "
                                  "measuring other batch sizes pays back is too")
    if total_steps < min_steps:
        return None, Decision(b0, f"kept: a run of {total_steps} steps, under {min_steps}, would not pay back "
                                  "measuring other batch sizes")
    where = "after the LR trial"
    if noise_scale is None:
        where = "at the initial weights (a lower bound: it grows as the loss falls)"
        noise_scale = decide_once(lambda: measure_noise_scale(model, loader, batches=8, loss_fn=loss_fn,
                                                              step_fn=step_fn).noise_scale)
    if not (noise_scale > 0 and math.isfinite(noise_scale)):
        return None, Decision(b0, "kept: the gradient noise scale is not measurable yet (|G|² <= 0)",
                              measured={"noise_scale": noise_scale})
    lo, hi, multiple = _candidates(b0, len(loader.dataset))
    res = find_batch_size(model, loader.dataset, loss_fn=loss_fn, step_fn=step_fn, optimizer=optimizer,
                          precision=precision, min_batch=lo, max_batch=hi, multiple=multiple,
                          collate_fn=loader.collate_fn, progress=progress)
    rates = {t.batch_size: t.samples_per_s for t in res.table if t.samples_per_s}
    best, rel = pick_batch_size(b0, noise_scale, rates, world_size=world_size)
    measured = {"noise_scale": noise_scale, "noise_measured": where, "samples_per_s": rates, "predicted_time": rel,
                "largest": res.largest, "limited_by": res.limited_by}
    table = ", ".join(f"{b}: {rel[b]:.2f}x" for b in sorted(rel))
    if best == b0:
        reason = (f"kept: no larger batch is predicted {BATCH_MARGIN:.0%} sooner to a target (B_noise ~{noise_scale:.0f} "
                  f"{where}; predicted time against batch {b0}: {table or 'batch ' + str(b0) + ' not measured'}) (T17)")
        return None, Decision(b0, reason, measured=measured)
    reason = (f"predicted {1 / rel[best]:.2f}x sooner to a target than batch {b0}: samples needed grow as 1 + B/B_noise "
              f"(B_noise ~{noise_scale:.0f} {where}), divided by the samples/s measured here ({table}) (T17)")
    return best, Decision(best, reason, measured=measured)


def choose_run_batch(model: nn.Module, loader, *, total_steps: int | None, optimizer: torch.optim.Optimizer,
                     short: str = "keep", **kw) -> tuple[int | None, Decision]:
    """The one batch chooser (T17): on a run of `total_steps` at least `BATCH_MIN_STEPS` long, the batch with the
    least predicted time to a target (`choose_batch_size`; `kw`: its options); on a shorter or unknown run,
    `short`: "keep" the loader's batch (the recipe's batch part), or "fastest" (`batch_size="auto"`: asked to tune,
    the fastest batch measured, `fastest_batch`). (the new batch, or None to keep the loader's; the Decision)"""
    if short not in ("keep", "fastest"):
        raise ValueError(f"short={short!r}: 'keep' or 'fastest'")
    if short == "fastest" and (total_steps is None or total_steps < BATCH_MIN_STEPS):
        measure = {k: kw[k] for k in ("loss_fn", "step_fn", "precision", "progress") if k in kw}
        return fastest_batch(model, loader, optimizer, **measure)
    return choose_batch_size(model, loader, total_steps=total_steps, optimizer=optimizer, **kw)


def fastest_batch(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, *,
                  loss_fn: Callable | None = None, step_fn: Callable | None = None, precision: str = "auto",
                  progress: bool = False) -> tuple[int, Decision]:
    """The fastest batch `find_batch_size` measures on the loader's dataset, searched up to 1/16 of it (an epoch
    keeps at least 16 steps) and at most 1024; the decision keeps the measured rates."""
    from torchspeed.tune.batch import find_batch_size  # read when called: tests inject a measured search

    dataset = loader.dataset
    res = find_batch_size(model, dataset, loss_fn=loss_fn, step_fn=step_fn, optimizer=optimizer, precision=precision,
                          collate_fn=loader.collate_fn, max_batch=max(8, min(1024, len(dataset) // 16 // 8 * 8)),
                          progress=progress)
    return res.fastest, Decision(res.fastest, f"fastest measured (a run under {BATCH_MIN_STEPS} steps, or of unknown "
                                              f"length: too short to pay back the time-to-target measurement); "
                                              f"largest that fits {res.largest}, limited by {res.limited_by}",
                                 measured={"samples_per_s": [(t.batch_size, t.samples_per_s) for t in res.table
                                                             if t.samples_per_s]})
