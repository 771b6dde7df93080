"""A training recipe chosen by measuring the user's own model and training data: fewer steps to the same accuracy.

The speed switches (precision, channels_last, fused kernels, compile) make each step cheaper;
the recipe makes fewer steps do. `fit(..., recipe="auto")` calls `choose_recipe` before
training; every part is also a plain function or object for your own loop. Each choice goes
into `decisions` with its reason. Nothing here reads a validation set: the choices are made on
training batches alone (a test replaces the validation set and checks they do not change).

The parts (`PARTS`), and how each is chosen:

- `lr` (T14, T15; `plan/recipe_lr.py`): the one-cycle peak LR and floor from the LR range test (`find_lr`), run
  with the optimizer and precision the run trains with. When its curve is flat or noisy the
  range test says so and falls back to a short measured trial of a few LRs.
- `label_smoothing` (T32): 0.1 for per-sample classification with the default cross-entropy
  (a model that returns its own loss, your own `loss_fn`, and per-token outputs such as a
  language model's are left alone).
- `bn_stats` (T47): BatchNorm statistics averaged over the last tenth of the run
  (`train.bnstats.FinalBatchNormStats`), so evaluation uses statistics of the final weights.
  The largest single saving measured on the digits (docs/recipe.md). Costs nothing.
- `ema` (T40): an EMA of the weights (`train.loop.callbacks.EMA`, on `torch.optim.swa_utils`) for
  runs long enough for the average to span a small part of them (>= `EMA_MIN_STEPS` steps;
  decay so that it spans about a twentieth of the run). Shorter runs: off; on the digits at
  48 steps it gained nothing (docs/recipe.md).
- `tta` (T33; `plan/recipe_tta.py`): flip test-time augmentation, decided *after* training by `choose_tta` on a
  few training batches: kept only when it scores better there (the digits are not
  flip-invariant: it is refused there). The check (8 forward passes, ~`TTA_COST` steps) is
  charged to the budget: a shorter run reads the cache or keeps the prior, no TTA.
- `muon` (T42) and `schedulefree` (T14's alternative), in `plan/recipe_optimizer.py`: candidates
  against the optimizer the run was given by name. Muon (for the hidden matrices) is one for
  AdamW on a model whose weights are mostly hidden 2D matrices; Schedule-Free AdamW (the
  `schedulefree` extra) for SGD or AdamW. When the budget affords a short trial
  (`tune.optimizer_trial`, 50 steps a candidate) they are compared on time to the given
  optimizer's training loss; else an earlier run's measurement; else the prior, Schedule-Free
  AdamW at an LR set by the model's width, which needs no LR search and no schedule. Chosen, it replaces the
  LR part, the floor, the BatchNorm tail (it recalibrates statistics for its averaged weights)
  and the EMA. An optimizer object, or LAMB/LARS/Muon by name, is kept as given.
- `batch` (T17): for runs of at least `BATCH_MIN_STEPS` steps, the batch with the least
  predicted time to a target: samples needed grow as 1 + B/B_noise (the gradient noise scale,
  measured at the end of the LR trial), divided by the samples/s measured at half to four
  times the loader's batch (`tune.batch_choice`). The LR follows (linear rule for SGD, square
  root for Adam-family). `fit` rebuilds the DataLoader; a batch size given to `fit` switches
  the part off. Its cost is priced in the run's steps from a timed forward and backward pass
  (`batch_cost`): its timing runs at up to 4x the batch, with a floor of seconds a step count
  does not show.

Cost: the range test's steps (100 by default) and, when asked, the fallback and optimizer
trials; `Recipe.tuning_s` and `Recipe.tuning_steps` report it, and the bench counts it
("tuning included").

Example:
    >>> recipe = choose_recipe(model, loader, optimizer="sgd", total_steps=500)
    >>> fit(model, loader, lr=recipe.lr, min_lr=recipe.min_lr, label_smoothing=recipe.label_smoothing,
    ...     callbacks=recipe.callbacks())
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchspeed.env import default_device
from torchspeed.plan.budget import TuningBudget
from torchspeed.plan.parts import PARTS, Gate, Recipe, guarded, recipe_key
from torchspeed.plan.recipe_lr import choose_lr_part
from torchspeed.tune.lr_peak import LR_TRIAL_FACTORS
from torchspeed.plan.recipe_optimizer import choose_optimizer_part
from torchspeed.plan.recipe_tta import TTA_COST
from torchspeed.train.trial.backends import no_autotune
from torchspeed.train.loop.batch import first_samples, forward_loss
from torchspeed.train.losses import default_loss
from torchspeed.train.bnstats import batchnorm_layers
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.evaluate import is_image_batch
from torchspeed.train.sampler import keep_rng, take_batches
from torchspeed.train.schedule import scale_lr_for_batch
from torchspeed.train.transfer import to_device
from torchspeed.train.noise import measure_noise_scale
from torchspeed.train.optim_candidate import candidate_optimizer
from torchspeed.tune._common import decide_once
from torchspeed.tune.batch_choice import BATCH_MIN_STEPS, choose_batch_size

__all__ = ["EMA_MIN_STEPS", "choose_recipe", "is_classifier"]

LABEL_SMOOTHING = 0.1
EMA_MIN_STEPS = 2000
PROBE_BATCHES = 4


def is_classifier(model: nn.Module, batch, *, loss_fn: Callable | None = None,
                  step_fn: Callable | None = None) -> bool:
    """Whether `model` on `batch` is per-sample classification on the default cross-entropy: logits (B, C), C > 2.
    Read from a forward pass on the batch's first 2 samples: the shapes are the same, at a fraction of the cost."""
    if loss_fn is not None or step_fn is not None:
        return False
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), no_autotune():  # 2 samples: a shape the run never trains at
            out = forward_loss(model, first_samples(batch, 2))
    except Exception:  # a batch this check cannot read: leave classification parts off
        return False
    finally:
        model.train(was)
    if getattr(out, "own_loss", False) or out.logits is None or out.target is None:
        return False  # the model computes its own loss: not ours to smooth
    if out.logits.dim() != 2:
        return False  # per-token (language models) or per-pixel outputs: smoothing is not part of their recipe
    return out.correct() is not None and out.logits.shape[-1] > 2


