"""The GPU check's timed rows: training loops side by side in one process, interleaved in rounds.

Used by `gpu_check_parts.py` (the ResNet-50 and GPT parts of `benchmarks/gpu_check.py`). A row
is one way to train the same model on the same device batches:

- `TrainerRow`: torchspeed's `Trainer` with a `TrainConfig` (`naive`, or the defaults `fit` uses,
  the switch and compile trials included in its warm-up);
- `HandRow`: the hand-written loop of `torchspeed.bench.hand.HandLoop` with fixed settings (AdamW
  in place of its SGD for a language model);
- `LightningRow`: `torchspeed.bench.peers.LightningLoop` (Lightning Fabric) in channels_last.

`measure_rows` works in stages: each warms its rows up (untimed; a row that fails is recorded
and left out), then times every warm row in interleaved rounds
(`torchspeed.train.rounds.interleaved`), writing the result after every turn, so a part stopped
at its time limit keeps every round it finished. The rows with long warm-ups (fit's trials and
compilations) come last. Before each round it checks the time left and stops cleanly when the
round would not fit.

Example:
    >>> rows = {"naive": TrainerRow(model, data, device, TrainConfig.naive(), optimizer="sgd", lr=0.1)}
    >>> timing = Timing(steps=6, rounds=3, items_per_step=256, unit="img_per_s", flops_per_item=None, peaks={},
    ...                 pairs=(("all", "naive"),))
    >>> measure_rows(rows, result, save, clock, timing, stages=[("naive",), ("all",)])
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from torchspeed.bench.hand import HandLoop, HandSettings
from torchspeed.train.loop.guard import TrainingOutOfMemoryError, is_out_of_memory
from torchspeed.train.loop.metrics import jsonable
from torchspeed.train.rounds import interleaved, paired_ratios, ratio_summary
from torchspeed.train.loop.trainer import Trainer

__all__ = ["Clock", "Partial", "SkipRow", "TrainerRow", "HandRow", "LightningRow", "Timing", "measure_rows",
           "out_of_memory"]


class Clock:
    """The seconds a part has left before `deadline` (wall-clock time, set by the driver when it started the part)."""

    def __init__(self, deadline: float):
        self.end = deadline

    def left(self) -> float:
        return self.end - time.time()


class Partial:
    """The part's result, written atomically to `path` each time `save` is called (the driver reads it)."""

    def __init__(self, path: str):
        self.path, self.data = path, {}

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


class SkipRow(Exception):
    """Raised by a row's warm-up that should not run here (recorded as skipped, with the message as the reason)."""


def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, TrainingOutOfMemoryError) or is_out_of_memory(e)


class TrainerRow:
    """torchspeed's Trainer; `remaining_steps` tells its compile trial the run's length (None: unknown, a long run)."""

    def __init__(self, model, data, device, config, *, remaining_steps: int | None = None, warmup: int = 2, **opt):
        self.trainer = Trainer(model, device=device, config=config, **opt)
        self.benchmark = torch.backends.cudnn.benchmark  # what its configure_backends chose
        self.data, self.remaining_steps, self.warmup, self._it = data, remaining_steps, warmup, None

    def _batches(self):
        while True:
            yield from self.trainer.batches(self.data)

    def activate(self) -> None:
        torch.backends.cudnn.benchmark = self.benchmark

    def steps(self, n: int) -> float:
        if self._it is None:
            self._it = self._batches()
        return self.trainer.run_steps(self._it, n)

    def warm(self) -> dict:
        """As `fit` starts: the switches left on "auto" decided by trial on the first steps, then compile's trial."""
        self.trainer.switcher.prepare(self.data, remaining_steps=self.remaining_steps)
        if self.remaining_steps is not None:  # as fit does: a run too short to pay back a compilation stays eager
            self.trainer.compiler.plan(self.remaining_steps)
        total, taken = self.steps(self.warmup), self.warmup
        while self.trainer.switcher.live is not None or self.trainer.compiler.undecided:
            total += self.steps(1)
            taken += 1
        self.benchmark = torch.backends.cudnn.benchmark
        return {"seconds": total, "steps": taken}

    def describe(self) -> dict:
        return {"decisions": jsonable(self.trainer.decisions), "cudnn_benchmark": self.benchmark}


