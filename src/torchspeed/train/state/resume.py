"""Exact resume: the trainer's stateful parts, which checkpoint a run continues, and whether it can.

The trainer registers its parts in `Trainer.stateful` (`trainer_parts`): the weights, the
optimizer, the LR schedule, the GradScaler ("scaler"), the run's progress ("run": step,
history, best epoch, a callback's stop, the optimizer's class name), the NaN guard's counts,
the running metric sums, the callbacks, the data position and the RNG states. A checkpoint
nests each part's state under its name (stateful.py), and a resume restores them in one loop.

The policy around the loop, here:

- `find_state`: what `resume` points at ("auto": the newest good checkpoint; a folder; a
  file), for single-file and sharded (DCP, dcp.py) checkpoints alike.
- `check_resumable`: the checkpoint is a training state this run can continue exactly (same
  batches per epoch, same schedule length, same optimizer class: the "run" part records its
  name, and a checkpoint from before that is not compared) or extend (a finished run given
  more steps: T14's schedule gets a new segment, segment.py); otherwise `ResumeMismatchError`
  says what changed and what to do. A checkpoint of the older flat layout is read through `nested_layout`.
- `is_extension`: a finished run given more steps.

Example:
    >>> found = find_state("auto", manager, sharded=False, world_size=1, steps_per_epoch=100)
    >>> state = check_resumable(found, steps_per_epoch=100, total_steps=1000, has_scheduler=True,
    ...                         optimizer="AdamW")
    >>> restore_state(trainer.stateful, state, source=found.path)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from torchspeed.train.state.checkpoint import (FLAT_FORMAT, FORMAT, CheckpointError, CheckpointManager, FoundCheckpoint,
                                               ResumeMismatchError, check_state_dict, load_checkpoint, nested_layout)
from torchspeed.train.state.dcp import ShardedCheckpoints
from torchspeed.train.decision import Decision
from torchspeed.train.loop.metrics import jsonable
from torchspeed.train.optim_info import OPTIM_INFO
from torchspeed.train.state.rng import capture_rng_state, restore_rng_state
from torchspeed.train.loop.segment import extend_schedule
from torchspeed.train.state.stateful import Part, attribute, check_parts, restore_state
from torchspeed.train.trial.switch_choice import Switches

__all__ = ["trainer_parts", "resume_run", "find_state", "check_resumable", "is_extension", "resumed_decisions"]

log = logging.getLogger("torchspeed")

_OPTIONAL = ("callbacks",)  # may be missing from a checkpoint: each callback that keeps state warns and starts afresh


def trainer_parts(trainer) -> dict:
    """The trainer's own stateful parts, in the order a resume loads them (the RNG states always last)."""
    return {
        "model": trainer.module, "optimizer": trainer.optimizer,
        "scheduler": attribute(trainer, "scheduler"),  # set by fit, replaced when a finished run is extended
        "scaler": attribute(trainer, "precision"),     # replaced when the switch trial picks another precision
        "run": Part(lambda: _run_state(trainer), lambda s: _load_run_state(trainer, s)),
        "guard": trainer.guard, "meter": trainer.meter, "callbacks": trainer.callbacks, "position": trainer.position,
        "rng": Part(capture_rng_state, restore_rng_state),
    }


def _run_state(trainer) -> dict:
    stopped = trainer.decisions.get("stopped")
    return {"step": trainer.step, "total_steps": trainer.total_steps, "steps_per_epoch": trainer._steps_per_epoch,
            "optimizer_class": type(trainer.optimizer).__name__,  # compared at resume (check_resumable)
            "history": jsonable({"h": trainer._history})["h"], "best": trainer.best.record,
            "stopped": dict(stopped) if stopped else None}


def _load_run_state(trainer, state: dict) -> None:
    # total_steps and steps_per_epoch are this run's own (check_resumable compared them with the checkpoint's)
    trainer.step = int(state["step"])
    trainer._history, trainer.best.record = list(state["history"]), state["best"]
    if state.get("stopped"):  # a callback had ended this run: it stays ended
        s = state["stopped"]
        trainer.should_stop = True
        trainer.decisions.refine("stopped", Decision(s["value"], s.get("reason", "")) if isinstance(s, dict) else
                                 Decision(s, "requested during the run"))


