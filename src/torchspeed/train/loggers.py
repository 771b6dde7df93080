"""Loggers: send the loop's metrics to TensorBoard, CSV, MLflow, W&B... (T13: with no extra device sync).

`fit(..., loggers=[...])` takes any object with the Lightning Fabric logger interface:
`log_metrics(metrics: dict, step: int)`, and optionally `log_hyperparams(params: dict)` and
`finalize(status: str)`. So Lightning Fabric's loggers work unchanged
(`lightning.fabric.loggers.CSVLogger`, `TensorBoardLogger`), as does a ten-line adapter for any
tracker. `TensorBoardLogger` here is a built-in one on `torch.utils.tensorboard` (the
`tensorboard` extra) for users without Lightning.

What is logged, at the optimizer step (`trainer.step`):
- every `log_every` steps: `loss` and `lr`. The loss is the value the loop already reads from
  the device at that step (its one host-device sync every `log_every` steps, T13): logging
  adds no sync, whatever the number of loggers.
- every epoch: the epoch row (`train_loss`, `train_acc`, `val_loss`, `val_acc`, `lr`,
  `samples_per_s`, `epoch_s`, `skipped_steps`, `epoch`), the numbers of metrics.csv.
- at the start: the config (`config/<field>`) and the trainer's decisions (`decisions/<name>`,
  e.g. the precision it picked and why) as hyperparameters; at the end, the decisions made
  during the run (compile="auto", a resume, an early stop) when they changed; then `finalize`.
Only rank 0 logs under DDP (`is_rank_zero`): the epoch metrics are already reduced over ranks.

Example:
    >>> from lightning.fabric.loggers import CSVLogger
    >>> fit(model, loader, epochs=5, loggers=[CSVLogger("logs"), TensorBoardLogger("runs/exp1")])
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import asdict

from torchspeed._extras import require
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.parallel.distributed import is_rank_zero

__all__ = ["TensorBoardLogger", "LoggerCallback", "hyperparams"]

log = logging.getLogger("torchspeed")


class TensorBoardLogger:
    """Scalars and hyperparameters to TensorBoard event files under `log_dir` (`torch.utils.tensorboard`).

    The writer (and its folder) is created at the first log call, so only the process that
    logs (rank 0) creates files. Read them with `tensorboard --logdir DIR`.

    Example:
        >>> fit(model, loader, epochs=5, loggers=[TensorBoardLogger("runs/exp1")])
    """

    def __init__(self, log_dir: str | os.PathLike = "runs", *, flush_secs: int = 30):
        require("tensorboard", "tensorboard", feature="TensorBoardLogger")
        self.log_dir, self.flush_secs = str(log_dir), flush_secs
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, flush_secs=self.flush_secs)
        return self._writer

    def log_metrics(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def log_hyperparams(self, params: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        # As Lightning does: the hparams summaries go to this run's own event file (add_hparams
        # would open a new sub-run), and a text table for reading them without the HPARAMS tab.
        writer = self.writer._get_file_writer()
        for summary in hparams(params, {}):
            writer.add_summary(summary)
        self.writer.add_text("hparams", "\n".join(["| name | value |", "|---|---|"]
                                                  + [f"| {k} | {v} |" for k, v in params.items()]))

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def hyperparams(trainer) -> dict:
    """The run's config and decisions as one flat dict of scalars (`config/epochs`, `decisions/precision`, ...)."""
    flat = {f"config/{k}": v for k, v in asdict(trainer.config).items()}
    flat.update({f"decisions/{k}": v for k, v in trainer.decisions.items()})
    return {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in flat.items()}


def _scalars(row: dict) -> dict:
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class LoggerCallback(Callback):
    """The callback `fit(loggers=...)` adds: forwards the trainer's numbers to each logger (rank 0 only)."""

    def __init__(self, loggers: Iterable):
        self.loggers = list(loggers)
        for i, lg in enumerate(self.loggers):
            if not callable(getattr(lg, "log_metrics", None)):
                raise TypeError(f"loggers[{i}] ({type(lg).__name__}) has no log_metrics(metrics, step): pass a "
                                "Lightning Fabric logger, torchspeed.train.loggers.TensorBoardLogger, or an object "
                                "with log_metrics / log_hyperparams / finalize")
        self._hparams: dict = {}

    def _each(self, method: str, *args) -> None:
        for lg in self.loggers:
            fn = getattr(lg, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except NotImplementedError:  # e.g. Fabric's CSVLogger.log_hyperparams
                log.debug("%s.%s is not implemented; skipped", type(lg).__name__, method)

    def on_train_start(self, trainer) -> None:
        if is_rank_zero():
            self._hparams = hyperparams(trainer)
            self._each("log_hyperparams", dict(self._hparams))

    def on_step_end(self, trainer) -> None:
        # Same condition as the trainer's read of the loss: `last_loss` is this step's, already on the host.
        if trainer.step % trainer.config.log_every == 0 and is_rank_zero():
            loss = trainer.last_loss
            metrics = {"lr": float(trainer.optimizer.param_groups[0]["lr"])}
            if not math.isnan(loss):
                metrics["loss"] = loss
            self._each("log_metrics", metrics, trainer.step)

    def on_evaluate(self, trainer, metrics: dict) -> None:
        if is_rank_zero():
            self._each("log_metrics", _scalars(metrics), trainer.step)

    def on_train_end(self, trainer, status: str) -> None:
        if not is_rank_zero():
            return
        changed = {k: v for k, v in hyperparams(trainer).items() if self._hparams.get(k) != v}
        if changed:
            self._each("log_hyperparams", changed)
        self._each("finalize", status)