def choose_recipe(model: nn.Module, train_loader: Iterable, *, optimizer: str | torch.optim.Optimizer = "sgd",
                  lr: float = 0.1, weight_decay: float | None = None, optimizer_options: dict | None = None,
                  precision: str = "auto", loss_fn: Callable | None = None, step_fn: Callable | None = None,
                  total_steps: int | None = None, schedule: str | None = "onecycle",
                  parts: Sequence[str] = PARTS, device: torch.device | str | None = None,
                  lr_steps: int = 100, lr_trial_steps: int = 24, progress: bool = True,
                  budget: TuningBudget | None = None, cache: TrialCache | None = None,
                  lr_in_run: bool = False, lr_given: bool = False, precision_setting: str | None = None) -> Recipe:
    """Choose each recipe part in `parts` from `model` and the training batches; leaves the model, its optimizer
    state, every RNG and the loader's data order as they were.

    `lr` is the peak LR used when the `lr` part is off or not measured; `total_steps` (optimizer
    steps of the coming run) decides the EMA. `budget` (`plan.budget.TuningBudget`; None: no
    limit) bounds the parts that train off the run: a part it cannot afford is read from `cache`
    (an earlier run's measurement of this model, input and machine) or left at its prior, and
    its Decision says which. Measured parts are written to `cache` for the next run. With
    `lr_in_run` an affordable LR part is not measured here but left in `Recipe.pending`, for the
    run to measure right after its switch trial, at the precision that trial chose (`plan.inrun`).
    `lr_given`: the run gave its own LR, so the optimizer part's prior is the given optimizer at that LR.
    `precision_setting`: the run's precision setting ("auto"), when `precision` is what the switch trial resolved
    it to: the cache is keyed on the setting, which resolves the same way on a later run of this model.
    """
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown recipe part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
    t0 = time.perf_counter()
    dev = torch.device(device) if device is not None else default_device(None)
    model.to(dev)
    held = take_batches(train_loader, PROBE_BATCHES)
    rec = Recipe(lr=lr, parts=tuple(parts), probe=held)
    classifier = is_classifier(model, to_device(held[0], dev), loss_fn=loss_fn, step_fn=step_fn)
    _free_parts(rec, model, classifier, total_steps)
    opt_name = optimizer if isinstance(optimizer, str) else None
    gate = Gate(rec, budget, cache, recipe_key(model, held[0], opt_name or type(optimizer).__name__, lr, schedule,
                                                precision_setting or precision, parts))
    tuners = dict(weight_decay=weight_decay, optimizer_options=optimizer_options, precision=precision,
                  step_fn=step_fn, progress=progress)
    with keep_rng(train_loader):  # the tuners read the loader: the run's data order stays as it was
        if opt_name is not None and {"muon", "schedulefree"} & set(parts):
            guarded(rec, "optimizer", dict(optimizer=None, lr=lr, min_lr=None), opt_name, choose_optimizer_part,
                    model, train_loader, rec, gate, given=opt_name, lr=lr, schedule=schedule, precision=precision,
                    loss_fn=loss_fn, step_fn=step_fn, total_steps=total_steps, lr_given=lr_given,
                    weight_decay=weight_decay, optimizer_options=optimizer_options)
        schedule_free = rec.optimizer == "schedulefree"
        lr_loss = loss_fn  # the tuners train on the loss the run trains on (its smoothing as the parts left it)
        if lr_loss is None and rec.label_smoothing:
            lr_loss = default_loss(rec.label_smoothing)
        batch_wanted = "batch" in parts and total_steps is not None and total_steps >= BATCH_MIN_STEPS
        measured: dict = {}
        if "lr" in parts and not schedule_free:
            measured = guarded(rec, "lr", dict(lr=lr, min_lr=None), lr, _lr_part, model, train_loader, rec, gate,
                               optimizer=optimizer, name=rec.optimizer or opt_name, lr=lr, schedule=schedule,
                               loss_fn=lr_loss, lr_steps=lr_steps, lr_trial_steps=lr_trial_steps, noise=batch_wanted,
                               in_run=lr_in_run, **tuners) or {}
        if "batch" in parts:
            cost = BATCH_COST  # timed only where the budget would afford the part at that price
            if batch_wanted and gate.cached("batch_size") is None and (budget is None or budget.allows(cost)):
                cost = batch_cost(decide_once(lambda: step_seconds(model, held[0], loss_fn=lr_loss, step_fn=step_fn)))
            if not batch_wanted or gate.measure("batch_size", cost):
                guarded(rec, "batch_size", dict(batch_size=None, lr=rec.lr, min_lr=rec.min_lr), None, _choose_batch,
                        model, train_loader, rec, optimizer=optimizer, name=rec.optimizer or opt_name,
                        loss_fn=lr_loss, total_steps=total_steps, noise_scale=measured.get("noise_scale"), **tuners)
                if batch_wanted:
                    gate.done("batch_size", {"batch_size": rec.batch_size})
            else:
                rec.batch_size = gate.settle("batch_size", "batch_size", None, "the loader's batch", default=None)
    if "tta" in parts:
        _tta_part(rec, gate, held[0])
    gate.save()
    rec.tuning_s = time.perf_counter() - t0
    rec.decisions["recipe_cost"] = Decision(round(rec.tuning_s, 2), f"{rec.tuning_steps} training steps spent "
                                            "choosing off the run" + (f" (budget {budget.limit} steps, "
                                                                      f"{budget.share:.0%} of the run)" if budget else ""),
                                            measured={"seconds": rec.tuning_s, "steps": rec.tuning_steps})
    return rec


