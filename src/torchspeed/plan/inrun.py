"""Recipe parts measured inside the run, after its switch trial: at the precision and layout it trains with (T14,
T15, T18, T21, T23).

The switch trial decides in the run's first steps (`train.autoswitch`). A tuner that ran
before it would measure at the rule's precision, which the trial may overturn. So the plan
leaves an affordable LR part pending (`choose_recipe(lr_in_run=True)`), and `MeasureInRun`, a
callback, runs it once at the first step end after the switch trial has settled: the range
test and the short one-cycle trial on the live model (its weights, optimizer state and every
RNG restored afterwards; the loader's data order untouched), with the precision in effect.
The run's schedule is then rescaled to the measured peak (`schedule.rescale_lr`) and the
measurement is cached for the next run of this model.

Example:
    >>> rec = choose_recipe(model, loader, total_steps=20_000, budget=TuningBudget(20_000), lr_in_run=True)
    >>> trainer = Trainer(model, lr=rec.lr, callbacks=[MeasureInRun(rec, loader, optimizer="sgd")])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torchspeed.plan.recipe import Recipe, guarded
from torchspeed.plan.recipe_lr import choose_lr_part
from torchspeed.train.callbacks import Callback
from torchspeed.train.decision import Decision, TrialCache

__all__ = ["MeasureInRun"]


def _tuning_loader(loader: Iterable) -> Iterable:
    """A loader the tuners may iterate beside the run's own iterator: persistent workers would be reset by a second
    `iter()`, so such a DataLoader is rebuilt without them (same dataset, sampler and generator)."""
    from torch.utils.data import DataLoader

    from torchspeed.train.sampler import rebuild_loader

    if isinstance(loader, DataLoader) and loader.num_workers > 0 and loader.persistent_workers:
        return rebuild_loader(loader, persistent_workers=False)
    return loader


class MeasureInRun(Callback):
    """Measure the recipe's pending parts once the switch trial has decided, and put them into effect."""

    def __init__(self, rec: Recipe, loader: Iterable, *, optimizer: str | None, schedule: str | None = "onecycle",
                 loss_fn: Callable | None = None, step_fn: Callable | None = None, weight_decay: float | None = None,
                 optimizer_options: dict | None = None, cache: TrialCache | None = None, progress: bool = False):
        self.rec, self.loader, self.optimizer = rec, loader, optimizer
        self.schedule, self.loss_fn, self.step_fn = schedule, loss_fn, step_fn
        self.weight_decay, self.optimizer_options, self.cache, self.progress = (weight_decay, optimizer_options,
                                                                                cache, progress)
        self.done = "lr" not in rec.pending  # (the TTA check is pending too, but after training: recipe_tta)
        self.precision: str | None = None  # the precision the measurement ran at (for a reader and the tests)

    def on_step_end(self, trainer) -> None:
        if self.done or trainer.switch_trial is not None:
            return
        self.done = True
        if "lr" in self.rec.pending:
            pending = self.rec.pending.pop("lr")
            # a failed measurement is reported and the run goes on at the prior LR (the tuner restored the model)
            prior = {"lr": self.rec.lr, "min_lr": self.rec.min_lr}
            if not guarded(self.rec, "lr", prior, self.rec.lr, self._lr, trainer, pending):
                trainer.decisions["lr"] = self.rec.decisions["lr"]

    def _lr(self, trainer, pending: dict) -> bool:
        import time

        from torchspeed.train.batch import default_loss
        from torchspeed.train.sampler import keep_rng
        from torchspeed.train.schedule import rescale_lr

        before = float(self.rec.lr)
        self.precision = trainer.precision.name
        loss_fn = self.loss_fn or (default_loss(self.rec.label_smoothing) if self.rec.label_smoothing else None)
        t0 = time.perf_counter()
        with keep_rng(self.loader):
            measured = choose_lr_part(trainer.module, _tuning_loader(self.loader), self.rec, optimizer=self.optimizer,
                                  name=self.optimizer, schedule=self.schedule, loss_fn=loss_fn,
                                  lr_steps=pending["lr_steps"], lr_trial_steps=pending["lr_trial_steps"], noise=False,
                                  weight_decay=self.weight_decay, optimizer_options=self.optimizer_options,
                                  precision=self.precision, step_fn=self.step_fn, progress=self.progress)
        seconds = time.perf_counter() - t0
        factor = self.rec.lr / before if before else 1.0
        rescale_lr(trainer.optimizer, trainer.scheduler, factor)
        dec = self.rec.decisions["lr"]
        trainer.decisions["lr"] = Decision(self.rec.lr, f"{dec.reason}; measured at step {trainer.step}, after the "
                                                        f"switch trial, in {self.precision}: the schedule rescaled "
                                                        f"x{factor:.3g} from the prior {before:g}",
                                           measured=(measured or {}) | {"seconds": seconds})
        tuning = trainer.decisions.get("tuning")
        if tuning is not None and tuning.measured is not None:
            tuning.measured["in_run_s"] = seconds
            tuning.measured["in_run_steps"] = pending["cost"]
        if self.cache is not None:
            self.cache.merge(pending["key"], {"lr": {"lr": self.rec.lr, "min_lr": self.rec.min_lr,
                                                     "decision": dict(trainer.decisions["lr"])}})
        return True