class HandRow:
    """`HandLoop` with fixed settings; `adamw`: fused AdamW (decay on matrices only) in place of its SGD."""

    def __init__(self, model, data, device, settings: HandSettings, *, lr: float, warmup: int = 2,
                 cudnn_benchmark: bool = True, adamw: bool = False, only_if=None):
        self.loop = HandLoop(model, data, device, settings=settings, lr=lr)
        self.only_if = only_if  # None, or a callable run before the warm-up: a reason to skip the row, or None
        if adamw:
            params = list(self.loop.model.parameters())
            groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
                      {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
            self.loop.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=settings.fused or None)
        self.benchmark, self.warmup = cudnn_benchmark, warmup

    def activate(self) -> None:
        torch.backends.cudnn.benchmark = self.benchmark

    def steps(self, n: int) -> float:
        return self.loop.run(n)

    def warm(self) -> dict:
        reason = self.only_if() if self.only_if is not None else None
        if reason:
            raise SkipRow(reason)
        n = self.warmup + (1 if self.loop.settings.compile else 0)
        return {"seconds": self.loop.run(n), "steps": n}

    def describe(self) -> dict:
        return {"settings": asdict(self.loop.settings), "optimizer": type(self.loop.opt).__name__,
                "cudnn_benchmark": self.benchmark}


class LightningRow(HandRow):
    """Lightning Fabric (bench/peers.py) at `precision`, the model and its batches in channels_last."""

    def __init__(self, model, data, device, *, lr: float, precision: str, warmup: int = 2):
        from torchspeed.bench.peers import LightningLoop  # lightning imported only when this row runs

        model = model.to(memory_format=torch.channels_last)  # kept by Fabric's move to the device
        self.loop = LightningLoop(model, data, device, lr=lr, precision=precision)
        self.loop.settings = HandSettings(channels_last=True)  # its batches: channels_last too
        self.benchmark, self.warmup, self.only_if = False, warmup, None  # cudnn: torch's default, as Fabric leaves it

    def describe(self) -> dict:
        return {"settings": {"lightning": "Fabric", "precision": self.loop.precision, "channels_last": True},
                "optimizer": "SGD (torch default kernel)", "cudnn_benchmark": self.benchmark}


class _OutOfTime(Exception):
    pass


