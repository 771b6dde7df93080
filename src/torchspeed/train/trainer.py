"""The fast loop: `fit` and `Trainer` compose the training techniques and hold none of them.

Each technique lives in its own module as a public function (precision T21, channels_last
T23, backends T22, optimizers T18/T26, schedules T14/T16/T17, accumulation and clipping
T19/T20, transfer and prefetch T07/T12, device-side metrics T13, compile T25, validation
T28/T33, label smoothing T32). The trainer only decides which to switch on and calls them
in order, so a reader can follow one training step from top to bottom in `train_step`.

Every switch is in `TrainConfig`; `TrainConfig.naive()` turns them all off, which is what
the bench's `naive` row runs.

Example:
    >>> result = torchspeed.fit(model, train_loader, epochs=5, val_loader=val_loader)
    >>> result.history[-1]["val_acc"]
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from torchspeed._io import atomic_write_text, write_json
from torchspeed.train.backends import configure_backends
from torchspeed.train.checkpoint import FORMAT as CHECKPOINT_FORMAT
from torchspeed.train.checkpoint import (CheckpointError, CheckpointManager, FoundCheckpoint, ResumeMismatchError,
                                         check_state_dict, load_checkpoint)
from torchspeed.train.compile import MIN_RUN_S, CompileController, sync
from torchspeed.train.distributed import (DistInfo, all_reduce_sum, broadcast_object, convert_sync_batchnorm,
                                          is_rank_zero, maybe_init_distributed, reduce_metrics, scale_lr_world_size,
                                          shard_loader, wrap_ddp)
from torchspeed.train.evaluate import evaluate
from torchspeed.train.guard import (NonFiniteLossError, TrainingOutOfMemoryError, is_out_of_memory,
                                    out_of_memory_error, supports_device_skip)
from torchspeed.train.memory_format import apply_channels_last, has_conv2d
from torchspeed.train.metrics import DeviceMeter
from torchspeed.train.optim import create_optimizer, zero_grad
from torchspeed.train.precision import Precision, make_grad_scaler, resolve_precision
from torchspeed.train.rng import capture_rng_state, enable_determinism, restore_rng_state, seed_everything
from torchspeed.train.sampler import ResumableSampler
from torchspeed.train.schedule import create_scheduler
from torchspeed.train.step import backward, optimizer_step
from torchspeed.train.transfer import Prefetcher

__all__ = ["TrainConfig", "Trainer", "FitResult", "fit"]

log = logging.getLogger("torchspeed")


@dataclass
class TrainConfig:
    """Every switch of the loop. Defaults are torchspeed's automatic choice."""

    epochs: int = 1
    precision: str = "auto"             # T21: "auto" | "fp32" | "bf16" | "fp16"
    channels_last: bool | str = "auto"  # T23: "auto" = on when the model has 2D convolutions
    compile: bool | str = "auto"        # T25: "auto" = keep compiled only if a measured trial is faster
    compile_mode: str | None = None     # None (inductor default) | "reduce-overhead" (CUDA graphs) | ...
    compile_min_run_s: float = MIN_RUN_S  # compile="auto" leaves runs with less eager time than this eager
    cudnn_benchmark: bool | str = "auto"  # T22: "auto" = on for CUDA (fixed shapes)
    set_to_none: bool = True            # T26
    fused_optimizer: bool | str = "auto"  # fused/foreach kernels (T18)
    prefetch: bool = True               # T07/T12: side-stream copies on CUDA
    grad_accum: int = 1                 # T19
    clip_grad_norm: float | None = None  # T20
    label_smoothing: float = 0.0        # T32
    schedule: str | None = "onecycle"   # T14/T16: "onecycle" | "cyclic" | "cosine" | None
    warmup_steps: int | None = None
    min_lr: float | None = None
    log_every: int = 50                 # T13: host reads the loss every N steps (1 = .item() each step)
    max_steps: int | None = None        # stop after this many optimizer steps in total
    tta: str | None = None              # T33: None | "flip"
    tta_scales: tuple[float, ...] = ()
    progress: bool = True
    out_dir: str | None = None          # per-epoch metrics.csv / metrics.json
    seed: int | None = None
    distributed: bool | str = "auto"    # T31: "auto" = DDP when torchrun started more than one process
    sync_batchnorm: bool = False        # SyncBatchNorm over all ranks (GPUs only; for small per-GPU batches)
    static_graph: bool = False          # DDP static_graph: only if every step uses the same parameters
    scale_lr_world_size: bool = False   # T17: lr x world_size (the global batch is world_size times larger)
    # Reliability (docs/reliability.md): checkpoints, exact resume, guards.
    checkpoint_dir: str | None = None   # write checkpoints here (atomic, checksummed)
    checkpoint_every: int | None = None  # optimizer steps between checkpoints (None: at each epoch end only)
    keep_last: int = 3                  # step checkpoints kept (best.pt is kept besides)
    best_metric: str | None = "auto"    # best.pt by this epoch metric: "auto" = val_acc, else val_loss/train_loss
    resume: str | None = None           # None | "auto" (newest good checkpoint in checkpoint_dir) | a .pt path
    max_nonfinite: int | None = 20      # stop after this many NaN/inf-loss steps in a row (each one is skipped)
    deterministic: bool = False         # deterministic kernels + seeded RNGs: bit-identical reruns (slower)

    @classmethod
    def naive(cls, **overrides) -> "TrainConfig":
        """The loop the seeds call "before": fp32, NCHW, memset zero_grad, .item() every step, no compile."""
        base = dict(precision="fp32", channels_last=False, compile=False, cudnn_benchmark=False,
                    set_to_none=False, fused_optimizer=False, prefetch=False, log_every=1)
        base.update(overrides)
        return cls(**base)