# Training steps off the run that each measured part costs (the budget's currency); the optimizer trial costs
# OPTIMIZER_TRIAL_STEPS per candidate
BATCH_COST = 150          # the batch timing's ~60 steps, most at 2-4x the batch, and the noise batches
BATCH_FLOOR_S = 0.9       # plus find_batch_size's timing floors: ~3 sizes x 3 rounds x its min_time (0.1 s)


def batch_cost(step_s: float | None) -> int:
    """The batch part's cost in the run's steps at `step_s` seconds a step (None: not timed): BATCH_COST, and its
    timing's floor of BATCH_FLOOR_S seconds in steps. Priced in steps alone it cost a 1,250-step run of 7 ms
    steps (a character GRU) 1.5-2.6 s, over half the run, against a budget of 5%."""
    return BATCH_COST + (math.ceil(BATCH_FLOOR_S / max(step_s, 1e-4)) if step_s else 0)


def step_seconds(model: nn.Module, batch, *, loss_fn: Callable | None, step_fn: Callable | None) -> float | None:
    """Seconds of a forward and backward pass over `batch`: the second of two (the first holds one-off work).
    Nothing is trained (`measure_noise_scale` leaves the model as it was). None: the batch cannot be split."""
    try:
        measure_noise_scale(model, [batch], batches=1, loss_fn=loss_fn, step_fn=step_fn)
        t0 = time.perf_counter()
        measure_noise_scale(model, [batch], batches=1, loss_fn=loss_fn, step_fn=step_fn)
    except Exception:  # a batch the noise measurement cannot read: priced in steps alone
        return None
    return time.perf_counter() - t0


