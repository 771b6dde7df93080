"""How `Trainer` builds its parts: `TrainerSetup`, which `Trainer` inherits, holds the steps of its
construction that stand apart from the device and the model.

- seeding and determinism, and the reliability options checked;
- the loss (the default cross-entropy, label smoothing);
- the optimizer asked for and its decision, optimizers T18/T26 (optim.py), the LR x world size T17;
- the checkpoint store (files, or DCP folders when sharded), the data position and the best epoch;
- the parts that run the steps: compile T25 (compile.py), device-side metrics T13 (metrics.py), tensors in
  memory T10/T11 (in_memory.py), the noise scale, the NaN/OOM guard (guard.py), the switch trial, callbacks
  and loggers, and the parts a checkpoint holds (stateful.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from torchspeed.train.bnstats import batchnorm_layers
from torchspeed.train.config import TrainConfig, check_reliability_options
from torchspeed.train.in_memory import InMemory
from torchspeed.train.loggers import LoggerCallback
from torchspeed.train.loop.batch_notes import check_step_fn
from torchspeed.train.loop.callbacks import Callback, CallbackList
from torchspeed.train.loop.guard import NonFiniteGuard
from torchspeed.train.trial.half_fallback import fall_back_to_fp32, half_unasked, watched
from torchspeed.train.loop.lean_step import step_with_torch
from torchspeed.train.loop.metrics import DeviceMeter
from torchspeed.train.loop.segment import BestEpoch
from torchspeed.train.losses import default_loss
from torchspeed.train.noise import NoiseScaleEstimator
from torchspeed.train.optim import (SCHEDULE_FREE_BN_BATCHES, averaged_weights, create_optimizer, is_schedule_free,
                                    optimizer_record, train_mode)
from torchspeed.train.parallel.distributed import all_reduce_max, broadcast_object, scale_groups_world_size
from torchspeed.train.parallel.fsdp import check_optimizer
from torchspeed.train.sampler import DataPosition
from torchspeed.train.schedule import as_schedule
from torchspeed.train.state.checkpoint import CheckpointManager
from torchspeed.train.state.dcp import ShardedCheckpoints
from torchspeed.train.state.resume import trainer_parts
from torchspeed.train.state.rng import enable_determinism, seed_everything
from torchspeed.train.trial.autoswitch import SwitchStage
from torchspeed.train.trial.compile import CompileController
from torchspeed.train.trial.dynamo_deferred import deferred_dynamo

__all__ = ["TrainerSetup"]


class TrainerSetup:
    """The construction steps `Trainer.__init__` calls in order; each sets attributes on the trainer."""

    def _seed_and_check(self, cfg: TrainConfig) -> None:
        """Seeds (and determinism, when asked), checks the reliability options, and turns the schedule into the
        function that hands a scheduler over."""
        if cfg.deterministic:  # bit-identical reruns and resumes (docs/reliability.md); costs speed
            enable_determinism()
            seed_everything(cfg.seed if cfg.seed is not None else 0)
        elif cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        check_reliability_options(cfg)
        cfg.schedule = as_schedule(cfg.schedule)  # a scheduler object: as the function that hands it over

    def _setup_loss(self, cfg: TrainConfig, loss_fn: Callable | None, step_fn: Callable | None) -> None:
        """The loss (the default CrossEntropyLoss, label smoothing only there) and the custom step, if any."""
        if loss_fn is None:
            loss_fn = default_loss(cfg.label_smoothing)
        elif cfg.label_smoothing:
            raise ValueError("label_smoothing applies to the default CrossEntropyLoss; "
                             "pass nn.CrossEntropyLoss(label_smoothing=...) as loss_fn instead")
        check_step_fn(step_fn, loss_fn)
        self.loss_fn, self.step_fn = loss_fn, step_fn

    def _build_optimizer(self, optimizer: str | torch.optim.Optimizer, **hyper) -> torch.optim.Optimizer:
        """The optimizer asked for (a name is built for the model) and its decision; the LR x world size (T17)."""
        cfg = self.config
        check_optimizer(optimizer, sharded=self.sharded)
        if isinstance(optimizer, str):
            with deferred_dynamo():  # its first optimizer would import torch._dynamo (train/trial/dynamo_deferred.py)
                optimizer = create_optimizer(optimizer, self.model, fused=cfg.fused_optimizer, **hyper)
        train_mode(optimizer)  # Schedule-Free steps only in train mode (evaluation switches and switches back)
        if not cfg.lean_step:
            step_with_torch(optimizer)  # the naive loop's cost: torch's own step and zero_grad
        if self.decisions.planned:  # fit: the plan records the optimizer and scales the LR (its stages)
            return optimizer
        if "optimizer" not in self.decisions:
            self.decisions["optimizer"] = optimizer_record(optimizer, cfg.fused_optimizer)
        if cfg.scale_lr_world_size and self.dist is not None:  # before the schedule reads the lr as its peak
            self.decisions.refine("lr", scale_groups_world_size(optimizer, self.dist.world_size))
        return optimizer

    def step_options(self) -> dict:
        """What runs between the window's backward and the optimizer's step (`step.optimizer_step`): the callbacks'
        `on_before_optimizer_step`, then the clipping of the model's gradients (T20: each value, then the norm);
        empty where there is none, so the step pays nothing for them."""
        cfg, opts = self.config, {}
        if self.callbacks.grad_hooks:
            opts["before_step"] = lambda: self.callbacks.on_before_optimizer_step(self, self.optimizer)
        if cfg.clip_grad_norm is not None or cfg.clip_grad_value is not None:
            opts.update(clip_grad_norm=cfg.clip_grad_norm, clip_grad_value=cfg.clip_grad_value,
                        parameters=self.model.parameters())
        return opts

    def _setup_checkpoints(self, on_checkpoint: Callable[[str, int], object] | None) -> None:
        """The checkpoint store (files, or DCP folders when sharded), the data position and the best epoch."""
        cfg = self.config
        self.checkpoints = ((ShardedCheckpoints if self.sharded else CheckpointManager)(
            cfg.checkpoint_dir, keep_last=cfg.keep_last) if cfg.checkpoint_dir else None)
        self.on_checkpoint = on_checkpoint  # (path, step) on every rank after each checkpoint (Ray: report)
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self.position = DataPosition(keep_rng=self.checkpoints is not None)
        self.best = BestEpoch(cfg.best_metric, self.checkpoints.best_path if self.checkpoints else None,
                              view=lambda: averaged_weights(self.optimizer))  # Schedule-Free: the weights evaluated

    def _setup_run_parts(self, cfg: TrainConfig, optimizer: torch.optim.Optimizer,
                         on_checkpoint: Callable[[str, int], object] | None,
                         callbacks: Iterable[Callback] | None, loggers: Iterable | None) -> None:
        """What runs the steps after the optimizer: the compiler (T25), the meter, in-memory data (T10/T11), the
        noise scale, the guard, the switch trial, checkpoints, the run's bookkeeping, callbacks and loggers, and
        the parts a checkpoint holds."""
        # T25: which module runs the forward (eager, compiled, or the compile="auto" trial deciding).
        self.compiler = CompileController(self.model, cfg.compile, device=self.device, mode=cfg.compile_mode,
                                          min_run_s=cfg.compile_min_run_s, decide_all_ranks=broadcast_object,
                                          decisions=self.decisions)
        self.meter = DeviceMeter(self.device)
        self.in_memory = InMemory(self.device)  # T10/T11: tensors in memory served as index slices
        self.noise = NoiseScaleEstimator()
        self.guard = NonFiniteGuard(cfg.max_nonfinite, optimizer=optimizer, device=self.device,
                                    precision_skips=self.precision.scaler is not None,  # fp16: the scaler skips
                                    all_ranks_max=all_reduce_max if self.dist is not None else None)
        if watched(self):  # a half precision the run chose, whose gradients break, gives way to fp32
            self.guard.watch_half(lambda: half_unasked(self), lambda: fall_back_to_fp32(self))
        self.step, self._last_loss = 0, float("nan")  # optimizer steps taken; the loss read at the last log sync
        self.stepper = None  # (batch, train_step) -> None: what a "first_steps" stage armed to step batches in place
        self.loader_layout = False  # this epoch's batches copied to channels_last (`batches`; read by trial_layout)
        self.switcher = SwitchStage(self, prepared=self.sharded)  # the switch trial: arms `stepper` while live
        self._setup_checkpoints(on_checkpoint)
        self._steps_per_epoch, self._ramp, self._history = None, None, []  # set by fit
        self._evaluations: list[dict] = []  # every validation's row, inside epochs (eval_every) and at their ends
        self._val_loader, self._last_eval, self._epoch_eval_s = None, None, 0.0
        self._left_out_one = False  # guard.step_failed left out a 1-sample batch BatchNorm refused (said once)
        # Every callback and logger behind one object: the loop calls each event in one line.
        self.callbacks = CallbackList([*(callbacks or ()), *([LoggerCallback(loggers)] if loggers else [])])
        self.should_stop = False  # set by request_stop (a callback): the run ends after this step or epoch
        # Schedule-Free with BatchNorm: the last batches, to give the averaged weights their own statistics
        self._recent = (collections.deque(maxlen=SCHEDULE_FREE_BN_BATCHES) if is_schedule_free(optimizer)
                        and batchnorm_layers(self.module) else None)
        self.stateful: dict = trainer_parts(self)  # name -> part a checkpoint holds (stateful.py); add your own