def _warm_all(rows: dict, table: dict, save, clock: Clock) -> dict:
    """Warm every row up; a row that fails (other than out of memory: the caller halves the batch) is left out."""
    ready = {}
    for name, row in rows.items():
        table[name] = {"status": "warming up", "left_s_at_start": round(clock.left(), 1)}  # where a stopped part was
        save()
        row.activate()
        try:
            warm = row.warm()
        except SkipRow as e:
            table[name] = {"status": "skipped", "reason": str(e)}
        except Exception as e:
            if out_of_memory(e):
                raise
            table[name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        else:
            table[name] = {"status": "ok", "warmup": warm, **row.describe()}
            ready[name] = row
        save()
    return ready


@dataclass(frozen=True)
class Timing:
    """How a part times its rows: `steps` per turn, `rounds` rounds in the last stage and `early_rounds` in each
    earlier one, the rate in `unit` (`items_per_step` per step), MFU against each of `peaks`, the ratios of `pairs`."""

    steps: int
    rounds: int
    items_per_step: int
    unit: str
    flops_per_item: float | None
    peaks: dict
    pairs: tuple
    early_rounds: int = 1


def summarize(rates: dict[str, list[float]], t: Timing) -> dict:
    """Each row's median rate and MFU against each peak, over the rounds every row finished; the pairs' ratios."""
    n = min((len(v) for v in rates.values()), default=0)
    rows = {}
    for name, v in rates.items():
        rate = statistics.median(v[:n]) if n else None
        rows[name] = {f"{t.unit}_rounds": [round(x, 3) for x in v], t.unit: rate}
        for key, peak in t.peaks.items():
            rows[name][key] = rate * t.flops_per_item / peak if rate and peak and t.flops_per_item else None
    ratios = {f"{a}/{b}": ratio_summary(paired_ratios(rates[a][:n], rates[b][:n]))
              if n and a in rates and b in rates else None for a, b in t.pairs}
    return {"rounds_done": n, "rows": rows, "ratios": ratios}


def _publish(res: dict, stage: dict) -> None:
    """The latest stage with a finished round is the part's result: its rates on the rows, its ratios."""
    if stage["rounds_done"] < 1:
        return
    for name, v in stage["rows"].items():
        res["rows"][name].update(v)
    res.update(ratios=stage["ratios"], rounds_done=stage["rounds_done"], stage=stage["stage"])


def _time_rounds(ready: dict, res: dict, save, clock: Clock, t: Timing, rounds: int) -> None:
    """`rounds` interleaved rounds of the warm rows into the stage `res["stages"][-1]`; a row that fails is left
    out of the later rounds; before a round, stop when the time left would not hold it."""
    rates: dict[str, list[float]] = {k: [] for k in ready}
    starts: list[float] = []
    stage = res["stages"][-1]

    def before(name: str, r: int) -> None:
        if name == next(iter(ready)):  # a round begins: stop cleanly when the last one would not fit again
            starts.append(time.monotonic())
            if len(starts) >= 2 and clock.left() < 1.5 * (starts[-1] - starts[-2]):
                raise _OutOfTime
        ready[name].activate()

    def turn(name: str) -> float:
        if name not in rates:
            return float("nan")
        try:
            seconds = ready[name].steps(t.steps)
        except Exception as e:
            if out_of_memory(e):
                raise
            del rates[name]
            res["rows"][name] |= {"status": "error", "error": f"{type(e).__name__}: {e}"}
            save()
            return float("nan")
        rates[name].append(t.steps * t.items_per_step / seconds)
        stage.update(summarize(rates, t))
        _publish(res, stage)
        save()
        return rates[name][-1]

    try:
        interleaved({k: (lambda k=k: turn(k)) for k in ready}, rounds=rounds, before=before)
    except _OutOfTime:
        stage["stopped_early"] = f"time left ({clock.left():.0f} s) too short for another round"
    save()


def measure_rows(rows: dict, res: dict, save, clock: Clock, t: Timing, stages: list[tuple[str, ...]]) -> None:
    """Warm the rows up and time them in interleaved rounds, stage by stage; fills `res` and saves after each turn.

    Each stage warms its rows up, then times every row warm so far (`t.early_rounds` rounds, the last stage
    `t.rounds`). The rows whose warm-up is long (fit's trials and compilations) come in the later stages, so a part
    stopped during one still has the rates of the rows before. `res["stages"]` keeps every stage's rates and
    ratios; `res["rows"]` and `res["ratios"]` hold the latest stage that finished a round."""
    res.setdefault("rows", {})
    res.setdefault("ratios", {"/".join(p): None for p in t.pairs})
    res["stages"], ready = [], {}
    for i, names in enumerate(stages):
        ready |= _warm_all({k: rows[k] for k in names if k in rows}, res["rows"], save, clock)
        if ready:
            res["stages"].append({"stage": i, "timed": list(ready), "rounds_done": 0})
            _time_rounds(ready, res, save, clock, t, t.rounds if i == len(stages) - 1 else t.early_rounds)
            ready = {k: v for k, v in ready.items() if res["rows"][k]["status"] == "ok"}  # failed: out of later stages


_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def profile_rows(rows: dict, names: list[str], steps: int, *, top: int = 12) -> dict:
    """Where a step's time goes, per row: `steps` steps under torch.profiler, the ops that took the most device time
    (CPU time where no device ran), kernel launches and host syncs per step. The next lease reads the fit row's
    gap to the hand loop from this, instead of guessing."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for name in names:
        row = rows[name]
        row.activate()
        row.steps(1)  # the profiler's own start is not the row's
        with profile(activities=acts) as prof:
            row.steps(steps)
        events = prof.key_averages()
        key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        ops = sorted((e for e in events if key(e) > 0), key=key, reverse=True)[:top]
        count = {e.key: e.count for e in events}
        out[name] = {"steps": steps, "timed_on": "device" if cuda else "cpu",
                     "ops": [{"name": e.key, "per_step": e.count / steps, "ms_per_step": key(e) / 1e3 / steps}
                             for e in ops],
                     "launches_per_step": sum(count.get(k, 0) for k in _LAUNCHES) / steps,
                     "syncs_per_step": {k: count[k] / steps for k in _SYNCS if count.get(k)}}
    return out