def _free_parts(rec: Recipe, model: nn.Module, classifier: bool, total_steps: int | None) -> None:
    """The parts that cost nothing to choose: label smoothing, BatchNorm statistics, the EMA."""
    d, parts = rec.decisions, rec.parts
    if "label_smoothing" in parts:
        if classifier:
            rec.label_smoothing = LABEL_SMOOTHING
            d["label_smoothing"] = Decision(LABEL_SMOOTHING, "classification with the default cross-entropy (T32)")
        else:
            d["label_smoothing"] = Decision(0.0, "not a classifier on the default cross-entropy: left alone")
    if "bn_stats" in parts:
        n_bn = len(batchnorm_layers(model))
        rec.bn_stats = n_bn > 0
        d["bn_stats"] = Decision(rec.bn_stats, f"{n_bn} BatchNorm layers: statistics averaged over the run's last "
                                               "tenth (T47)" if n_bn else "no BatchNorm layer")
    if "ema" in parts:
        _choose_ema(rec, total_steps)


def _lr_part(model, loader, rec: Recipe, gate: Gate, *, optimizer, name, lr, schedule, loss_fn, lr_steps,
             lr_trial_steps, noise, in_run, **tuners) -> dict:
    """The LR part within the budget: left for the run to measure after its switch trial (`in_run`), measured here,
    or read from the cache or kept at the given peak. Returns what the measurement found (the noise scale)."""
    lr_cost = lr_steps + (len(LR_TRIAL_FACTORS) * lr_trial_steps if schedule == "onecycle" else 0)
    if in_run and gate.measure("lr", lr_cost):
        rec.pending["lr"] = {"cost": lr_cost, "key": gate.key, "lr_steps": lr_steps, "lr_trial_steps": lr_trial_steps}
        rec.min_lr = lr / 10 if schedule == "onecycle" else None  # rescaled with the measured peak
        rec.decisions["lr"] = Decision(lr, f"prior {lr:g} for the first steps; measured in the run right after the "
                                           "switch trial, at the precision it chooses "
                                           f"(~{lr_cost} steps off the run, within the budget)")
        return {}
    if gate.measure("lr", lr_cost):
        measured = choose_lr_part(model, loader, rec, optimizer=optimizer, name=name, schedule=schedule,
                                  loss_fn=loss_fn, lr_steps=lr_steps, lr_trial_steps=lr_trial_steps, noise=noise,
                                  **tuners)
        gate.done("lr", {"lr": rec.lr, "min_lr": rec.min_lr})
        return measured
    rec.lr = gate.settle("lr", "lr", lr, f"the given peak LR {lr:g}", default=lr)
    cached = gate.cached("lr")
    rec.min_lr = cached.get("min_lr") if cached else None
    return {}


