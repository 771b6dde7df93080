"""The fast loop: `Trainer` composes the training techniques and holds none of them.

Each technique lives in its own module as a public function or class: precision T21
(precision.py), channels_last T23 (memory_format.py), backends T22 (backends.py),
optimizers T18/T26 (optim.py), schedules T14/T16/T17 (schedule.py, run_length.py), batch warm-up T17 (batch_ramp.py),
accumulation and clipping T19/T20 (step.py), transfer and prefetch T07 (transfer.py), device-side metrics
T13 (metrics.py), compile T25 (compile.py), validation T28/T33 (evaluate.py), the NaN/OOM guards (guard.py),
exact resume (`stateful` parts: stateful.py, resume.py; files: checkpoint.py, store.py, dcp.py; sampler.py),
DDP and FSDP2 T31 (distributed.py, fsdp.py), the batch contract (batch.py), the progress bar (progress.py). The
trainer calls them in order (a reader can follow one step top to bottom in `train_step`); every switch is in
`TrainConfig` (config.py); the steps of its construction that stand apart are in setup.py (`TrainerSetup`).
`torchspeed.fit` (fitting.py: the plan, then this) is the one-call entry point.

Example:
    >>> trainer = Trainer(model, config=TrainConfig(epochs=5))
    >>> result = trainer.fit(train_loader, val_loader=val_loader)
    >>> result.history[-1]["val_acc"]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from torchspeed.env import DeviceCaps, default_device, sync
from torchspeed.train.trial.autoswitch import arm_switch_trial
from torchspeed.train.trial.switch_choice import Switches, rule_choice
from torchspeed.train.trial.backends import BACKEND_KEYS, apply_backends, decide_backends
from torchspeed.train.loop.batch import batch_size, forward_loss
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.state.checkpoint import FORMAT as CHECKPOINT_FORMAT
from torchspeed.train.trial.compile import arm_compile_trial
from torchspeed.train.config import TrainConfig, parse_eval_every
from torchspeed.train.parallel.distributed import (DistInfo, all_reduce_sum, is_rank_zero, maybe_init_distributed,
                                                   reduce_metrics, unwrap_data_parallel)
from torchspeed.train.state.dcp import notify_checkpoint
from torchspeed.train.evaluate import EvalClock
from torchspeed.train.parallel.fsdp import single_process_group, wrap_parallel
from torchspeed.train.loop.guard import is_out_of_memory, step_failed
from torchspeed.train.trial.memory_format import apply_channels_last
from torchspeed.train.loop.metrics import TRAIN_COUNT_ELEMENTS, jsonable, train_accuracy, write_metrics
from torchspeed.train.noise import observe_batch
from torchspeed.train.decision import Decisions
from torchspeed.train.eval_view import settle_averaged
from torchspeed.train.optim_info import default_lr
from torchspeed.train.optim import averaged_weights, train_mode
from torchspeed.train.optim_kernel import zero_grad
from torchspeed.train.trial.precision import MixedPrecision, Precision
from torchspeed.train.loop.progress import TrainProgress, decisions_header
from torchspeed.train.state.resume import resume_run
from torchspeed.train.loop.run_length import RunLength, ran_out
from torchspeed.train.sampler import loader_length, set_epoch
from torchspeed.train.parallel.shard import shard_loader
from torchspeed.train.state.stateful import collect_state
from torchspeed.train.batch_ramp import join_ramp
from torchspeed.train.loop.segment import record_stop, schedule_for_call, start_schedule
from torchspeed.train.loop.setup import TrainerSetup
from torchspeed.train.result import FitResult
from torchspeed.train.loop.step import AccumulationWindow, closure_for, needs_closure
from torchspeed.train.transfer import Prefetcher, batch_layout, to_device
from torchspeed.train.validation import epoch_validation, validate, validate_inside_epoch

__all__ = ["Trainer"]

log = logging.getLogger("torchspeed")


class Trainer(TrainerSetup):
    """Owns the model, optimizer, precision and schedule for one run; see `torchspeed.fit` for the options.

    `loss_fn(output, target)` replaces the default cross-entropy; `step_fn(model, batch)` returns the loss for
    batches the contract in `batch.py` does not cover. `callbacks` (callbacks.py: EarlyStopping, EMA, your own) and
    `loggers` (loggers.py) are objects, kept out of the config written to metrics.json and checkpoints. `stateful`
    maps a name to each part a checkpoint holds and a resume restores (stateful.py); register your own there.
    `first_steps`: (trainer, loader, steps left) -> None each, at `fit`'s start: fit's plan's "first_steps" stages.
    `decisions`: fit's plan's (`Decisions.planned`: applied, none made here); `process_group`: the plan's.
    """

    def __init__(self, model: nn.Module, *, loss_fn: Callable | None = None, step_fn: Callable | None = None,
                 optimizer: str | torch.optim.Optimizer = "sgd", lr: float | None = None, weight_decay: float | None = None,
                 momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999), device: torch.device | str | None = None,
                 config: TrainConfig | None = None, caps: DeviceCaps | None = None,
                 callbacks: Iterable[Callback] | None = None, loggers: Iterable | None = None, mesh=None,
                 on_checkpoint: Callable[[str, int], object] | None = None, decisions: Mapping | None = None,
                 first_steps: Iterable[Callable] | None = None, process_group: DistInfo | None = None):
        self.config = cfg = config or TrainConfig()
        self.first_steps = tuple(first_steps) if first_steps is not None else (arm_switch_trial, arm_compile_trial)
        self.window = AccumulationWindow(cfg.grad_accum)  # T19: k micro-batches per optimizer step
        self._seed_and_check(cfg)
        self._setup_device(cfg, device, caps, decisions, process_group)
        self._place_model(model, cfg, mesh)
        self._setup_loss(cfg, loss_fn, step_fn)

        self.optimizer = optimizer = self._build_optimizer(optimizer, lr=default_lr(optimizer) if lr is None else lr,
                                                           weight_decay=weight_decay, momentum=momentum, betas=betas)
        self.scheduler, self.total_steps = None, None  # set by fit (setup_schedule)
        self._setup_run_parts(cfg, optimizer, on_checkpoint, callbacks, loggers)

    def _setup_device(self, cfg: TrainConfig, device, caps: DeviceCaps | None, decisions: Mapping | None,
                      process_group: DistInfo | None) -> None:
        """The process group and device (T31; `process_group`: the plan's, set up once), the decisions, the device's
        capabilities, and the backends."""
        # T31: under torchrun, a process group from the environment and this rank's device (cuda:LOCAL_RANK).
        self.dist: DistInfo | None = (process_group if process_group is not None else
                                      maybe_init_distributed(cfg.distributed, device=device))
        if self.dist is None and cfg.parallel == "fsdp2":  # FSDP2 and DCP need a group, even of one process
            self.dist = single_process_group(device)
        self.sharded = False  # FSDP2 (fsdp.py): checkpoints in DCP folders (dcp.py), and no switch trial
        self.device = self.dist.device if self.dist is not None else default_device(device)
        self.decisions = decisions if isinstance(decisions, Decisions) else Decisions(decisions or {})  # the plan's
        self.caps = caps or DeviceCaps.of(self.device)  # what the device accelerates (tests inject it)
        if not self.decisions.planned and not any(k in self.decisions for k in BACKEND_KEYS):  # fit: "backends"
            self.decisions.update(decide_backends(self.device, cfg))
        apply_backends(self.device, self.decisions)

    def _place_model(self, model: nn.Module, cfg: TrainConfig, mesh) -> None:
        """The model on the device: its precision and layout decided (the rules' channels_last applied by
        `apply_pending_layout` where no switch sets one; at once under a process group), wrapped for DDP or FSDP2
        under a process group, and the mixed precision (T21) that runs it."""
        model = unwrap_data_parallel(model)
        on_cpu = self.device.type == "cpu" and all(t.device.type == "cpu" for t in (*model.parameters(),
                                                                                   *model.buffers()))
        self.model = model if on_cpu else model.to(self.device)  # .to walks every module even where all is there
        if "precision" not in self.decisions:  # the rules' precision and layout: fit's plan decided them ("rules")
            self.decisions.update(rule_choice(self.model, caps=self.caps, precision=cfg.precision,
                                              channels_last=cfg.channels_last)[1])  # `prepare` measures "auto" ones
        prior = Switches((rules := self.decisions)["precision"].value, bool(rules["channels_last"].value))
        # The rules' layout is put into effect at the start of `fit`, after its first-steps parts, where none of them
        # (the switch trial, whose first candidate is the plain layout; a resume) set one: a conv net is not copied
        # to channels_last here and back by the trial's first step. Under DDP the buckets follow the layout: now.
        self.channels_last, self.layout_pending = False, prior.channels_last
        if self.dist is not None:
            self.apply_pending_layout()
        self.module = self.model  # the plain module: evaluation, state_dict, checkpoints
        if self.dist is not None:  # DDP, or FSDP2 shards (no rank-0 switch trial: a sharded forward is collective)
            self.module, self.model, self.sharded = wrap_parallel(self.module, cfg, self.dist, precision=prior.precision,
                                                                  mesh=mesh, decisions=self.decisions)
        # T21: autocast, the (fp16-scaled) backward and step, and the GradScaler, in one object.
        self.precision = MixedPrecision(Precision(prior.precision, self.device.type, rules["precision"].reason))

    def apply_pending_layout(self) -> None:
        """The rules' memory layout (`_place_model`) put into effect, once, unless the switches set one since."""
        if self.layout_pending:
            apply_channels_last(self.model)
            self.channels_last = True
        self.layout_pending = False

    last_loss = property(lambda self: self._last_loss, doc="The loss read at the last step divisible by log_every "
                                                              "(NaN before): no new device sync.")
    skipped = property(lambda self: self.guard.skipped, doc="Optimizer steps skipped because the loss was NaN/inf "
                                                            "(a device tensor).")

    def request_stop(self, reason: str) -> None:
        """End training after the current step (or epoch); `reason` goes to decisions["stopped"]."""
        self.should_stop = True
        record_stop(self.decisions, reason)  # the first reason stands
        log.warning("stopping: %s", reason)

    # ------------------------------------------------------------------ the hot path
    def train_step(self, batch) -> torch.Tensor:
        """One micro-batch: forward, backward, and an optimizer step every `grad_accum` calls and at the epoch's end."""
        cfg, win = self.config, self.window
        with win.sync(self.model):  # DDP: no gradient all-reduce on all but the last micro-batch (T19 + T31)
            out = self.forward_backward(batch)
        loss = out.loss.detach()
        metered = self.guard.observe(loss)
        if metered is not None:
            correct = out.correct(TRAIN_COUNT_ELEMENTS) if self.meter.counts_now() else None  # train_accuracy
            self.meter.update(metered, n=out.n, correct=None if correct is None else correct[0],
                              counted=None if correct is None else correct[1])
        if win.advance():  # the window's last micro-batch: unscale, clip, step (skipped on NaN/inf)
            closure = closure_for(self.optimizer, loss, lambda: self.forward_backward(batch).loss) if needs_closure(
                self.optimizer) else None  # LBFGS's
            self.guard.step(self.optimizer, lambda: self.precision.step(  # your hook, clipping (setup.py), the step
                self.optimizer, closure=closure, **self.step_options()))
            zero_grad(self.optimizer, set_to_none=cfg.set_to_none)
            if self.scheduler is not None:
                self.scheduler.step()
            self.step += 1
            if self.step % cfg.log_every == 0:
                # The only host-device sync of the loop, once every log_every steps (T13).
                self._last_loss = float(loss.float().item())
            if self.guard.due(self.step, cfg.log_every):
                self.guard.check(where=f"step {self.step}, epoch {self.position.epoch + 1}",
                                 last_checkpoint=self.last_checkpoint)
        return loss

    def forward_backward(self, batch):
        """Forward under autocast (records decisions["batch_contract"] once), backward of loss / k (fp16: scaled)."""
        with self.precision.autocast():
            out = forward_loss(self.compiler, batch, loss_fn=self.loss_fn, step_fn=self.step_fn,
                               decisions=self.decisions)
        self.precision.backward(out.loss, accum_steps=self.window.size)  # a partial window: its own size
        return out

    def reset_micro(self) -> None:
        """A failed step left partial gradients: drop them and restart the accumulation window."""
        zero_grad(self.optimizer, set_to_none=True)
        self.window.reset()
        self.guard.reset_window()

    def step_batch(self, batch) -> None:
        """Train on one device batch: the armed `stepper` steps it (the switch trial's turns, while it is live),
        else the compile trial's controller (eager, or compiled once it decided)."""
        try:
            if self.stepper is not None:  # armed by a "first_steps" stage (the switch trial, while it is live)
                self.stepper(batch, self.train_step)
            else:
                self.compiler.run(self.train_step, batch, on_fallback=self.reset_micro, is_fatal=is_out_of_memory)
        except Exception as e:  # out of memory: what to try; BatchNorm on an epoch's 1-sample last batch: left out;
            return step_failed(self, e, batch)  # right after a trial candidate's turn: trained again; else raises
        if self._recent is not None:  # Schedule-Free with BatchNorm: statistics for the averaged weights
            self._recent.append(batch)

    def batches(self, loader: Iterable) -> Iterator:
        """Iterate `loader` with batches on the device (prefetched on CUDA), in the model's memory layout even
        when the switch trial changes it mid-epoch (else every convolution runs in the inputs' layout)."""
        self.apply_pending_layout()  # a Trainer stepped without fit (the benches' run_steps): the rules' layout now
        self.loader_layout = made_with = self.channels_last  # the batches copied to channels_last (trial_layout)
        moved = (Prefetcher(loader, self.device, channels_last=made_with) if self.config.prefetch else
                 (to_device(b, self.device, non_blocking=False, channels_last=made_with) for b in loader))  # naive
        for batch in moved:
            if self.stepper is None and self.channels_last != made_with:  # an armed (trial) step lays out its own
                batch = batch_layout(batch, self.channels_last)  # as is where already in it
                if isinstance(moved, Prefetcher):
                    moved.channels_last = self.channels_last  # the next batches are copied in it
            yield batch

    def run_steps(self, batches: Iterator, n: int) -> float:
        """Train `n` micro-batches from an iterator of device batches; return seconds (synced)."""
        self.apply_pending_layout()
        t0 = time.perf_counter()
        for _ in range(n):
            self.step_batch(next(batches))
        sync(self.device)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ epochs
    def setup_schedule(self, steps_per_epoch: int | None, epochs: int) -> None:
        """The learning-rate schedule over the run: epochs x steps, or max_steps (needed without len())."""
        start_schedule(self, steps_per_epoch, epochs)  # its shape over the run refines the plan's rule

    def fit(self, train_loader: Iterable, *, epochs: int | None = None, val_loader: Iterable | None = None) -> FitResult:
        cfg = self.config
        epochs = epochs if epochs is not None else cfg.epochs
        if self.dist is not None:  # T31: each rank trains on its own shard (DistributedSampler)
            train_loader = shard_loader(train_loader, seed=cfg.seed or 0)
        self._ramp = ramp = join_ramp(train_loader, self.callbacks, self.optimizer, self.decisions)  # T17
        train_loader = self.in_memory.train(train_loader, self.decisions)  # T10/T11, after sharding
        self._steps_per_epoch = steps_per_epoch = loader_length(train_loader, max_steps=cfg.max_steps)
        length = RunLength(epochs, steps_per_epoch, cfg.grad_accum, ramp)
        schedule_for_call(self, length.schedule_span())  # the first call's schedule, or a segment for a later one
        self.reset_micro()  # gradients the user's own steps left before this call are not this run's (nor a window)
        start_epoch, start_batch = (resume_run(self, None if ramp else steps_per_epoch) if cfg.resume else (0, 0))
        for arm in self.first_steps:  # the switch trial (or the rules), then the compile trial: short runs stay eager
            arm(self, train_loader, length.micro_batches_left(self.total_steps, self.step))
        self.apply_pending_layout()  # the rules' layout, where no first-steps part (nor a resume) set one
        total = length.batches_left(start_epoch, start_batch, total_steps=self.total_steps, step=self.step)
        self._eval = EvalClock(parse_eval_every(cfg.eval_every), step=self.step,
                               steps_per_epoch=steps_per_epoch if val_loader is not None else None)
        self._val_loader = val_loader
        done = bool(cfg.max_steps and self.step >= cfg.max_steps)
        self.best.active = cfg.restore_best is True or (cfg.restore_best == "auto" and val_loader is not None)
        self.meter.accuracy_every = train_accuracy(cfg.train_acc, val_loader=val_loader, best_metric=cfg.best_metric,
                                                   callbacks=self.callbacks)
        # on_train_start now, on_train_end("success" | "failed") when the loop ends (callbacks.py)
        with self.callbacks.running(self), TrainProgress(enabled=cfg.progress and is_rank_zero(), total=total,
                                                         header=decisions_header(self.decisions)) as progress:
            passes = length.passes(cfg.max_steps)  # a stream without len(): pass after pass up to max_steps
            for epoch in range(start_epoch, passes):
                if done or self.should_stop:
                    break
                skip = start_batch if epoch == start_epoch else 0  # mid-epoch resume: batches already trained
                done = self._train_epoch(train_loader, epoch, skip, progress, ramp is None or epoch == passes - 1)
                if self._seen == 0 and steps_per_epoch is None:  # a pass with no batch: an iterator read once
                    log.warning(ran_out(self.step, cfg.max_steps))
                    break
                row = self._epoch_row(epoch, val_loader, evaluate=self._eval.due(  # eval_every; the last always
                    self.step, last=done or self.should_stop or epoch == passes - 1))
                progress.epoch_done(row)
                self.callbacks.on_evaluate(self, row)
                self._end_epoch(row)
        self.switcher.finish()  # a run shorter than its trial decides on what it measured
        self.compiler.finish()
        self._eval.record(self.decisions, cfg.eval_every, steps=self.step)  # evaluation's share, if any
        skipped = int(self.skipped.item())
        bad_loss = skipped - self.guard.grad_skips  # a chosen half precision's broken gradients: said at the time
        if bad_loss and is_rank_zero():  # the guard skipped steps: say so once, at the end, with the count
            log.warning(f"{bad_loss} of {self.step} optimizer steps had a NaN/inf loss and were skipped"
                        + (" (every one: the weights did not change)" if bad_loss >= self.step else "")
                        + "; check the inputs and labels for NaN/inf, or try a lower LR or clip_grad_norm=1.0")
        settle_averaged(self)  # Schedule-Free: the model keeps the averaged weights it was evaluated and saved with
        self.best.restore(self.module, self._history, self.decisions)  # restore_best: the best epoch's weights
        return FitResult(history=self._history, config=asdict(cfg), decisions=self.decisions.copy(), steps=self.step,
                         skipped_steps=skipped, evaluations=self._evaluations)

    def _train_epoch(self, train_loader: Iterable, epoch: int, skip: int, progress: TrainProgress, closes: bool) -> bool:
        """One pass over the loader (or until max_steps); returns True when max_steps was reached. `closes`: the
        epoch's end closes the accumulation window (T19; a ramp's schedule counts its run as one pass: its last)."""
        cfg = self.config
        self.position.start_epoch(epoch, skip)
        set_epoch(train_loader, epoch)
        if self._ramp is not None:
            self._steps_per_epoch = len(self._ramp.sizes(epoch))
        self.model.train()
        train_mode(self.optimizer)  # Schedule-Free: back to its training iterate (a fit's end left the average)
        if not skip:
            self.meter.reset()  # else: the sums restored from the checkpoint
        self._t0, self._seen, self._epoch_eval_s = time.perf_counter(), 0, 0.0
        mid = self._eval.start_epoch()  # whether validations can fall inside the epoch
        ends = self._steps_per_epoch if closes else None  # None (no len(), a ramp's epoch but its last): it carries over
        for batch in self.batches(self.position.epoch_iter(train_loader, skip)):
            self.window.left = ends and ends - self.position.batch  # the last window steps at the end, partial or not
            self.step_batch(batch)
            if cfg.noise_scale_every and self.window.at_boundary and self.step % cfg.noise_scale_every == 0:
                observe_batch(self.module, batch, self.noise, loss_fn=self.loss_fn, step_fn=self.step_fn,
                              autocast=self.precision.autocast)  # two half-batch backwards; nothing trained
            self.position.advance()
            if self.callbacks.step_hooks and self.window.at_boundary:
                self.callbacks.on_step_end(self)  # EMA update, logging, a callback's stop (before the save)
            n = batch_size(batch)
            self._seen += n
            progress.advance(n, loss=self._last_loss, epoch=epoch)
            if (mid and self.window.at_boundary and self.position.batch != self._steps_per_epoch
                    and not self._stopped() and self._eval.due_mid(self.step)):  # the epoch end evaluates itself
                validate_inside_epoch(self, epoch, progress)
            if (cfg.checkpoint_every and self.window.at_boundary and self.step % cfg.checkpoint_every == 0
                    and self.position.batch != self._steps_per_epoch):  # the epoch end saves its own
                self.save_checkpoint()
            if (cfg.max_steps and self.step >= cfg.max_steps) or self.should_stop:
                return True
        return False

    def _epoch_row(self, epoch: int, val_loader: Iterable | None, *, evaluate: bool = True) -> dict:
        """The epoch's metrics; `evaluate` False: eval_every leaves this epoch's validation out."""
        sync(self.device)
        elapsed = time.perf_counter() - self._t0 - self._epoch_eval_s
        m, seen = self.meter.compute(), self._seen
        if self.dist is not None:  # every rank reports global numbers (one all-reduce)
            m = reduce_metrics({"loss": m["loss"], "acc": m["acc"]}, weight=m["samples"])
            seen = int(all_reduce_sum([seen])[0])
        row = {"epoch": epoch + 1, "step": self.step, "train_loss": m["loss"], "train_acc": m["acc"],
               "samples_per_s": seen / max(elapsed, 1e-9), "epoch_s": elapsed,
               "lr": self.optimizer.param_groups[0]["lr"], "skipped_steps": int(self.skipped.item())}
        if self.config.noise_scale_every:
            row["noise_scale"] = self.noise.value  # B_simple: about the critical batch size (T17)
        epoch_validation(self, row, epoch, val_loader, due=evaluate)
        return row

    def _end_epoch(self, row: dict) -> None:
        getattr(self.scheduler, "epoch_end", lambda _: None)(row)  # a scheduler of yours stepped per epoch
        self._history.append(row)
        if self.config.out_dir and is_rank_zero():
            write_metrics(self.config.out_dir, self._history, decisions=self.decisions, config=asdict(self.config))
        scored = not row.get("val_skipped")  # an epoch eval_every did not validate is never the best
        if self.checkpoints is not None and self.window.at_boundary:
            pos = self.position
            if pos.batch == self._steps_per_epoch or not (self._steps_per_epoch or self._stopped() or self.should_stop):
                pos.start_epoch(pos.epoch + 1, 0)  # the position is the next epoch's start
            self.save_checkpoint(best=scored and self.best.update(row, self.step,
                                                                  self.callbacks.eval_module(self.module)))
        elif self.checkpoints is None and scored:
            self.best.update(row, self.step, self.callbacks.eval_module(self.module))  # what scored (EMA or not)

    def _stopped(self) -> bool:
        return bool(self.config.max_steps and self.step >= self.config.max_steps)

    # ------------------------------------------------------------------ checkpoints and resume
    def checkpoint_state(self, *, weights: bool = True) -> dict:
        """Everything an exact resume needs: each part in `stateful` under its name (`weights=False`: the
        model and optimizer left out, as a sharded run writes them as DCP shards), the config and switches."""
        return {"format": CHECKPOINT_FORMAT, "config": jsonable(asdict(self.config)), "switches": asdict(self.switcher.current()),
                **collect_state(self.stateful, skip=() if weights else ("model", "optimizer"))}

    def save_checkpoint(self, *, best: bool = False) -> Path | None:
        """Write a checkpoint now (rank 0; every rank its shards under FSDP2); `best` also writes best.pt.
        Returns the path; then `on_checkpoint(path, step)` runs on every rank."""
        if self.checkpoints is None:
            return None
        with averaged_weights(self.optimizer):  # Schedule-Free: the averaged weights are the ones saved
            return self._save_checkpoint(best)

    def _save_checkpoint(self, best: bool) -> Path | None:
        if self.sharded:
            self.last_checkpoint = self.checkpoints.save(self.module, self.optimizer, self.checkpoint_state(
                weights=False), step=self.step, best=best)
        elif is_rank_zero():
            state = self.checkpoint_state()
            self.last_checkpoint = self.checkpoints.save(state, step=self.step)
            if best:
                self.checkpoints.save_best(self.callbacks.best_state(state))  # EMA: its weights as "model"
        self.callbacks.on_save(self, self.last_checkpoint)
        notify_checkpoint(self.on_checkpoint, self.checkpoints.path_for(self.step), self.step)
        return self.last_checkpoint

    def evaluate(self, loader: Iterable) -> dict:
        """`loader`'s validation metrics for the model as it is judged (the EMA's or averaged weights)."""
        return validate(self, loader)