def resume_run(trainer, steps_per_epoch: int | None) -> tuple[int, int]:
    """Load the checkpoint `trainer.config.resume` points at into `trainer`; return the (epoch, batch) to
    continue from ((0, 0): no checkpoint yet). Nothing is changed before the checkpoint is known to fit."""
    found = find_state(trainer.config.resume, trainer.checkpoints, sharded=trainer.sharded,
                       world_size=trainer.dist.world_size if trainer.dist is not None else 1,  # sharded: any
                       steps_per_epoch=steps_per_epoch)
    if found is None:
        return 0, 0
    own = callable(trainer.config.schedule)  # your scheduler spans no step count: it goes on from its state
    state = check_resumable(found, steps_per_epoch=steps_per_epoch, total_steps=trainer.total_steps,
                            has_scheduler=trainer.scheduler is not None and not own,
                            optimizer=type(trainer.optimizer).__name__)
    extend = is_extension(state, trainer.total_steps) and not own
    skip = (("model", "optimizer") if trainer.sharded else ()) + (("scheduler",) if extend else ())
    check_parts(trainer.stateful, state, source=found.path, skip=skip, optional=_OPTIONAL)
    if "model" not in skip:  # best.pt with EMA keeps the training weights under "train_model"
        state = {**state, "model": state.get("train_model", state["model"])}
        check_state_dict(trainer.module, state["model"], source=f"checkpoint {found.path}")
    if state.get("switches"):  # first: the optimizer state loads into the layout and kernels it was saved with
        _resume_switches(trainer, state["switches"])
    if trainer.sharded:  # DCP: each rank reads the pieces of its shards
        ShardedCheckpoints.load(found.path, trainer.module, trainer.optimizer)
    restore_state(trainer.stateful, state, source=found.path, skip=skip, optional=_OPTIONAL)
    if extend:  # a finished run given more steps: this run's settings, a new schedule over the added steps
        trainer.scheduler, extended = extend_schedule(
            trainer.optimizer, trainer._group_settings, trainer.config, done=trainer.step, total=trainer.total_steps)
        trainer.decisions.refine("extended", extended)
    epoch, batch = trainer.position.epoch, trainer.position.batch
    trainer.resumed_from = trainer.last_checkpoint = found.path
    for k, d in resumed_decisions(found, epoch=epoch, batch=batch, step=trainer.step).items():
        trainer.decisions.refine(k, d)
    return epoch, batch


def _resume_switches(trainer, switches: dict) -> None:
    """The precision, layout and kernels the resumed run trained with, in effect (no switch trial)."""
    trainer.switcher.apply(Switches(**switches))
    trainer.switcher.prepared = True
    for k in ("precision", "channels_last", "switch_trial"):  # what the rule assumed gives way to what ran
        trainer.decisions.refine(k, Decision(switches.get(k, "resumed"), "as in the run being resumed"))


def find_resume(resume: str | os.PathLike, manager: CheckpointManager | None) -> FoundCheckpoint | None:
    """The checkpoint `resume` points at: "auto" (the newest good one under `manager`), a folder, or a file.

    Returns None when a folder holds no checkpoint yet (a first run with resume="auto").
    """
    if resume == "auto" or Path(resume).is_dir():
        manager = manager if resume == "auto" else CheckpointManager(resume)
        found = manager.latest() if manager is not None else None
        if found is None:
            log.info("resume: no checkpoint in %s yet; starting from the beginning",
                     manager.directory if manager else resume)
        return found
    return FoundCheckpoint(path=Path(resume), state=load_checkpoint(resume))


def find_state(resume: str | os.PathLike, store, *, sharded: bool, world_size: int,
               steps_per_epoch: int | None) -> FoundCheckpoint | None:
    """What `resume` points at, single-file or sharded (a sharded one's data position recomputed for
    `world_size` processes)."""
    if sharded:
        return ShardedCheckpoints.find(resume, store, world_size=world_size, steps_per_epoch=steps_per_epoch)
    return find_resume(resume, store)


