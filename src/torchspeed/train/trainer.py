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
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from torchspeed.train.backends import configure_backends
from torchspeed.train.compile import CompileDecision, CompileTrial, compile_model, sync
from torchspeed.train.distributed import (DistInfo, all_reduce_sum, broadcast_object, convert_sync_batchnorm,
                                          is_rank_zero, maybe_init_distributed, reduce_metrics, scale_lr_world_size,
                                          shard_loader, wrap_ddp)
from torchspeed.train.evaluate import evaluate
from torchspeed.train.memory_format import apply_channels_last, has_conv2d
from torchspeed.train.metrics import DeviceMeter
from torchspeed.train.optim import create_optimizer, zero_grad
from torchspeed.train.precision import Precision, make_grad_scaler, resolve_precision
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
    compile_mode: str | None = None
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
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        # T31: under torchrun, a process group from the environment and this rank's device (cuda:LOCAL_RANK).
        self.dist: DistInfo | None = maybe_init_distributed(cfg.distributed, device=device)
        if self.dist is not None:
            self.device = self.dist.device
        else:
            self.device = torch.device(device) if device is not None else _default_device()
        self.decisions: dict[str, object] = {}

        self.decisions.update(configure_backends(
            self.device, cudnn_benchmark=None if cfg.cudnn_benchmark == "auto" else bool(cfg.cudnn_benchmark)))

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

        self._forward_model: nn.Module = self.model  # the compiled module once compile is decided
        self._compile_trial = CompileTrial() if cfg.compile == "auto" else None
        self._compiled: nn.Module | None = None
        if cfg.compile is True:
            self._compiled = compile_model(self.model, mode=cfg.compile_mode)
            self._forward_model = self._compiled
            self.decisions["compile"] = "on (asked for)"
        elif cfg.compile is False:
            self.decisions["compile"] = "off"

        self.meter = DeviceMeter(self.device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.step = 0        # optimizer steps taken
        self._micro = 0      # micro-batches since the last optimizer step
        self._last_loss = float("nan")

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
                out = self._forward_model(x)
                loss = self.loss_fn(out, y)
            backward(loss, scaler=self.scaler, accum_steps=cfg.grad_accum)
        self._micro += 1
        correct = (out.detach().argmax(-1) == y).sum() if out.dim() == 2 and y.dim() == 1 else None
        self.meter.update(loss.detach(), n=y.shape[0], correct=correct)
        if last_micro:
            self.skipped += optimizer_step(self.optimizer, scaler=self.scaler, clip_grad_norm=cfg.clip_grad_norm,
                                           parameters=self.model.parameters()).to(self.skipped.device)
            zero_grad(self.optimizer, set_to_none=cfg.set_to_none)
            if self.scheduler is not None:
                self.scheduler.step()
            self._micro = 0
            self.step += 1
            if self.step % cfg.log_every == 0:
                # The only host-device sync of the loop, once every log_every steps (T13).
                self._last_loss = float(loss.detach().float().item())
        return loss.detach()

    def _trial_step(self, batch) -> None:
        """A training step that also times itself for the compile="auto" decision."""
        trial = self._compile_trial
        assert trial is not None
        phase = trial.phase()
        if phase == "compiled" and self._compiled is None:
            self._compiled = compile_model(self.model, mode=self.config.compile_mode)
            self._forward_model = self._compiled
        t0 = time.perf_counter()
        try:
            self.train_step(batch)
        except Exception as e:
            if phase != "compiled":
                raise
            self._fallback_eager(e)
            self.train_step(batch)
            return
        sync(self.device)
        trial.record(phase, time.perf_counter() - t0)
        if trial.phase() == "done":
            decision = broadcast_object(trial.decide())  # every rank runs what rank 0 measured
            self._apply_compile_decision(decision)

    def _fallback_eager(self, e: Exception) -> None:
        msg = f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); continuing eager"
        log.warning(msg)
        zero_grad(self.optimizer, set_to_none=True)
        self._micro = 0
        self._apply_compile_decision(CompileDecision(False, msg, error=str(e)))

    def _apply_compile_decision(self, decision: CompileDecision) -> None:
        self._compile_trial = None
        self._forward_model = self._compiled if decision.use_compiled and self._compiled is not None else self.model
        if not decision.use_compiled:
            self._compiled = None
        self.decisions["compile"] = decision.reason
        self.decisions["compile_detail"] = asdict(decision)

    def step_batch(self, batch) -> None:
        """Train on one device batch (runs the compile trial while it is undecided)."""
        if self._compile_trial is not None:
            self._trial_step(batch)
        else:
            self.train_step(batch)

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
        history: list[dict] = []
        progress = _Progress(enabled=cfg.progress and is_rank_zero(), total=steps_per_epoch * epochs)
        done = False
        with progress:
            for epoch in range(epochs):
                _set_epoch(train_loader, epoch)
                self.model.train()
                self.meter.reset()
                t0 = time.perf_counter()
                seen = 0
                for i, batch in enumerate(self.batches(train_loader)):
                    self.step_batch(batch)
                    seen += batch[1].shape[0]
                    progress.advance(batch[1].shape[0], loss=self._last_loss, epoch=epoch)
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
                if done:
                    break
        return FitResult(history=history, config=asdict(cfg), decisions=dict(self.decisions), steps=self.step,
                         skipped_steps=int(self.skipped.item()))

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
        out.mkdir(parents=True, exist_ok=True)
        _atomic_write(out / "metrics.json", json.dumps({"history": history, "decisions": _jsonable(self.decisions),
                                                         "config": asdict(self.config)}, indent=2))
        keys = list(dict.fromkeys(k for row in history for k in row))
        tmp = out / "metrics.csv.tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(history)
        os.replace(tmp, out / "metrics.csv")


def fit(model: nn.Module, train_loader: Iterable, *, loss_fn: Callable | None = None,
        optimizer: str | torch.optim.Optimizer = "sgd", lr: float = 0.1, weight_decay: float = 5e-4,
        epochs: int = 1, val_loader: Iterable | None = None, device: torch.device | str | None = None,
        **config) -> FitResult:
    """Train `model` on `train_loader` with every technique that pays on this machine.

    `config` takes any `TrainConfig` field (precision, channels_last, compile, grad_accum,
    clip_grad_norm, label_smoothing, schedule, log_every, out_dir, ...).

    Example:
        >>> result = fit(model, loader, epochs=3, val_loader=val, precision="auto", compile="auto")
    """
    cfg = config.pop("config", None) or TrainConfig()
    unknown = set(config) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"fit() got unknown option(s) {sorted(unknown)}; "
                        f"valid: {sorted(TrainConfig.__dataclass_fields__)}")
    cfg = replace(cfg, epochs=epochs, **config)
    trainer = Trainer(model, loss_fn=loss_fn, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                      device=device, config=cfg)
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


def _set_epoch(loader, epoch: int) -> None:
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
