"""The run's validations (T28, T10/T11): at epoch ends, and inside epochs with `eval_every=N` under an epoch
(or `"S"` seconds in an epoch longer than S).

`validate` is `Trainer.evaluate`: the validation set (sharded under DDP, sliced where it is in memory) through
the weights the model is judged by (`eval_view.eval_weights`: the EMA's, Schedule-Free's averaged), reduced
over the ranks. `validate_inside_epoch` runs after an optimizer step that `EvalClock.due_mid` says is due: its
row (`mid_epoch` True: the epoch, step, lr and `val_*`) goes to the callbacks (EarlyStopping, loggers), the
best weights (`restore_best`, best.pt with a step checkpoint) and `FitResult.evaluations`; the epoch rows stay
one an epoch. `epoch_validation` fills an epoch row's `val_*`: evaluated, reused from a validation at this very
step (a stop asked for inside the epoch), or `val_skipped` where `eval_every` leaves the epoch out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from torchspeed.train.parallel.distributed import all_reduce_sum, reduce_metrics
from torchspeed.train.eval_view import eval_weights
from torchspeed.train.evaluate import evaluate
from torchspeed.train.parallel.shard import shard_loader

__all__ = ["validate", "validate_inside_epoch", "epoch_validation"]

log = logging.getLogger("torchspeed")


def validate(trainer, loader: Iterable) -> dict:
    """`loader`'s mean loss and accuracy (and `samples`) for the trainer's model as it is judged."""
    # The plain module: a DDP forward would issue collectives that uneven shards could leave waiting.
    sharded = trainer.dist is not None and not trainer.sharded  # FSDP2: every rank runs the whole set
    if sharded:
        loader = shard_loader(loader, for_eval=True)
    loader = trainer.in_memory.eval(loader)  # in-memory tensors sliced, once per loader
    with eval_weights(trainer) as module:  # the EMA's, or Schedule-Free's averaged weights with their BN statistics
        out = evaluate(module, loader, device=trainer.device, precision=trainer.precision, loss_fn=trainer.loss_fn,
                       step_fn=trainer.step_fn, channels_last=trainer.channels_last, tta=trainer.config.tta,
                       tta_scales=trainer.config.tta_scales)
    if sharded:
        n = out["samples"]
        out = {**reduce_metrics({k: v for k, v in out.items() if k != "samples"}, weight=n),
               "samples": int(all_reduce_sum([n])[0])}
    if out.get("samples") == 0:
        log.warning(f"the validation loader gave no batches at step {trainer.step}: val_loss is NaN and val_acc None"
                    " (an iterator or generator is read once: pass a DataLoader or a list of batches)")
    return out


def _val(out: dict) -> dict:
    return {k: v for k, v in out.items() if k.startswith("val_")}


def validate_inside_epoch(trainer, epoch: int, progress) -> None:
    """A validation after this optimizer step, inside the epoch (see the module docstring)."""
    t = time.perf_counter()
    with trainer._eval.timing():
        metrics = {k: v for k, v in trainer.evaluate(trainer._val_loader).items() if k != "samples"}
    trainer._epoch_eval_s += time.perf_counter() - t  # the epoch's samples/s counts its training alone
    row = {"epoch": epoch + 1, "step": trainer.step, "mid_epoch": True,
           "lr": trainer.optimizer.param_groups[0]["lr"], **metrics}
    trainer._last_eval = row
    trainer._evaluations.append(row)
    progress.evaluated(row)
    trainer.callbacks.on_evaluate(trainer, row)
    improved = trainer.best.update(row, trainer.step, trainer.callbacks.eval_module(trainer.module))
    if improved and trainer.checkpoints is not None and trainer.window.at_boundary:
        trainer.save_checkpoint(best=True)  # a step checkpoint (an exact resume point) and best.pt


def epoch_validation(trainer, row: dict, epoch: int, val_loader: Iterable | None, *, due: bool) -> None:
    """The epoch row's `val_*` (see the module docstring); `due`: the run's EvalClock says this epoch evaluates."""
    if val_loader is None:
        return
    last = trainer._last_eval
    if due and last is not None and last["step"] == trainer.step:
        row.update(_val(last))  # evaluated at this step already (a stop asked for inside the epoch): not twice
        row["val_at_step"] = trainer.step
    elif due:
        with trainer._eval.timing():
            row.update({k: v for k, v in trainer.evaluate(val_loader).items() if k != "samples"})
        trainer._last_eval = None
        if trainer._eval.inside:
            trainer._evaluations.append({"epoch": epoch + 1, "step": trainer.step, "mid_epoch": False, **_val(row)})
    else:
        row["val_skipped"] = True  # eval_every: no validation this epoch (EarlyStopping and best.pt wait)
