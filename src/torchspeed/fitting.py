"""`torchspeed.fit`: the plan, then the trainer (T06-T08, T15, T17, and every technique `Trainer` composes).

`fit` is the plan plus the Trainer: `torchspeed.plan.make_plan` runs the plan's registered stages
(`plan/stages.py`: every automatic choice once, with the tuners of `torchspeed.tune` and the
recipe, within a tuning budget), `torchspeed.train.Trainer` applies the plan into the plan's own
decisions (the plan's "first_steps" stages arm the switch trial, which the Trainer steps on the run's
first steps; then the plan's in-run stages), and the plan's after-training stages end the call.

Example:
    >>> result = torchspeed.fit(model, loader, epochs=3, val_loader=val, batch_size="auto", lr="auto")
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from torchspeed.distill import Teacher, prepare_distillation
from torchspeed.plan import make_plan
from torchspeed.plan.stages import run_event
from torchspeed.train.parallel.distributed import is_rank_zero
from torchspeed.train.parallel.fsdp import check_optimizer
from torchspeed.train.loop.batch import forward_loss
from torchspeed.train.loop.batch_notes import check_step_fn
from torchspeed.train.config import TrainConfig
from torchspeed.train.result import FitResult
from torchspeed.train.loop.trainer import Trainer
from torchspeed.train.transfer import to_device

__all__ = ["fit"]


def fit(model: nn.Module, train_loader: Iterable, *, loss_fn: Callable | None = None, step_fn: Callable | None = None,
        optimizer: str | torch.optim.Optimizer = "sgd", lr: float | str | None = None, weight_decay: float | None = None,
        momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999),
        epochs: int = 1, val_loader: Iterable | None = None, device: torch.device | str | None = None,
        batch_size: int | str | None = None, loader: str | None = None, callbacks: Iterable | None = None,
        loggers: Iterable | None = None, mesh=None, on_checkpoint: Callable[[str, int], object] | None = None,
        recipe: str | None = None, recipe_parts: Sequence[str] | None = None, teacher: nn.Module | Teacher | None = None,
        **config) -> FitResult:
    """Train `model` on `train_loader` with every technique that pays on this machine.

    Batches may be `(inputs..., target)` tuples, dicts (Hugging Face style), or anything `step_fn(model, batch)`
    turns into a loss; models may return logits or their own loss (see `torchspeed.train.loop.batch`).
    `loss_fn(output, target)` replaces the default cross-entropy (e.g. `nn.MSELoss()` for regression: metrics are
    then the loss alone). `config` takes any `TrainConfig` field (precision, channels_last, compile, grad_accum,
    clip_grad_norm, clip_grad_value, label_smoothing, schedule, log_every, max_steps, out_dir, ...).
    `batch_size="auto"` (or an int), `lr="auto"` and `loader="auto"` run the tuners first and rebuild the
    DataLoader from its dataset (see `torchspeed.tune.auto`). `lr=None` is the optimizer's own default LR (SGD
    0.1, AdamW and Adam 1e-3: `optim_info.default_lr`) as the peak of a one-cycle schedule; an LR you set (or an
    optimizer object you pass) is trained at as it is, with a constant schedule, unless `schedule=` says otherwise
    (`train.schedule.default_schedule`, docs/train.md); `schedule=lambda opt: StepLR(opt, 1, 0.7)` is your own
    scheduler, built on the optimizer that trains and stepped after each epoch (`schedule_interval="step"`: each
    step). `weight_decay=None` takes the optimizer's default (its row, `torchspeed.train.optim_info.WEIGHT_DECAY`:
    5e-4 for SGD, 0.05 for AdamW); biases and norm weights never decay. `momentum` (SGD, LARS) and `betas` (AdamW,
    LAMB, the AdamW part of "muon") go to the optimizer built from its name. `callbacks` (`EarlyStopping`, `EMA`,
    your own `Callback`s) and `loggers` (Lightning Fabric loggers, `TensorBoardLogger`, anything with
    `log_metrics(metrics, step)`): docs/integrations.md. `parallel="fsdp2"` shards the model (`mesh`: your own
    DeviceMesh); `on_checkpoint(path, step)` runs on every rank after each checkpoint. Inside a process group that
    already exists (Ray Train, your own `init_process_group`), `fit` uses it and leaves it alive.
    `recipe="auto"` chooses the training recipe on this model and its training batches before training (peak LR
    and floor from the range test, label smoothing, BatchNorm statistics of the final weights, an EMA on long runs,
    Muon for AdamW on matrix-heavy models, Schedule-Free AdamW (a language model: AdamW, WSD) as the prior of a run
    too short to measure, or when it wins a trial (`recipe_parts` without "schedulefree" keeps your optimizer), on long
    runs the batch size with the least predicted time to a target, flip TTA after training;
    `torchspeed.plan.recipe`, docs/recipe.md). It replaces `lr` (and `lr="auto"`); `recipe_parts` limits it to
    some parts (e.g. `("bn_stats", "label_smoothing")`). `teacher=` (a model, or `Teacher(model, temperature=,
    alpha=, topk=, cache=)`) distils it into `model` (`torchspeed.distill`: the KD loss, the teacher's top-k
    logits cached when measured to pay; docs/slim.md).

    Example:
        >>> result = fit(model, loader, epochs=3, val_loader=val, precision="auto", compile="auto")
    """
    cfg, given_cfg = _checked_config(config)
    _check_inputs(model, optimizer, val_loader, step_fn, loss_fn, lr)
    kd = None if teacher is None else prepare_distillation(
        teacher, model, train_loader, loss_fn=loss_fn, step_fn=step_fn, epochs=epochs, device=device,
        max_steps=config.get("max_steps", cfg.max_steps), precision=config.get("precision", cfg.precision))
    train_loader, step_fn = (kd.loader, kd.step_fn) if kd else (train_loader, step_fn)  # cached logits inside
    _materialize_lazy(model, train_loader, loss_fn=loss_fn, step_fn=step_fn)
    schedule_given = "schedule" in config or given_cfg is not None  # else the plan's rule decides
    cfg = replace(cfg, epochs=epochs, **config)
    plan = make_plan(model, train_loader, cfg, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                     schedule_given=schedule_given, optimizer_options={"momentum": momentum, "betas": betas},
                     loss_fn=loss_fn, step_fn=step_fn, device=device, batch_size=batch_size, loader=loader,
                     recipe=recipe, recipe_parts=recipe_parts, callbacks=callbacks)
    trainer = Trainer(model, loss_fn=loss_fn, step_fn=step_fn, optimizer=plan.optimizer, lr=plan.lr,
                      weight_decay=weight_decay, momentum=momentum, betas=betas, device=device, config=plan.config,
                      callbacks=plan.callbacks, loggers=loggers, mesh=mesh, on_checkpoint=on_checkpoint,
                      decisions=plan.decisions, caps=plan.context.caps, process_group=plan.context.dist,  # the plan's
                      first_steps=plan.first_steps + _announce(plan))  # trials armed, then the plan shown
    return _train(plan, trainer, epochs=epochs, val_loader=val_loader, kd=kd)


def _checked_config(options: dict) -> tuple[TrainConfig, TrainConfig | None]:
    """The config `fit` starts from, and the one given as `config=` (None: none); `options` left with the rest. An
    option that is no `TrainConfig` field is an error that names the close one."""
    given = options.pop("config", None)
    unknown = set(options) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"fit() got unknown option(s) {sorted(unknown)}{_suggest(unknown)}; "
                        f"valid: {sorted(TrainConfig.__dataclass_fields__)}")
    return given or TrainConfig(), given


def _train(plan, trainer: Trainer, *, epochs: int, val_loader, kd) -> FitResult:
    """The run (the plan printed at its start: `_announce`), then the plan's after-training stages (flip TTA); the
    result's decisions whole (and distillation's, `kd`)."""
    result = trainer.fit(plan.loader, epochs=epochs, val_loader=val_loader)
    ctx = plan.context
    ctx.trainer, ctx.result, ctx.val_loader = trainer, result, val_loader
    run_event(ctx, "after")
    result.decisions = trainer.decisions.copy()  # with what the stages in the run and after it decided
    if kd is not None:
        result.decisions["distill"] = kd.decision
    return result


# Other trainers' names for fit's options (Lightning, the Hugging Face Trainer, timm's train script)
_ALIASES = {"scheduler": "schedule", "lr_scheduler": "schedule", "max_epochs": "epochs", "num_epochs": "epochs",
            "num_train_epochs": "epochs", "gradient_accumulation_steps": "grad_accum",
            "accumulate_grad_batches": "grad_accum", "gradient_clip_val": "clip_grad_norm",
            "max_grad_norm": "clip_grad_norm", "clip_grad": "clip_grad_norm", "clipvalue": "clip_grad_value",
            "gradient_clip_algorithm": "clip_grad_value=V (value) or clip_grad_norm=V (norm)",
            "clip_mode": "clip_grad_value=V (value) or clip_grad_norm=V (norm)",
            "logging_steps": "log_every",
            "eval_steps": "eval_every", "val_check_interval": "eval_every", "default_root_dir": "checkpoint_dir",
            "output_dir": "out_dir", "save_steps": "checkpoint_every", "warmup": "warmup_steps",
            "amp": "precision", "mixed_precision": "precision", "bf16": "precision", "fp16": "precision",
            "smoothing": "label_smoothing", "model_ema": "callbacks=[EMA()]", "ema": "callbacks=[EMA()]"}


def _suggest(unknown: set[str]) -> str:
    """ " (did you mean ...?)" for the unknown options with a known or close name."""
    import difflib
    import inspect

    names = list(TrainConfig.__dataclass_fields__) + [p for p in inspect.signature(fit).parameters if p != "config"]
    hints = []
    for u in sorted(unknown):
        close = _ALIASES.get(u) or next(iter(difflib.get_close_matches(u, names, n=1, cutoff=0.75)), None)
        if close is not None:
            hints.append(f"{u} -> {close}")
    return f" (did you mean: {', '.join(hints)}?)" if hints else ""


def _check_inputs(model: nn.Module, optimizer, val_loader, step_fn, loss_fn, lr) -> None:
    """Clear errors before any work: nothing would train, the validation set is empty, a step_fn or loss_fn that
    cannot be called as fit calls it, an optimizer or LR that is none."""
    if not isinstance(model, nn.Module):  # `fit(model.parameters(), ...)`: torch's error named a generator
        given = "its parameters" if isinstance(model, Iterator) or (isinstance(model, (list, tuple)) and model and
                                                                    isinstance(model[0], torch.Tensor)) else None
        raise TypeError(f"fit trains a model (a torch.nn.Module), got {type(model).__name__}"
                        + (f" ({given}): pass the model itself, fit(model, loader)" if given else
                           ": wrap what computes the output in an nn.Module whose forward takes the batch's inputs"))
    check_step_fn(step_fn, loss_fn)
    check_optimizer(optimizer, sharded=False)
    if not (lr is None or lr == "auto" or (isinstance(lr, numbers.Real) and not isinstance(lr, bool) and lr >= 0)):
        raise ValueError(f"lr must be a number >= 0, 'auto' (measured) or None (the optimizer's default), got {lr!r}")
    _check_trainable(model, optimizer)
    _check_val_loader(val_loader)


def _check_trainable(model: nn.Module, optimizer) -> None:
    """A clear error before any work when nothing would train (a frozen model, an optimizer over frozen tensors)."""
    own = isinstance(optimizer, torch.optim.Optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]] if own else list(model.parameters())
    if not any(p.requires_grad for p in params):
        where = "the optimizer you passed holds" if own else "the model has"
        raise ValueError(f"nothing to train: {where} {len(params)} parameter tensors and none requires grad. "
                         "Unfreeze the layers to train (p.requires_grad_(True)), or build the optimizer over "
                         "the parameters that train")
    mine = {id(p) for p in model.parameters()}
    if own and mine and not any(id(p) in mine for p in params):  # steps would move another model's weights only
        raise ValueError(f"the optimizer you passed holds {len(params)} parameter tensors and none is this model's: "
                         "it was built on another model object (one made before this model was re-created, copied "
                         "or loaded, say), so no step would move this model's weights. Build it on this model: "
                         "torch.optim.SGD(model.parameters(), lr=...)")


def _check_val_loader(val_loader) -> None:
    """An empty validation set is an error before any work; one read only once (a generator) a warning."""
    if val_loader is None:
        return
    if hasattr(val_loader, "__len__") and len(val_loader) == 0:
        raise ValueError("val_loader has no batches: pass a validation set with samples, or val_loader=None")
    if isinstance(val_loader, Iterator):  # asked without iter(): a DataLoader's draws a seed from the global RNG
        logging.getLogger("torchspeed").warning(
            "val_loader is a one-shot iterator: only the first evaluation sees its batches (later ones get "
            "val_loss NaN); pass a DataLoader or a list of batches")


def _materialize_lazy(model: nn.Module, train_loader, *, loss_fn=None, step_fn=None) -> None:
    """A model with lazy layers (`nn.LazyLinear`, ...) gets its shapes from one forward of the first training batch,
    in eval mode and without gradients (no BatchNorm statistics or dropout draws), as a script's first step would:
    everything that reads the weights' shapes (the trial cache, the LR rules) then reads the real ones."""
    if not any(is_lazy(t) for t in (*model.parameters(), *model.buffers())):
        return
    if iter(train_loader) is train_loader:
        raise ValueError("the model has lazy layers (e.g. nn.LazyLinear) and the training data is a one-shot "
                         "iterator, which fit cannot read a batch of twice: run the model once on a batch before "
                         "fit (`model(x)`), or pass a DataLoader")
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    batch = to_device(next(iter(train_loader)), device, non_blocking=False)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            forward_loss(model, batch, loss_fn=loss_fn, step_fn=step_fn, decisions={})  # {}: errors get notes
    finally:
        model.train(was)


def _announce(plan) -> tuple:
    """The plan printed once the run's "first_steps" stages ran (the optimizer the Trainer built recorded, the switch
    trial armed): a last first-steps part for the Trainer, with `progress` on rank 0; else none."""
    if not (plan.config.progress and is_rank_zero()):
        return ()
    return (lambda trainer, loader, steps_left: _print_plan(plan),)


def _print_plan(plan) -> None:
    """The plan before training: what was chosen, from what evidence, at what cost, what the run still measures."""
    from rich.console import Console

    Console(stderr=True).print(plan.summary(), markup=False, highlight=False)
