"""Progress bars, the one home of rich's `Progress`: the tuners', the bench's, the doctor's and training's.

- `progress_bar(*columns, enabled=, transient=True)`: a rich `Progress` (rich's default columns unless given),
  silent when `enabled` is False; `transient`: gone from the terminal when done (the tuners and the bench).
- `status_bar(text)`: a spinner, `text` and the time elapsed, for a job of unknown length (the doctor).
- `track(iterable, description=, enabled=)`: a bar over an iterable (the data jobs: packing, checking, benchmarking).
- `TrainProgress`: the training bar: samples/s, loss and time left, shown on rank 0 only. The loss shown is
  the one the loop already reads every `log_every` steps (T13): the bar adds no host-device sync of its own.

rich is imported when a bar is built, not when this module is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator

__all__ = ["TrainProgress", "decisions_header", "progress_bar", "status_bar", "track"]


def progress_bar(*columns, enabled: bool = True, transient: bool = True, console=None):
    """A rich `Progress` with `columns` (none: rich's defaults: description, bar, percent, time left); nothing is
    shown when `enabled` is False; `transient`: the bar is removed when the block ends."""
    from rich.progress import Progress

    return Progress(*columns, disable=not enabled, transient=transient, console=console)


def status_bar(text: str, *, enabled: bool = True, console=None):
    """A transient spinner with `text` and the time elapsed: for a job whose length is unknown."""
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    return progress_bar(SpinnerColumn(), TextColumn(text), TimeElapsedColumn(), enabled=enabled, console=console)


def track(it: Iterable, *, description: str, enabled: bool = True, total: int | None = None) -> Iterator:
    """Yield `it`'s items under a transient bar (rich's `track`); nothing is shown when `enabled` is False."""
    if not enabled:
        yield from it
        return
    with progress_bar() as bar:
        yield from bar.track(it, total=total, description=description)


def decisions_header(decisions: dict) -> str:
    """One line: each automatic switch's value (e.g. "precision fp32 | channels_last True | compile False")."""
    keys = ("precision", "channels_last", "optimizer", "compile", "threads", "switch_trial")
    return "torchspeed: " + " | ".join(f"{k} {getattr(decisions[k], 'value', decisions[k])}"
                                       for k in keys if k in decisions)


class TrainProgress:
    """A rich progress bar with samples/s and ETA (nothing when disabled); `total` may be None (unknown)."""

    REFRESH_S = 0.1

    def __init__(self, *, enabled: bool, total: int | None, header: str | None = None):
        self.enabled = enabled
        self.total = total
        self.header = header  # printed once above the bar: what the loop switched on
        self._p = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn

            self._p = progress_bar(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                                   TextColumn("{task.fields[rate]} samples/s"), TextColumn("loss {task.fields[loss]}"),
                                   TimeRemainingColumn(), transient=False)
            self._p.__enter__()
            if self.header:
                self._p.console.print(self.header)
            self._task = self._p.add_task("train", total=self.total, epoch=1, rate="-", loss="-")
            self._t0 = self._shown = time.perf_counter()
            self._samples = self._pending = 0
        return self

    def advance(self, samples: int, *, loss: float, epoch: int) -> None:
        """Count one step; the bar itself is updated at most every `REFRESH_S` (rich's refresh rate is 10/s,
        and a 1 ms step would otherwise pay for a formatted update it never shows)."""
        if self._p is None:
            return
        self._samples += samples
        self._pending += 1
        now = time.perf_counter()
        if now - self._shown < self.REFRESH_S:
            return
        self._shown = now
        rate = self._samples / max(now - self._t0, 1e-9)
        self._p.update(self._task, advance=self._pending, epoch=epoch + 1, rate=f"{rate:,.0f}",
                       loss="-" if math.isnan(loss) else f"{loss:.4f}")
        self._pending = 0

    def _flush(self) -> None:
        if self._p is not None and self._pending:
            self._p.update(self._task, advance=self._pending)
            self._pending = 0

    def epoch_done(self, row: dict) -> None:
        if self._p is None:
            return
        self._flush()
        parts = [f"epoch {row['epoch']}", f"train_loss {row['train_loss']:.4f}", *_validation(row)]
        parts.append(f"{row['samples_per_s']:,.1f} samples/s")
        self._p.console.print("  ".join(parts))

    def evaluated(self, row: dict) -> None:
        """A validation inside an epoch (eval_every=N under an epoch): one line."""
        if self._p is None:
            return
        self._flush()
        self._p.console.print("  ".join([f"epoch {row['epoch']}, step {row['step']}", *_validation(row)]))

    def __exit__(self, *exc):
        if self._p is not None:
            self._flush()
            self._p.__exit__(*exc)


def _validation(row: dict) -> list[str]:
    """The row's validation figure for its line: val_acc, else val_loss, else none."""
    return [f"{k} {row[k]:.4f}" for k in ("val_acc", "val_loss") if row.get(k) is not None][:1]