@dataclass
class FitResult:
    history: list[dict]
    config: dict
    decisions: dict
    steps: int
    skipped_steps: int

    @property
    def final(self) -> dict:
        return self.history[-1] if self.history else {}


class Trainer:
    """Owns the model, optimizer, scaler and schedule for one run; see `fit` for the options."""

    def __init__(self, model: nn.Module, *, loss_fn: Callable | None = None,
                 optimizer: str | torch.optim.Optimizer = "sgd", lr: float = 0.1, weight_decay: float = 5e-4,
                 momentum: float = 0.9, device: torch.device | str | None = None,
                 config: TrainConfig | None = None):
        self.config = cfg = config or TrainConfig()
        if cfg.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {cfg.grad_accum}")
        if cfg.deterministic:  # bit-identical reruns and resumes (docs/reliability.md); costs speed
            enable_determinism()
            seed_everything(cfg.seed if cfg.seed is not None else 0)
        elif cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        _check_reliability_options(cfg)
        # T31: under torchrun, a process group from the environment and this rank's device (cuda:LOCAL_RANK).
        self.dist: DistInfo | None = maybe_init_distributed(cfg.distributed, device=device)
        if self.dist is not None:
            self.device = self.dist.device
        else:
            self.device = torch.device(device) if device is not None else _default_device()
        self.decisions: dict[str, object] = {}

        benchmark = None if cfg.cudnn_benchmark == "auto" else bool(cfg.cudnn_benchmark)
        self.decisions.update(configure_backends(self.device, cudnn_benchmark=False if cfg.deterministic else benchmark))

        model = _unwrap_data_parallel(model)
        self.model = model.to(self.device)
        use_cl = has_conv2d(model) if cfg.channels_last == "auto" else bool(cfg.channels_last)
        if use_cl:
            apply_channels_last(self.model)
        self.channels_last = use_cl
        self.decisions["channels_last"] = use_cl
        self.module = self.model  # the plain module: evaluation, state_dict, checkpoints
        if self.dist is not None:
            # DDP last, after .to(device) and channels_last: it broadcasts rank 0's weights now.
            if cfg.static_graph and cfg.grad_accum > 1:
                raise ValueError("static_graph=True cannot be combined with grad_accum > 1: DDP's static graph "
                                 "does not support the no_sync() micro-steps; drop static_graph or grad_accum")
            synced = False
            if cfg.sync_batchnorm:
                self.module, synced = convert_sync_batchnorm(self.module, device=self.device)
            self.model = wrap_ddp(self.module, device=self.device, static_graph=cfg.static_graph)
            self.decisions["distributed"] = (f"DDP, {self.dist.world_size} processes ({self.dist.backend}), "
                                             f"gradient_as_bucket_view, static_graph={cfg.static_graph}, "
                                             f"sync_batchnorm={synced}")

        self.precision: Precision = resolve_precision(cfg.precision, device=self.device)
        self.scaler = make_grad_scaler(self.precision)
        self.decisions["precision"] = f"{self.precision.name} ({self.precision.reason})"

        if loss_fn is None:
            loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        elif cfg.label_smoothing:
            raise ValueError("label_smoothing applies to the default CrossEntropyLoss; "
                             "pass nn.CrossEntropyLoss(label_smoothing=...) as loss_fn instead")
        self.loss_fn = loss_fn

        if isinstance(optimizer, str):
            optimizer = create_optimizer(optimizer, self.model, lr=lr, weight_decay=weight_decay,
                                         momentum=momentum, fused=cfg.fused_optimizer)
        self.optimizer = optimizer
        self.decisions["optimizer"] = _describe_optimizer(optimizer)
        if cfg.scale_lr_world_size and self.dist is not None:
            for g in optimizer.param_groups:  # before the schedule reads the lr as its peak
                g["lr"] = scale_lr_world_size(g["lr"], world_size=self.dist.world_size)
            self.decisions["lr"] = f"x{self.dist.world_size} (world size, T17): {optimizer.param_groups[0]['lr']:g}"
        self.scheduler = None

        # T25: which module runs the forward (eager, compiled, or the compile="auto" trial deciding).
        self.compiler = CompileController(self.model, cfg.compile, device=self.device, mode=cfg.compile_mode,
                                          min_run_s=cfg.compile_min_run_s, decide_all_ranks=broadcast_object,
                                          decisions=self.decisions)

        self.meter = DeviceMeter(self.device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.step = 0        # optimizer steps taken
        self._micro = 0      # micro-batches since the last optimizer step
        self._last_loss = float("nan")
        # Non-finite loss guard (guard.py): "scaler" (fp16: GradScaler skips), "device" (CUDA + fused
        # optimizer: skipped on the GPU, no sync), "host" (the loss is read each step; free on CPU), "off".
        if cfg.max_nonfinite is None:
            self._nf_mode = "off"
        elif self.scaler is not None:
            self._nf_mode = "scaler"
        else:
            self._nf_mode = "device" if supports_device_skip(self.optimizer, self.device) else "host"
        self._window_bad: torch.Tensor | bool = False  # any NaN/inf loss since the last optimizer step
        self._bad_run = torch.zeros((), dtype=torch.int64, device=self.device)  # skipped steps in a row
        self.checkpoints = CheckpointManager(cfg.checkpoint_dir, keep_last=cfg.keep_last) if cfg.checkpoint_dir else None
        self.last_checkpoint: Path | None = None
        self.resumed_from: Path | None = None
        self._epoch = 0          # position in the data: epoch and micro-batches consumed in it
        self._batch_in_epoch = 0
        self._epoch_rng: dict | None = None  # RNG state when this epoch's loader iterator was created
        self._history: list[dict] = []
        self._best: dict | None = None

    # ------------------------------------------------------------------ the hot path
    def train_step(self, batch) -> torch.Tensor:
        """One micro-batch: forward, backward, and an optimizer step every `grad_accum` calls."""
        cfg = self.config
        x, y = batch[0], batch[1]
        last_micro = self._micro + 1 == cfg.grad_accum
        # DDP: skip the gradient all-reduce on all but the last micro-batch (T19 + T31).
        sync_ctx = self.model.no_sync() if hasattr(self.model, "no_sync") and not last_micro else contextlib.nullcontext()
        with sync_ctx:
            with self.precision.autocast():
                out = self.compiler.forward(x)
                loss = self.loss_fn(out, y)
            backward(loss, scaler=self.scaler, accum_steps=cfg.grad_accum)
        self._micro += 1
        correct = (out.detach().argmax(-1) == y).sum() if out.dim() == 2 and y.dim() == 1 else None
        metered = loss.detach()
        if self._nf_mode == "host":
            bad = not bool(torch.isfinite(metered))  # a host read: free on CPU, one sync on CUDA (unfused)
            self._window_bad = self._window_bad or bad
            if not bad:
                self.meter.update(metered, n=y.shape[0], correct=correct)
        else:
            if self._nf_mode == "device":
                bad_t = ~torch.isfinite(metered)  # stays on the device: no sync
                self._window_bad = bad_t | self._window_bad
                metered = torch.where(bad_t, torch.zeros_like(metered), metered)
            self.meter.update(metered, n=y.shape[0], correct=correct)
        if last_micro:
            self.skipped += self._optimizer_step().to(self.skipped.device)
            zero_grad(self.optimizer, set_to_none=cfg.set_to_none)
            if self.scheduler is not None:
                self.scheduler.step()
            self._micro = 0
            self.step += 1
            if self.step % cfg.log_every == 0:
                # The only host-device sync of the loop, once every log_every steps (T13).
                self._last_loss = float(loss.detach().float().item())
            if self._nf_mode != "off" and (self.device.type != "cuda" or self._nf_mode == "host"
                                           or self.step % cfg.log_every == 0):
                self._check_nonfinite_run()
        return loss.detach()

    def _optimizer_step(self) -> torch.Tensor:
        """The update, skipped when the loss was NaN/inf (guard.py); returns 1 if skipped, else 0, as a tensor."""
        cfg = self.config
        params = self.model.parameters()
        if self._nf_mode in ("off", "scaler"):
            skip = optimizer_step(self.optimizer, scaler=self.scaler, clip_grad_norm=cfg.clip_grad_norm,
                                  parameters=params).to(self.device)
        elif self._nf_mode == "host":
            bad = bool(self._window_bad)
            if self.dist is not None:
                bad = bool(self._window_bad_all_ranks(torch.tensor(float(bad), device=self.device)) > 0)
            if bad:
                skip = torch.ones((), dtype=torch.int64, device=self.device)  # no update at all
            else:
                skip = optimizer_step(self.optimizer, clip_grad_norm=cfg.clip_grad_norm,
                                      parameters=params).to(self.device)
        else:  # "device": fused kernels read `found_inf` and skip the update on the GPU, as for fp16
            flag = self._window_bad_all_ranks(torch.as_tensor(self._window_bad, device=self.device).float())
            self.optimizer.found_inf = flag
            try:
                optimizer_step(self.optimizer, clip_grad_norm=cfg.clip_grad_norm, parameters=params)
            finally:
                del self.optimizer.found_inf
            skip = (flag > 0).to(torch.int64)
        self._window_bad = False
        self._bad_run = (self._bad_run + skip) * skip  # count of skipped steps in a row, on the device
        return skip

    def _window_bad_all_ranks(self, flag: torch.Tensor) -> torch.Tensor:
        # DDP: every rank must skip or step together, or the replicas drift apart.
        if self.dist is not None:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return flag

    def _check_nonfinite_run(self) -> None:
        run = int(self._bad_run)
        limit = self.config.max_nonfinite
        if limit is not None and run >= limit:
            last = f"the last checkpoint, {self.last_checkpoint}, is intact" if self.last_checkpoint else \
                "no checkpoint was written (set checkpoint_dir to keep one)"
            raise NonFiniteLossError(
                f"the loss was NaN or inf in {run} optimizer steps in a row (up to step {self.step}, epoch "
                f"{self._epoch + 1}); each was skipped, and training stopped; {last}. Try a lower learning rate, "
                "gradient clipping (clip_grad_norm=1.0), checking the inputs and labels for NaN/inf, or fp32/bf16 "
                "instead of fp16; max_nonfinite sets how many bad steps in a row are tolerated")

    def _reset_micro(self) -> None:
        """A failed compiled step left partial gradients: drop them and restart the accumulation window."""
        zero_grad(self.optimizer, set_to_none=True)
        self._micro = 0

    def step_batch(self, batch) -> None:
        """Train on one device batch (runs the compile trial while it is undecided)."""
        try:
            self.compiler.run(self.train_step, batch, on_fallback=self._reset_micro, is_fatal=is_out_of_memory)
        except Exception as e:
            if isinstance(e, TrainingOutOfMemoryError) or not is_out_of_memory(e):
                raise
            # Free what the failed step holds before reporting, so the caller can save or retry.
            zero_grad(self.optimizer, set_to_none=True)
            self._micro, self._window_bad = 0, False
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            n = batch[1].shape[0] if len(batch) > 1 and isinstance(batch[1], torch.Tensor) else None
            raise out_of_memory_error(e, batch_size=n, device=self.device, grad_accum=self.config.grad_accum,
                                      precision=self.precision.name) from e

    def batches(self, loader: Iterable) -> Iterator:
        """Iterate `loader` with batches already on the device (prefetched on CUDA)."""
        if self.config.prefetch:
            return iter(Prefetcher(loader, self.device, channels_last=self.channels_last))
        return (_move_plain(b, self.device, self.channels_last) for b in loader)

    def run_steps(self, batches: Iterator, n: int) -> float:
        """Train `n` micro-batches from an iterator of device batches; return seconds (synced)."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.step_batch(next(batches))
        sync(self.device)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ epochs
    def setup_schedule(self, steps_per_epoch: int, epochs: int) -> None:
        total = max(1, math.ceil(steps_per_epoch / self.config.grad_accum) * epochs)
        if self.config.max_steps:
            total = min(total, self.config.max_steps)
        self.scheduler = create_scheduler(self.config.schedule, self.optimizer, total_steps=total,
                                          warmup_steps=self.config.warmup_steps, min_lr=self.config.min_lr)
        self.total_steps = total

    def fit(self, train_loader: Iterable, *, epochs: int | None = None, val_loader: Iterable | None = None) -> FitResult:
        cfg = self.config
        epochs = epochs if epochs is not None else cfg.epochs
        if self.dist is not None:  # T31: each rank trains on its own shard (DistributedSampler)
            train_loader = shard_loader(train_loader, seed=cfg.seed or 0)
        try:
            steps_per_epoch = len(train_loader)  # type: ignore[arg-type]
        except TypeError as e:
            raise TypeError("fit needs a loader with len() (a DataLoader or a list of batches)") from e
        if steps_per_epoch == 0:
            raise ValueError("the training loader is empty: check the dataset path and the batch size")
        if self.scheduler is None:
            self.setup_schedule(steps_per_epoch, epochs)
        self._steps_per_epoch = steps_per_epoch
        start_epoch, start_batch = self._resume(steps_per_epoch) if cfg.resume else (0, 0)
        self.compiler.plan((self.total_steps - self.step) * cfg.grad_accum)  # short runs are not compiled
        history = self._history
        progress = _Progress(enabled=cfg.progress and is_rank_zero(),
                             total=steps_per_epoch * epochs - start_epoch * steps_per_epoch - start_batch)
        done = bool(cfg.max_steps and self.step >= cfg.max_steps)
        with progress:
            for epoch in range(start_epoch, epochs):
                if done:
                    break
                skip = start_batch if epoch == start_epoch else 0  # mid-epoch resume: batches already trained
                self._epoch, self._batch_in_epoch = epoch, skip
                _set_epoch(train_loader, epoch)
                self.model.train()
                if not skip:
                    self.meter.reset()  # else: the sums restored from the checkpoint
                t0 = time.perf_counter()
                seen = 0
                for i, batch in enumerate(self.batches(self._epoch_iter(train_loader, skip))):
                    self.step_batch(batch)
                    self._batch_in_epoch += 1
                    seen += batch[1].shape[0]
                    progress.advance(batch[1].shape[0], loss=self._last_loss, epoch=epoch)
                    if (cfg.checkpoint_every and self._micro == 0 and self.step % cfg.checkpoint_every == 0
                            and self._batch_in_epoch < steps_per_epoch):  # the epoch end saves its own
                        self.save_checkpoint()
                    if cfg.max_steps and self.step >= cfg.max_steps:
                        done = True
                        break
                sync(self.device)
                elapsed = time.perf_counter() - t0
                row = {"epoch": epoch + 1, "step": self.step}
                m = self.meter.compute()
                if self.dist is not None:  # every rank reports global numbers (one all-reduce)
                    m = reduce_metrics({"loss": m["loss"], "acc": m["acc"]}, weight=m["samples"])
                    seen = int(all_reduce_sum([seen])[0])
                row.update(train_loss=m["loss"], train_acc=m["acc"], samples_per_s=seen / max(elapsed, 1e-9),
                           epoch_s=elapsed, lr=self.optimizer.param_groups[0]["lr"],
                           skipped_steps=int(self.skipped.item()))
                if val_loader is not None:
                    row.update({k: v for k, v in self.evaluate(val_loader).items() if k != "samples"})
                history.append(row)
                progress.epoch_done(row)
                self._write_metrics(history)
                if self.checkpoints is not None and self._micro == 0:
                    if self._batch_in_epoch >= steps_per_epoch:  # the position is the next epoch's start
                        self._epoch, self._batch_in_epoch = epoch + 1, 0
                    improved = self._update_best(row)
                    self.save_checkpoint(best=improved)
                if done:
                    break
        return FitResult(history=history, config=asdict(cfg), decisions=dict(self.decisions), steps=self.step,
                         skipped_steps=int(self.skipped.item()))

    # ------------------------------------------------------------------ checkpoints and resume
    def checkpoint_state(self) -> dict:
        """Everything an exact resume needs: weights, optimizer, schedule, scaler, RNGs, data position."""
        return {
            "format": CHECKPOINT_FORMAT, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": capture_rng_state(), "epoch_rng": self._epoch_rng,
            "epoch": self._epoch, "batch_in_epoch": self._batch_in_epoch,
            "steps_per_epoch": getattr(self, "_steps_per_epoch", None), "step": self.step,
            "total_steps": getattr(self, "total_steps", None),
            "skipped": int(self.skipped), "bad_run": int(self._bad_run),
            "meter": {"loss": self.meter._loss.cpu(), "correct": self.meter._correct.cpu(), "n": self.meter._n,
                      "n_acc": self.meter._n_acc},
            "history": _jsonable({"h": self._history})["h"], "best": self._best,
            "config": _jsonable(asdict(self.config)),
        }

    def save_checkpoint(self, *, best: bool = False) -> Path | None:
        """Write a checkpoint now (rank 0 only); `best` also writes best.pt. Returns the path."""
        if self.checkpoints is None or not is_rank_zero():
            return None
        state = self.checkpoint_state()
        self.last_checkpoint = self.checkpoints.save(state, step=self.step)
        if best:
            self.checkpoints.save_best(state)
        return self.last_checkpoint

    def _update_best(self, row: dict) -> bool:
        name = self.config.best_metric
        if name is None:
            return False
        if name == "auto":
            name = next((k for k in ("val_acc", "val_loss", "train_loss") if row.get(k) is not None), None)
        value = row.get(name) if name else None
        if value is None or not math.isfinite(value):
            return False
        higher = "acc" in name
        if self._best is not None and self._best["metric"] == name:
            old = self._best["value"]
            if (value <= old) if higher else (value >= old):
                return False
        self._best = {"metric": name, "value": float(value), "epoch": row["epoch"], "step": self.step}
        return True

    def _resume(self, steps_per_epoch: int) -> tuple[int, int]:
        """Load the checkpoint `resume` points at; return the (epoch, batch) to continue from."""
        cfg = self.config
        if cfg.resume == "auto" or Path(cfg.resume).is_dir():
            manager = self.checkpoints if cfg.resume == "auto" else CheckpointManager(cfg.resume)
            found = manager.latest() if manager is not None else None
            if found is None:
                log.info("resume: no checkpoint in %s yet; starting from the beginning",
                         manager.directory if manager else cfg.resume)
                return 0, 0
        else:
            found = FoundCheckpoint(path=Path(cfg.resume), state=load_checkpoint(cfg.resume))
        state = found.state
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{found.path} holds only weights, not a training state; load it with "
                                  "torchspeed.train.checkpoint.load_checkpoint(path, model=model) before fit, "
                                  "and leave resume unset")
        if state["steps_per_epoch"] not in (None, steps_per_epoch):
            raise ResumeMismatchError(
                f"{found.path} was written with {state['steps_per_epoch']} batches per epoch, but this loader has "
                f"{steps_per_epoch}: resume with the same data and batch size, or use a new checkpoint_dir")
        total = getattr(self, "total_steps", None)
        if self.scheduler is not None and state.get("scheduler") is not None and state.get("total_steps") != total:
            raise ResumeMismatchError(
                f"{found.path} was written by a run of {state.get('total_steps')} optimizer steps, but this run's "
                f"learning-rate schedule spans {total} (epochs or max_steps changed): resume with the same epochs "
                "and max_steps, or start a new run from its weights with load_checkpoint(path, model=model)")
        check_state_dict(self.module, state["model"], source=f"checkpoint {found.path}")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.skipped.fill_(int(state["skipped"]))
        self._bad_run.fill_(int(state["bad_run"]))
        m = state["meter"]
        self.meter._loss.copy_(m["loss"])
        self.meter._correct.copy_(m["correct"])
        self.meter._n, self.meter._n_acc = int(m["n"]), int(m["n_acc"])
        self._history = list(state["history"])
        self._best = state["best"]
        self._epoch_rng = state["epoch_rng"]
        restore_rng_state(state["rng"])
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        self.resumed_from = self.last_checkpoint = found.path
        self.decisions["resumed_from"] = f"{found.path} (epoch {epoch + 1}, batch {batch}, step {self.step})"
        if found.skipped:
            self.decisions["resume_passed_over"] = list(found.skipped)
        log.warning("resuming from %s: epoch %d, batch %d, step %d", found.path, epoch + 1, batch, self.step)
        return epoch, batch

    def _epoch_iter(self, loader: Iterable, skip: int) -> Iterator:
        """This epoch's iterator over `loader`, positioned after `skip` batches (exact mid-epoch resume)."""
        if not skip:
            # The loader's order (DataLoader(shuffle=True)) is drawn from the global generator now: keep its state.
            self._epoch_rng = capture_rng_state() if self.checkpoints is not None else None
            return iter(loader)
        at_checkpoint = capture_rng_state()
        if self._epoch_rng is not None:
            restore_rng_state(self._epoch_rng)  # replay the epoch's order exactly as it was drawn
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        batch_size = getattr(loader, "batch_size", None)
        if isinstance(sampler, ResumableSampler) and batch_size:
            sampler.start_at(min(skip * batch_size, len(sampler)))  # no reading: the sampler starts there
            it = iter(loader)
        else:
            it = iter(loader)
            for _ in range(skip):  # any other loader: read and drop the batches already trained on
                if next(it, None) is None:
                    break
        restore_rng_state(at_checkpoint)  # the generators continue from where the checkpoint left them
        return it

    def evaluate(self, loader: Iterable) -> dict:
        # The plain module: a DDP forward would issue collectives that uneven shards could leave waiting.
        model = self.module
        if self.dist is not None:
            loader = shard_loader(loader, for_eval=True)
        out = evaluate(model, loader, device=self.device, precision=self.precision, loss_fn=self.loss_fn,
                       channels_last=self.channels_last, tta=self.config.tta, tta_scales=self.config.tta_scales)
        if self.dist is not None:
            n = out["samples"]
            out = {**reduce_metrics({k: v for k, v in out.items() if k != "samples"}, weight=n),
                   "samples": int(all_reduce_sum([n])[0])}
        return out

    def _write_metrics(self, history: list[dict]) -> None:
        if not self.config.out_dir or not is_rank_zero():
            return
        out = Path(self.config.out_dir)
        write_json(out / "metrics.json", {"history": history, "decisions": _jsonable(self.decisions),
                                          "config": asdict(self.config)})
        keys = list(dict.fromkeys(k for row in history for k in row))
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=keys)
        w.writeheader()
        w.writerows(history)
        atomic_write_text(out / "metrics.csv", buf.getvalue())