def _tta_part(rec: Recipe, gate: Gate, batch) -> None:
    """Flip TTA: checked after training on the probe batches (within the budget), cached, or the prior (none)."""
    if not is_image_batch(batch):
        rec.decisions["tta"] = Decision(None, "not an image classifier ((images, labels) batches): no flip")
    elif gate.measure("tta", TTA_COST):
        rec.pending["tta"] = {"cost": TTA_COST, "key": gate.key,
                              "cache": str(gate.cache.path) if gate.cache is not None else None}
        rec.decisions["tta"] = Decision(None, f"checked after training on {len(rec.probe)} training batches "
                                              f"(~{TTA_COST} steps' worth, within the budget)")
    else:
        rec.tta = gate.settle("tta", "tta", None, "no flip TTA (it costs nothing and changes nothing)", default=None)


def _choose_ema(rec: Recipe, total_steps: int | None, why: str = "") -> None:
    """The EMA part (T40): on for runs of EMA_MIN_STEPS+ steps, its average spanning about the last twentieth."""
    if total_steps and total_steps >= EMA_MIN_STEPS:
        rec.ema_decay = round(min(0.9999, max(0.99, 1 - 20 / total_steps)), 6)
        dec = Decision(rec.ema_decay, f"a run of {total_steps} steps{why}: the average spans about its last "
                                      "twentieth (T40)")
    else:
        rec.ema_decay = None
        dec = Decision(None, f"run of {total_steps or 'unknown'} steps{why}, under {EMA_MIN_STEPS}: an average of "
                             "so few steps gained nothing measured (docs/recipe.md)")
    rec.decisions.refine("ema", dec)  # the batch part refines it for the run's length at its batch


def _choose_batch(model, loader, rec: Recipe, *, optimizer, name, weight_decay, optimizer_options, precision,
                  loss_fn, step_fn, total_steps, noise_scale, progress) -> None:
    """The batch part (T17, tune/batch_choice.py): the batch with the least predicted time to a target, the LR
    (and floor) scaled to it."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    b0 = getattr(loader, "batch_size", None)
    long_run = total_steps is not None and total_steps >= BATCH_MIN_STEPS  # else it decides without measuring
    scratch = candidate_optimizer(optimizer, model, lr=1e-6, name=name, weight_decay=weight_decay,
                                  options=optimizer_options) if long_run else optimizer
    new, dec = choose_batch_size(model, loader, total_steps=total_steps, noise_scale=noise_scale, optimizer=scratch,
                                 precision=precision, loss_fn=loss_fn, step_fn=step_fn, world_size=world,
                                 progress=progress)
    rec.decisions["batch_size"] = dec
    if new is None or not b0:
        return
    rec.batch_size = new
    if "ema" in rec.parts and total_steps:  # the run is shorter in steps at the larger batch
        _choose_ema(rec, max(1, total_steps * b0 // new), f" at batch {new}")
    kind = name or type(optimizer).__name__
    if rec.lr is not None:
        old = rec.lr
        rec.lr = scale_lr_for_batch(old, new, b0, kind)
        if rec.min_lr is not None:
            rec.min_lr = rec.min_lr * rec.lr / old
        prev = rec.decisions.get("lr")
        rule = "square root" if rec.lr / old != new / b0 else "linear"
        rec.decisions.refine("lr", Decision(rec.lr, f"{old:.3g} scaled to batch {new} by the {rule} rule for "
                                                    f"{kind} (T17)", measured=getattr(prev, "measured", None)))
