"""`torchspeed.fit`: the tuners, then the trainer (T06-T08, T15, T17, and every technique `Trainer` composes).

`fit` sits on a floor above both `torchspeed.train` (the loop) and `torchspeed.tune` (the
tuners, which themselves train a few steps with `torchspeed.train`): neither package
imports the other's caller, so there is no import cycle between them.

Example:
    >>> result = torchspeed.fit(model, loader, epochs=3, val_loader=val, batch_size="auto", lr="auto")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import torch
from torch import nn

from torchspeed.train.trainer import FitResult, Trainer, TrainConfig
from torchspeed.tune.auto import tune_for_fit

__all__ = ["fit"]


def fit(model: nn.Module, train_loader: Iterable, *, loss_fn: Callable | None = None, step_fn: Callable | None = None,
        optimizer: str | torch.optim.Optimizer = "sgd", lr: float | str = 0.1, weight_decay: float | None = None,
        momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999),
        epochs: int = 1, val_loader: Iterable | None = None, device: torch.device | str | None = None,
        batch_size: int | str | None = None, loader: str | None = None, callbacks: Iterable | None = None,
        loggers: Iterable | None = None, mesh=None, on_checkpoint: Callable[[str, int], object] | None = None,
        recipe: str | None = None, recipe_parts: Sequence[str] | None = None, **config) -> FitResult:
    """Train `model` on `train_loader` with every technique that pays on this machine.

    Batches may be `(inputs..., target)` tuples, dicts (Hugging Face style), or anything
    `step_fn(model, batch)` turns into a loss; models may return logits or their own loss
    (see `torchspeed.train.batch`). `loss_fn(output, target)` replaces the default
    cross-entropy (e.g. `nn.MSELoss()` for regression: metrics are then the loss alone).
    `config` takes any `TrainConfig` field (precision, channels_last, compile, grad_accum,
    clip_grad_norm, label_smoothing, schedule, log_every, max_steps, out_dir, ...).
    `batch_size="auto"` (or an int), `lr="auto"` and `loader="auto"` run the tuners first and
    rebuild the DataLoader from its dataset (see `torchspeed.tune.auto`).
    `weight_decay=None` takes the optimizer's default (`torchspeed.train.optim.WEIGHT_DECAY`:
    5e-4 for SGD, 0.05 for AdamW); biases and norm weights never decay. `momentum` (SGD,
    LARS) and `betas` (AdamW, LAMB, the AdamW part of "muon") go to the optimizer built from its name.
    `callbacks` (`EarlyStopping`, `EMA`, your own `Callback`s) and `loggers` (Lightning Fabric
    loggers, `TensorBoardLogger`, anything with `log_metrics(metrics, step)`): docs/integrations.md.
    `parallel="fsdp2"` shards the model (`mesh`: your own DeviceMesh); `on_checkpoint(path, step)`
    runs on every rank after each checkpoint. Inside a process group that already exists (Ray
    Train, your own `init_process_group`), `fit` uses it and leaves it alive.
    `recipe="auto"` chooses the training recipe on this model and its training batches before
    training (peak LR and floor from the range test, label smoothing, BatchNorm statistics of the
    final weights, an EMA on long runs, Muon for AdamW on matrix-heavy models, on long runs the
    batch size with the least predicted time to a target, flip TTA after training;
    `torchspeed.tune.recipe`, docs/recipe.md). It replaces `lr` (and `lr="auto"`);
    `recipe_parts` limits it to some parts (e.g. `("bn_stats", "label_smoothing")`).

    Example:
        >>> result = fit(model, loader, epochs=3, val_loader=val, precision="auto", compile="auto")
    """
    cfg = config.pop("config", None) or TrainConfig()
    unknown = set(config) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"fit() got unknown option(s) {sorted(unknown)}; "
                        f"valid: {sorted(TrainConfig.__dataclass_fields__)}")
    cfg = replace(cfg, epochs=epochs, **config)
    if recipe not in (None, "auto"):
        raise ValueError(f"recipe={recipe!r}: use recipe='auto' (measured on your model) or leave it out")
    if recipe_parts is not None and recipe is None:
        raise ValueError("recipe_parts needs recipe='auto'")
    tuned: dict = {}
    if recipe and lr == "auto":
        lr = 0.1  # the recipe's range test chooses it, at the final batch size
    if batch_size is not None or lr == "auto" or loader is not None:  # measured on this model and machine first
        train_loader, lr, tuned = tune_for_fit(model, train_loader, batch_size=batch_size, lr=lr, loader=loader,
                                               loss_fn=loss_fn, step_fn=step_fn, optimizer=optimizer, weight_decay=weight_decay,
                                               optimizer_options={"momentum": momentum, "betas": betas},
                                               device=device, precision=cfg.precision, schedule=cfg.schedule,
                                               distributed=cfg.distributed, progress=cfg.progress)
    rec = None
    if recipe:
        if batch_size is not None:  # the user's batch (or the tuner's, above) stands
            recipe_parts = tuple(p for p in (recipe_parts if recipe_parts is not None else _recipe_parts())
                                 if p != "batch")
        rec, cfg, optimizer, lr, callbacks, train_loader = _apply_recipe(
            model, train_loader, cfg, recipe_parts, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
            loss_fn=loss_fn, step_fn=step_fn, device=device, callbacks=callbacks,
            optimizer_options={"momentum": momentum, "betas": betas})
        tuned.update(rec.decisions)
    trainer = Trainer(model, loss_fn=loss_fn, step_fn=step_fn, optimizer=optimizer, lr=lr,
                      weight_decay=weight_decay, momentum=momentum, betas=betas, device=device, config=cfg,
                      callbacks=callbacks, loggers=loggers, mesh=mesh, on_checkpoint=on_checkpoint)
    trainer.decisions.update(tuned)
    result = trainer.fit(train_loader, epochs=epochs, val_loader=val_loader)
    if rec is not None and "tta" in rec.parts:
        _after_training(trainer, rec, result, val_loader)
    return result


def _apply_recipe(model, train_loader, cfg: TrainConfig, parts, *, optimizer, lr, weight_decay, loss_fn, step_fn,
                  device, callbacks, optimizer_options):
    """Choose the recipe (tune/recipe.py) and fold it into the config, optimizer, LR and callbacks."""
    from torchspeed.train.distributed import maybe_init_distributed
    from torchspeed.train.sampler import loader_length
    from torchspeed.train.schedule import steps_in_run
    from torchspeed.tune.recipe import PARTS, choose_recipe

    info = maybe_init_distributed(cfg.distributed, device=device)  # so that rank 0 measures for every rank
    if info is not None:
        device = info.device

    total = steps_in_run(loader_length(train_loader, max_steps=cfg.max_steps), cfg.epochs,
                         grad_accum=cfg.grad_accum, max_steps=cfg.max_steps)
    rec = choose_recipe(model, train_loader, optimizer=optimizer, lr=float(lr), weight_decay=weight_decay,
                        optimizer_options=optimizer_options, precision=cfg.precision, loss_fn=loss_fn,
                        step_fn=step_fn, total_steps=total, schedule=cfg.schedule,
                        parts=tuple(parts) if parts is not None else PARTS, device=device, progress=cfg.progress)
    changes = rec.config()
    if cfg.min_lr is not None:  # the user's own floor wins
        changes.pop("min_lr", None)
    if loss_fn is not None:
        changes.pop("label_smoothing", None)
    cfg = replace(cfg, **changes)
    if rec.optimizer and isinstance(optimizer, str):
        optimizer = rec.optimizer
    if rec.batch_size and rec.batch_size != getattr(train_loader, "batch_size", None):
        from torchspeed.train.sampler import rebuild_loader

        train_loader = rebuild_loader(train_loader, batch_size=rec.batch_size)
    return (rec, cfg, optimizer, rec.lr if rec.lr is not None else lr, [*(callbacks or ()), *rec.callbacks()],
            train_loader)


def _recipe_parts() -> tuple[str, ...]:
    from torchspeed.tune.recipe import PARTS

    return PARTS


def _after_training(trainer: Trainer, rec, result: FitResult, val_loader) -> None:
    """The recipe's after-training part: flip TTA when it scores better on training batches (T33)."""
    from torchspeed.tune.recipe import decide_tta

    asked = trainer.config.tta  # the user's own TTA stands, and the history already used it
    dec = result.decisions["tta"] = decide_tta(trainer, rec.probe)
    if dec.value and asked is None and val_loader is not None and result.history:
        result.history[-1]["val_acc_tta"] = trainer.evaluate(val_loader)["val_acc"]