def fit(model: nn.Module, train_loader: Iterable, *, loss_fn: Callable | None = None,
        optimizer: str | torch.optim.Optimizer = "sgd", lr: float | str = 0.1, weight_decay: float = 5e-4,
        epochs: int = 1, val_loader: Iterable | None = None, device: torch.device | str | None = None,
        batch_size: int | str | None = None, loader: str | None = None, **config) -> FitResult:
    """Train `model` on `train_loader` with every technique that pays on this machine.

    `config` takes any `TrainConfig` field (precision, channels_last, compile, grad_accum,
    clip_grad_norm, label_smoothing, schedule, log_every, out_dir, ...).
    `batch_size="auto"` (or an int), `lr="auto"` and `loader="auto"` run the tuners first and
    rebuild the DataLoader from its dataset (see `torchspeed.tune.auto`; T06-T08, T15, T17).

    Example:
        >>> result = fit(model, loader, epochs=3, val_loader=val, precision="auto", compile="auto")
    """
    cfg = config.pop("config", None) or TrainConfig()
    unknown = set(config) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"fit() got unknown option(s) {sorted(unknown)}; "
                        f"valid: {sorted(TrainConfig.__dataclass_fields__)}")
    cfg = replace(cfg, epochs=epochs, **config)
    tuned: dict = {}
    if batch_size is not None or lr == "auto" or loader is not None:
        from torchspeed.tune.auto import tune_for_fit  # measured on this model and machine before training

        train_loader, lr, tuned = tune_for_fit(model, train_loader, batch_size=batch_size, lr=lr, loader=loader,
                                               loss_fn=loss_fn, optimizer=optimizer, weight_decay=weight_decay,
                                               device=device, precision=cfg.precision, schedule=cfg.schedule,
                                               distributed=cfg.distributed, progress=cfg.progress)
    trainer = Trainer(model, loss_fn=loss_fn, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                      device=device, config=cfg)
    trainer.decisions.update(tuned)
    return trainer.fit(train_loader, epochs=epochs, val_loader=val_loader)