def check_resumable(found: FoundCheckpoint, *, steps_per_epoch: int | None, total_steps: int | None,
                    has_scheduler: bool, optimizer: str | None = None) -> dict:
    """The training state in `found` (parts nested), after checking that this run can continue it exactly.
    `optimizer`: this run's optimizer class name, compared with the one the checkpoint records (if any)."""
    state = nested_layout(found.state)
    fmt = state.get("format")
    if isinstance(fmt, str) and fmt.startswith("torchspeed-checkpoint/") and fmt != FORMAT:
        raise CheckpointError(f"{found.path} has checkpoint format {fmt!r}, and this torchspeed reads {FORMAT!r} "
                              f"and {FLAT_FORMAT!r}: resume it with the torchspeed version that wrote it")
    if fmt != FORMAT:
        raise CheckpointError(f"{found.path} holds only weights, not a training state; load it with "
                              "torchspeed.train.state.checkpoint.load_checkpoint(path, model=model) before fit, "
                              "and leave resume unset")
    run = state["run"]
    if run["steps_per_epoch"] not in (None, steps_per_epoch):
        raise ResumeMismatchError(
            f"{found.path} was written with {run['steps_per_epoch']} batches per epoch, but this loader has "
            f"{steps_per_epoch}: resume with the same data and batch size, or use a new checkpoint_dir")
    _check_optimizer_class(found, run.get("optimizer_class"), optimizer)
    if is_extension(state, total_steps):  # a finished run given more steps: a new schedule segment
        if total_steps is not None and total_steps <= run["step"]:
            raise ResumeMismatchError(
                f"{found.path} is the end of a run of {run['step']} optimizer steps and this run asks for "
                f"{total_steps}: nothing to add; ask for more epochs to extend it")
        return state
    if has_scheduler and state.get("scheduler") is not None and run.get("total_steps") != total_steps:
        raise ResumeMismatchError(
            f"{found.path} was written by a run of {run.get('total_steps')} optimizer steps, but this run's "
            f"learning-rate schedule spans {total_steps} (epochs or max_steps changed): resume with the same epochs "
            "and max_steps, or start a new run from its weights with load_checkpoint(path, model=model) "
            "(torchspeed train: --init-from PATH)")
    return state


def _check_optimizer_class(found: FoundCheckpoint, saved: str | None, current: str | None) -> None:
    """A checkpoint's optimizer state continues only in an optimizer of the same class (AdamW's moments are
    not SGD's momentum); a checkpoint that does not record its class (older ones) is not compared."""
    if not saved or not current or saved == current:
        return
    names = [n for n, info in OPTIM_INFO.items()
             if (info.cls if isinstance(info.cls, str) else info.cls.__name__).rpartition(":")[2] == saved]
    same = f"optimizer={names[0]!r} or an instance of {saved}" if names else f"an instance of {saved}"
    raise ResumeMismatchError(
        f"{found.path} was written by a run with the optimizer {saved}, and this run's optimizer is {current}: "
        f"{saved}'s state cannot continue in {current}. Pass the same optimizer to resume ({same}), or start a new "
        "run (a new checkpoint_dir, leaving resume unset) from its weights with load_checkpoint(path, model=model) "
        "(torchspeed train: --init-from PATH)")


def is_extension(state: dict, total_steps: int | None) -> bool:
    """True when `state` (parts nested) is the last checkpoint of a finished run and this run's length
    differs: resuming it continues with a new learning-rate schedule over the added steps."""
    run = state.get("run") or {}
    done = run.get("total_steps")
    return bool(done and total_steps and done != total_steps and run.get("step", 0) >= done)


def resumed_decisions(found: FoundCheckpoint, *, epoch: int, batch: int, step: int) -> dict:
    """The decisions a resume records: where it continues from, and the damaged files passed over."""
    out = {"resumed_from": Decision(str(found.path), f"epoch {epoch + 1}, batch {batch}, step {step}")}
    if found.skipped:
        out["resume_passed_over"] = Decision(list(found.skipped), "damaged or unreadable checkpoints")
    log.warning("resuming from %s: epoch %d, batch %d, step %d", found.path, epoch + 1, batch, step)
    return out
