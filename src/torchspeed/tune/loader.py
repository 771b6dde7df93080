"""DataLoader tuner (T06, T07, T08): num_workers, pin_memory, prefetch_factor, persistent_workers, measured.

What it does: times the loader alone (steady samples/s: from when every worker has delivered
a batch, over at least `batches` batches and `min_time` seconds) at num_workers = 0,
1, ... up to the usable cores, stopping early once throughput plateaus (a worker more gains
under `plateau`, 5%) or once the loader outruns the model step; the counts swept are then
measured again in interleaved rounds (`rounds`, 3) and their medians decide. For the best worker count
it then tries prefetch_factor 4 against the default 2 (T08) and, on CUDA, pin_memory with
the host-to-device copy included (T07). persistent_workers is switched on with workers; the
worker start-up it saves on every epoch is measured and reported.

"Workers do not help" is said, and 0 workers returned, when no worker count is at least
`min_gain` (10%) faster than loading in the main process, or when the loader at 0 workers
is already so much faster than the model step that hiding it behind the step could save
less than `min_gain` of the time: with 0 workers a step costs load + compute, with workers
at best compute, so the gain is at most load/compute. The main-process load time of a
batch is measured, not guessed. When a model is given, the chosen setting is confirmed end
to end (load + step, interleaved with num_workers=0), because on a CPU workers take cores
from the model's own compute. Without a model the choice is confirmed the same way
(loader alone, 2 interleaved rounds against num_workers=0).

When it helps: decoding/augmenting data in `__getitem__` (JPEG, audio, text tokenising).
It does not for tensors already in memory: workers then only add inter-process copies.
What it costs: a few hundred batches of loading.

Example:
    >>> s = tune_loader(train_set, batch_size=128, model=model)
    >>> loader = DataLoader(train_set, batch_size=128, shuffle=True, **s.kwargs())
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from torchspeed.env import default_device, sync
from torchspeed.train.loop.progress import progress_bar
from torchspeed.train.rounds import interleaved, run_for
from torchspeed.train.transfer import to_device
from torchspeed.train.wrappers import unwrap_model
from torchspeed.tune._common import StateSnapshot, TrainStep, decide_once, make_batch, model_device

__all__ = ["LoaderTrial", "LoaderSettings", "tune_loader"]


@dataclass(frozen=True)
class LoaderTrial:
    """One measured loader setting."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    samples_per_s: float      # loader alone, after its first batch (end to end when `end_to_end`)
    startup_s: float          # until the first batch (worker start-up included)
    end_to_end: bool = False  # measured with the model step in the loop
    note: str = ""


@dataclass(frozen=True)
class LoaderSettings:
    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None
    persistent_workers: bool
    samples_per_s: float
    speedup_vs_0: float            # loader throughput over num_workers=0
    workers_help: bool
    loader_outruns_model: bool | None  # None when no model/step was given
    model_samples_per_s: float | None
    reason: str
    table: tuple[LoaderTrial, ...]

    def kwargs(self) -> dict:
        """Keyword arguments for `DataLoader(...)`."""
        kw: dict = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            kw.update(prefetch_factor=self.prefetch_factor, persistent_workers=self.persistent_workers)
        return kw

    def to_dict(self) -> dict:
        return asdict(self)