# ---------------------------------------------------------------------- helpers
def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _unwrap_data_parallel(model: nn.Module) -> nn.Module:
    if isinstance(model, nn.DataParallel):
        log.warning("fit() got a DataParallel model: unwrapping it. DataParallel runs one process that "
                    "scatters every batch and gathers outputs through GPU 0 each step (T31); use "
                    "`torchspeed launch --nproc N` (DistributedDataParallel) for several GPUs instead.")
        return model.module
    return model


def _describe_optimizer(opt: torch.optim.Optimizer) -> str:
    d = opt.defaults
    kind = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"
    return f"{type(opt).__name__} ({kind})"


def _move_plain(batch, device: torch.device, channels_last: bool):
    # The naive path: a blocking copy of each tensor, no pinning, no side stream.
    out = [b.to(device) if isinstance(b, torch.Tensor) else b for b in batch]
    if channels_last and out[0].dim() == 4:
        out[0] = out[0].contiguous(memory_format=torch.channels_last)
    return out


def _check_reliability_options(cfg: TrainConfig) -> None:
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1 optimizer steps, got {cfg.checkpoint_every}")
    if cfg.checkpoint_every is not None and not cfg.checkpoint_dir:
        raise ValueError("checkpoint_every needs checkpoint_dir: the folder to write checkpoints to")
    if cfg.keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {cfg.keep_last}")
    if cfg.max_nonfinite is not None and cfg.max_nonfinite < 1:
        raise ValueError(f"max_nonfinite must be >= 1 (or None to switch the check off), got {cfg.max_nonfinite}")
    if cfg.resume == "auto" and not cfg.checkpoint_dir:
        raise ValueError("resume='auto' needs checkpoint_dir: the folder to look for checkpoints in")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
        raise FileNotFoundError(f"resume={cfg.resume!r}: no such checkpoint file or folder; pass an existing "
                                ".pt file, a checkpoint folder, or resume='auto' with checkpoint_dir")