def tune_loader(dataset, *, batch_size: int = 64, model: nn.Module | None = None,
                step: Callable | None = None, loss_fn: Callable | None = None, device: torch.device | str | None = None,
                collate_fn: Callable | None = None, max_workers: int | None = None, batches: int = 12,
                min_time: float = 0.5, prefetch_factors: tuple[int, ...] = (2, 4), plateau: float = 0.05,
                min_gain: float = 0.1, rounds: int = 3, progress: bool = True, seed: int = 0) -> LoaderSettings:
    """Measure DataLoader settings for `dataset` and return the fastest, with the table.

    `model` (trained with a throw-away SGD step, restored afterwards) or `step` (a callable
    taking a device batch) is the consumer the loader must keep up with; without either only
    the loader's own throughput counts. `max_workers` defaults to the usable cores. Under
    torch.distributed, rank 0 measures and every rank gets the same settings.

    Example:
        >>> s = tune_loader(train_set, batch_size=128, model=model)
        >>> s.num_workers, s.reason
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if len(dataset) < batch_size:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one batch of {batch_size}")
    if batches < 2:
        raise ValueError(f"batches={batches} is too few to time; use at least 2")
    return decide_once(lambda: _Tuner(dataset, batch_size=batch_size, model=unwrap_model(model) if model is not None else None,
                                      step=step, loss_fn=loss_fn, device=device, collate_fn=collate_fn,
                                      max_workers=max_workers, batches=batches, min_time=min_time,
                                      prefetch_factors=prefetch_factors,
                                      plateau=plateau, min_gain=min_gain, rounds=max(1, rounds), progress=progress,
                                      seed=seed).run())


class _Tuner:
    def __init__(self, dataset, *, batch_size, model, step, loss_fn, device, collate_fn, max_workers, batches,
                 min_time, prefetch_factors, plateau, min_gain, rounds, progress, seed):
        from torchspeed.env import usable_cores

        self.dataset, self.batch_size, self.collate_fn = dataset, batch_size, collate_fn
        self.model, self.user_step, self.loss_fn = model, step, loss_fn
        if device is not None:
            self.device = torch.device(device)
        elif model is not None:
            self.device = model_device(model)
        else:
            self.device = default_device()
        self.max_workers = usable_cores() if max_workers is None else max(0, max_workers)
        self.batches, self.min_time, self.rounds = batches, min_time, rounds
        self.prefetch_factors, self.plateau, self.min_gain = prefetch_factors, plateau, min_gain
        self.progress, self.seed = progress, seed
        self.table: list[LoaderTrial] = []

    # ------------------------------------------------------------------ measuring
    def _loader(self, workers: int, pin: bool, prefetch: int | None, persistent: bool = True) -> DataLoader:
        # persistent: a trial longer than an epoch must not time the workers' restart at the epoch edge
        kw = dict(num_workers=workers, pin_memory=pin)
        if workers > 0:
            kw.update(prefetch_factor=prefetch or 2, persistent_workers=persistent)
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          collate_fn=self.collate_fn, generator=torch.Generator().manual_seed(self.seed), **kw)

    def _time(self, loader, n: int, step: Callable | None) -> tuple[float, float]:
        """(start-up seconds until the first batch, steady samples/s over at least `n` batches and `min_time`)."""

        def nxt():
            nonlocal it
            try:
                b = next(it)
            except StopIteration:  # a short dataset: the next epoch (its start-up counts, as in training)
                it = iter(loader)
                b = next(it)
            if step is not None:
                step(to_device(b, self.device))
            elif self.device.type == "cuda":
                to_device(b, self.device)  # the host-to-device copy is part of what pin_memory changes

        def first():
            nonlocal it
            it = iter(loader)
            nxt()

        it = None
        clock, device_sync = time.perf_counter, lambda: sync(self.device)
        _, startup = run_for(first, clock=clock, sync=device_sync)
        # Workers start one after the other: until each has delivered a batch the rate is not
        # steady yet, and timing that ramp would penalise workers for their start-up.
        for _ in range(2 * getattr(loader, "num_workers", 0)):
            nxt()
        sync(self.device)
        done, seconds = run_for(nxt, min_calls=n, min_time=self.min_time, clock=clock, sync=device_sync)
        del it
        return startup, done * self.batch_size / seconds

    def _trial(self, workers: int, pin: bool, prefetch: int | None, note: str = "") -> LoaderTrial:
        startup, rate = self._time(self._loader(workers, pin, prefetch), self.batches, None)
        trial = LoaderTrial(workers, pin, prefetch if workers > 0 else None, rate, startup, False, note)
        self.table.append(trial)
        return trial

    def _model_rate(self) -> float | None:
        """samples/s of the model step alone, on one batch already on the device."""
        if self.step is None:
            return None
        batch = to_device(make_batch(self.dataset, self.batch_size, collate_fn=self.collate_fn), self.device)
        self.step(batch)
        sync(self.device)
        rates = []
        for _ in range(3):
            n, seconds = run_for(lambda: self.step(batch), min_calls=3, min_time=0.1, clock=time.perf_counter,
                                 sync=lambda: sync(self.device))
            rates.append(n * self.batch_size / seconds)
        return statistics.median(rates)

    # ------------------------------------------------------------------ deciding
    def run(self) -> LoaderSettings:
        snap = None
        if self.model is not None and self.user_step is None:
            opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
            snap = StateSnapshot(self.model, None, None, None)
            self.model.train()
            self.step = TrainStep(self.model, opt, loss_fn=self.loss_fn)
        else:
            self.step = self.user_step
        try:
            with progress_bar(enabled=self.progress) as bar:
                task = bar.add_task("loader: measuring", total=None)
                return self._decide(bar, task)
        finally:
            if snap is not None:
                snap.restore()

    def _decide(self, bar, task) -> LoaderSettings:
        """The loader settings that train fastest, or 0 workers and why workers do not help: a first sweep of worker
        counts, their medians over interleaved rounds, prefetch and pinning for the best count, then a
        confirmation against num_workers=0."""
        bar.update(task, description="loader: timing the model step")
        model_rate = self._model_rate()
        bar.update(task, description="loader: num_workers=0")
        base = self._trial(0, False, None, "round 1")
        outruns = None if model_rate is None else base.samples_per_s >= model_rate / self.min_gain
        if outruns:
            reason = (f"workers do not help: the main process loads {base.samples_per_s:,.0f} samples/s, "
                      f"{base.samples_per_s / model_rate:.0f}x what the model step consumes "
                      f"({model_rate:,.0f} samples/s); the loader already outruns the model step, so hiding "
                      f"loading behind it could save under {100 * model_rate / base.samples_per_s:.0f}% of the time")
            return self._result(0, False, None, base, base, model_rate, True, reason)
        value = functools.partial(_training_rate, model_rate=model_rate)
        stop_note, outruns = self._sweep(bar, task, base, model_rate)
        medians = self._median_rounds(bar, task)
        base = medians[0]
        best = max(medians.values(), key=lambda t: (value(t), -t.num_workers))
        if best.num_workers == 0 or value(best) < value(base) * (1 + self.min_gain):
            reason = (f"workers do not help: no worker count is more than {100 * self.min_gain:.0f}% faster than "
                      f"loading in the main process ({base.samples_per_s:,.0f} samples/s at 0 workers, "
                      f"{max(t.samples_per_s for t in self.table):,.0f} at best"
                      + ("" if model_rate is None else f"; the model step takes {model_rate:,.0f} samples/s")
                      + "); inter-process copies cost what parallel loading saves")
            return self._result(0, False, None, base, base, model_rate, outruns, reason)

        workers = best.num_workers
        best, prefetch, pin = self._prefetch_and_pin(bar, task, best, value)
        what, e2e_w, e2e_0 = self._confirm(bar, task, workers, pin, prefetch)
        if e2e_w < e2e_0 * (1 + self.min_gain):
            why = ("the workers take cores from the model's compute" if self.step is not None
                   else "the first measurement was noise")
            reason = (f"workers do not help ({what}): {workers} workers reach {e2e_w:,.0f} vs {e2e_0:,.0f} "
                      f"samples/s at 0 workers, under the {100 * self.min_gain:.0f}% needed ({why})")
            return self._result(0, False, None, base, base, model_rate, outruns, reason)

        reason = (f"{workers} workers: {e2e_w / e2e_0:.2f}x num_workers=0 ({what}: {e2e_w:,.0f} vs {e2e_0:,.0f} "
                  "samples/s)"
                  + ("" if model_rate is None else f"; model step alone {model_rate:,.0f} samples/s")
                  + (f"; {stop_note}" if stop_note else "")
                  + f"; persistent workers save {best.startup_s:.2f} s of start-up per epoch")
        return self._result(workers, pin, prefetch, best, base, model_rate, outruns, reason)

    def _sweep(self, bar, task, base: LoaderTrial, model_rate: float | None) -> tuple[str, bool]:
        """Round 1 over num_workers = 1, 2, ... up to `max_workers`, after `base` (0 workers): it stops once the
        loader outruns the model step (more workers cannot help) or once a worker more gains under `plateau`.
        (why it stopped early, or "", whether the loader outran the model step)."""
        prev = base
        for w in range(1, self.max_workers + 1):
            bar.update(task, description=f"loader: num_workers={w}")
            t = self._trial(w, False, 2, "round 1")
            if model_rate is not None and t.samples_per_s >= model_rate * (1 + self.plateau):
                return (f"stopped at {w} workers: the loader ({t.samples_per_s:,.0f} samples/s) now "
                        f"outruns the model step ({model_rate:,.0f} samples/s), more workers cannot help"), True
            # one worker only moves loading out of the main process; plateau is judged from 2 on
            if w >= 2 and t.samples_per_s < prev.samples_per_s * (1 + self.plateau):
                return f"stopped at {w} workers: throughput plateaued", False
            prev = t
        return "", False

    def _median_rounds(self, bar, task) -> dict[int, LoaderTrial]:
        """{worker count: its median trial}: the counts swept so far measured again in `rounds` - 1 more interleaved
        rounds, medians over all. On a shared machine a single half-second trial is at the mercy of whatever else
        runs in that half second; interleaving spreads a slow spell over every count."""
        swept = sorted({t.num_workers for t in self.table})
        first = {w: [t.samples_per_s for t in self.table if t.num_workers == w] for w in swept}

        def turn(w: int, r: int) -> None:
            note[0] = f"round {r + 1}"
            bar.update(task, description=f"loader: round {r + 1}/{self.rounds}, num_workers={w}")

        note = [""]
        more = interleaved({w: (lambda w=w: self._trial(w, False, 2 if w else None, note[0]).samples_per_s)
                            for w in swept}, rounds=self.rounds - 1, before=turn)
        rates = {w: first[w] + more.times[w] for w in swept}
        medians = {w: LoaderTrial(w, False, 2 if w else None, statistics.median(v),
                                  statistics.median(t.startup_s for t in self.table if t.num_workers == w),
                                  False, f"median of {len(v)} rounds") for w, v in rates.items()}
        self.table.extend(medians.values())
        return medians

    def _prefetch_and_pin(self, bar, task, best: LoaderTrial,
                          value: Callable[[LoaderTrial], float]) -> tuple[LoaderTrial, int, bool]:
        """(the best trial, prefetch_factor, pin_memory) for `best`'s worker count: a prefetch factor other than 2 is
        kept only when `plateau` faster (T08); on CUDA pinned memory is kept when faster at all (T07)."""
        workers = best.num_workers
        prefetch = 2
        for pf in self.prefetch_factors:
            if pf == 2:
                continue
            bar.update(task, description=f"loader: prefetch_factor={pf}")
            t = self._trial(workers, False, pf, f"prefetch {pf}")
            if value(t) > value(best) * (1 + self.plateau):
                best, prefetch = t, pf
        pin = False
        if self.device.type == "cuda":
            bar.update(task, description="loader: pin_memory")
            t = self._trial(workers, True, prefetch, "pinned")
            if value(t) > value(best):
                best, pin = t, True
        return best, prefetch, pin

    def _confirm(self, bar, task, workers: int, pin: bool, prefetch: int) -> tuple[str, float, float]:
        """(what was timed, samples/s with the chosen settings, samples/s at num_workers=0), from 2 interleaved
        rounds, so one lucky trial cannot decide. With a model the step runs in the loop too: on a CPU, workers
        take cores from the model's compute. Both rows go into the table."""
        what = "end to end (load + step)" if self.step is not None else "confirmation (loader alone)"
        bar.update(task, description=f"loader: {what} against num_workers=0")

        def e2e(w: int) -> float:
            return self._time(self._loader(w, pin if w else False, prefetch if w else None), self.batches, self.step)[1]

        confirm = interleaved({workers: lambda: e2e(workers), 0: lambda: e2e(0)}, rounds=2).medians()
        e2e_w, e2e_0 = confirm[workers], confirm[0]
        self.table.append(LoaderTrial(0, False, None, e2e_0, 0.0, self.step is not None, what))
        self.table.append(LoaderTrial(workers, pin, prefetch, e2e_w, 0.0, self.step is not None, what))
        return what, e2e_w, e2e_0

    def _result(self, workers, pin, prefetch, best: LoaderTrial, base: LoaderTrial, model_rate, outruns,
                reason) -> LoaderSettings:
        return LoaderSettings(num_workers=workers, pin_memory=pin, prefetch_factor=prefetch if workers else None,
                              persistent_workers=workers > 0, samples_per_s=best.samples_per_s,
                              speedup_vs_0=best.samples_per_s / base.samples_per_s, workers_help=workers > 0,
                              loader_outruns_model=None if model_rate is None else outruns,
                              model_samples_per_s=model_rate, reason=reason, table=tuple(self.table))


def _training_rate(t: LoaderTrial, model_rate: float | None) -> float:
    """Predicted samples/s of training with trial `t`'s loader: load then step in turn at 0 workers, the two
    overlapped with workers (the slower one sets the pace); the loader alone without a model step."""
    if model_rate is None:
        return t.samples_per_s
    if t.num_workers == 0:
        return 1 / (1 / t.samples_per_s + 1 / model_rate)
    return min(t.samples_per_s, model_rate)