def _set_epoch(loader, epoch: int) -> None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)



def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


class _Progress:
    """A rich progress bar with samples/s and ETA (nothing when disabled or not a terminal)."""

    def __init__(self, *, enabled: bool, total: int):
        self.enabled = enabled
        self.total = total
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            self._p = Progress(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[rate]} samples/s"), TextColumn("loss {task.fields[loss]}"),
                               TimeRemainingColumn(), transient=False)
            self._p.__enter__()
            self._task = self._p.add_task("train", total=self.total, epoch=1, rate="-", loss="-")
            self._t0 = time.perf_counter()
            self._samples = 0
        return self

    def advance(self, samples: int, *, loss: float, epoch: int) -> None:
        if self._p is None:
            return
        self._samples += samples
        rate = self._samples / max(time.perf_counter() - self._t0, 1e-9)
        self._p.update(self._task, advance=1, epoch=epoch + 1, rate=f"{rate:,.0f}",
                       loss="-" if math.isnan(loss) else f"{loss:.4f}")

    def epoch_done(self, row: dict) -> None:
        if self._p is None:
            return
        parts = [f"epoch {row['epoch']}", f"train_loss {row['train_loss']:.4f}"]
        if row.get("val_acc") is not None:
            parts.append(f"val_acc {row['val_acc']:.4f}")
        parts.append(f"{row['samples_per_s']:,.1f} samples/s")
        self._p.console.print("  ".join(parts))

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)
