"""Learning-rate range test (T15) with a suggestion that noise and early spikes do not fool, and a
measured fallback (T15) when the curve cannot be read.

What it does: trains for `num_steps` steps while the LR grows exponentially from `start_lr`
to `end_lr`, records the loss at every step, stops when the loss diverges, then puts the
model, optimizer, scheduler, GradScaler and every RNG back exactly as they were (the
weights are bit-identical afterwards, so running it never changes later training).

The suggestion: the raw losses are first de-spiked (running median over 9 steps: a spike
shorter than 5 steps disappears), then smoothed (centred moving average, no lag, unlike the
usual exponential average that drags a spike over the next ~50 steps). The steepest descent
of that curve (per decade of LR), looked for before its minimum, is cross-checked with the
valley rule (the longest run of falling loss, 2/3 of the way down it): if the steepest
point lies inside the valley it is the suggestion, otherwise the valley point is.
How far to trust it (`confidence`, with the reason in `warning`): "low" when the curve is
flat (the smoothed loss falls by less than 10% of its start before its minimum: the LR
hardly matters in this range, or the model does not learn from these batches) or noisy (the
step-to-step scatter around the smoothed curve, as a median absolute deviation, is more
than a quarter of that fall); "medium" when the steepest point lies outside the longest
valley (the rules disagree); else "high".
For one-cycle (T14): `max_lr` is the larger of the suggestion and the bottom LR, the lowest LR
at which the smoothed loss has done 90% of its fall to its minimum (`bottom_lr`); `min_lr =
max_lr / 10` (T15). The bottom, not the minimum itself: past the bottom the curve is often a
plateau whose lowest point is noise (a small transformer's minimum moved from 8e-3 to 4e-2
between two seeds on the same plateau; its bottom was 4e-3 on both). The former peak,
max(suggestion, minimum / 3), was 4x below the best one-cycle peak of a sweep for SGD on
ResNet-20 and an MLP (benchmarks/bench_lr_sweep.py, docs/tune.md); the bottom is 2.4x and
2.7x below it there (still a miss: their best peak lies past the minimum, at the edge of
divergence) and 1.4x above it on a small transformer.

The fallback (`fallback=True`, the default): when the confidence is "low" the curve cannot
be read, so a short measured trial decides instead. `trial_lrs` candidates (5), a factor 3
apart, from the LR where the smoothed loss is lowest (the top of the range where the loss
did not diverge) downwards, each train `trial_steps` steps (24: a linear warm-up over the
first 4, then the candidate LR held) from the same saved state on the same batches (drawn
once after the range test) and the same RNG state; a candidate's score is the mean
training loss of its last third of steps (each loss read before that step's update, so
on batches the candidate has not yet trained on in this trial). When the best is the
highest (lowest) candidate, one more LR a factor 3 past it is tried, twice at most, upwards
only while the range test's smoothed loss was still within 10% of its start there (on a
flat curve the LR of the lowest loss is noise, so the top of the grid may be too low). The
lowest score wins: it becomes the suggestion and the one-cycle `max_lr` (`min_lr = max_lr /
10`); the table is in `trial`, `rule` says so, and `steps` counts every training step taken
(range test plus trial). A candidate whose loss turns NaN/inf scores inf.

When it helps: picking the LR for a new model/data/batch without a grid search.
What it costs: `num_steps` training steps (default 100), plus `trial_lrs x trial_steps`
(120; 168 with both extensions) when the fallback runs, plus a copy of the model and
optimizer state in memory.

Example:
    >>> res = find_lr(model, train_loader, optimizer=opt, plot="lr.png")
    >>> fit(model, train_loader, lr=res.max_lr, schedule="onecycle", min_lr=res.min_lr)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from torchspeed._extras import require
from torchspeed.train.trial.precision import make_grad_scaler, resolve_precision
from torchspeed.train.loop.progress import progress_bar
from torchspeed.train.sampler import iter_batches
from torchspeed.train.transfer import to_device
from torchspeed.train.wrappers import unwrap_model
from torchspeed.tune._common import StateSnapshot, TrainStep, decide_once, model_device

__all__ = ["LRFinderResult", "find_lr", "suggest_lr", "plot_lr", "trial_candidates", "trial_ceiling", "choose_trial"]


@dataclass(frozen=True)
class LRFinderResult:
    """The range test's curve and what it suggests."""

    lrs: tuple[float, ...]
    losses: tuple[float, ...]        # raw loss at each step
    smoothed: tuple[float, ...]      # de-spiked and smoothed
    suggestion: float                # LR for a constant schedule
    steepest_lr: float               # steepest descent of the smoothed curve
    valley_lr: float                 # valley rule
    min_loss_lr: float               # where the smoothed loss is lowest
    max_lr: float                    # recommended one-cycle peak LR
    min_lr: float                    # recommended one-cycle floor (max_lr / 10)
    rule: str                        # which rule gave the suggestion, and why
    diverged: bool                   # stopped early because the loss blew up
    plot: str | None = None
    confidence: str = "high"         # "high" | "medium" | "low" (see the module docstring)
    warning: str | None = None       # why the confidence is not high: flat, noisy, or rules disagree
    bottom_lr: float = 0.0           # lowest LR where the smoothed loss has done 90% of its fall
    trial: tuple[tuple[float, float], ...] = ()  # the fallback's (lr, score) table; () when it did not run
    steps: int = 0                   # training steps taken: the range test's, plus the trial's

    def to_dict(self) -> dict:
        return asdict(self)


def find_lr(model: nn.Module, data: Iterable, *, loss_fn: Callable | None = None, step_fn: Callable | None = None,
            optimizer: torch.optim.Optimizer | None = None, scheduler=None, scaler=None,
            start_lr: float = 1e-6, end_lr: float = 10.0, num_steps: int = 100, batch_size: int = 64,
            precision: str = "auto", diverge_factor: float = 4.0, plot: str | Path | None = None,
            progress: bool = True, seed: int = 0, fallback: bool = True, trial_lrs: int = 5,
            trial_steps: int = 24) -> LRFinderResult:
    """Exponential LR range test; restores everything it touched. Returns the curve and suggestions.

    `data` is a DataLoader (or any iterable of batches, cycled) or a Dataset (batched here
    with `batch_size`); batches, losses and `step_fn` follow `torchspeed.train.loop.batch`.
    `optimizer` defaults to SGD with momentum 0.9; a given optimizer, `scheduler` and
    `scaler` are used as they are and restored afterwards. `precision="auto"` is fit's rule
    (`resolve_precision`: bf16 on a CPU with AVX512-BF16/AMX, the GPU's half type on CUDA).
    With `fallback` (default) a low-confidence curve is replaced by a measured trial of
    `trial_lrs` LRs over `trial_steps` steps each (module docstring). Under
    torch.distributed, rank 0 runs the test and every rank gets its result.

    Example:
        >>> res = find_lr(model, loader, optimizer=opt)
        >>> res.suggestion, res.max_lr
    """
    if not 0 < start_lr < end_lr:
        raise ValueError(f"need 0 < start_lr < end_lr, got start_lr={start_lr}, end_lr={end_lr}")
    if num_steps < 10:
        raise ValueError(f"num_steps={num_steps} is too few for a range test; use at least 10 (default 100)")
    if fallback and (trial_lrs < 2 or trial_steps < 6):
        raise ValueError(f"the fallback trial needs trial_lrs >= 2 and trial_steps >= 6, got {trial_lrs} and "
                         f"{trial_steps} (defaults 5 and 24); or pass fallback=False")
    return decide_once(lambda: _find_lr(unwrap_model(model), data, loss_fn=loss_fn, step_fn=step_fn, optimizer=optimizer,
                                        scheduler=scheduler, scaler=scaler, start_lr=start_lr, end_lr=end_lr,
                                        num_steps=num_steps, batch_size=batch_size, precision=precision,
                                        diverge_factor=diverge_factor, plot=plot, progress=progress, seed=seed,
                                        fallback=fallback, trial_lrs=trial_lrs, trial_steps=trial_steps))


def _range_test(step, set_lr, it, device, bar, *, start_lr, end_lr, num_steps, diverge_factor):
    """The range test's steps, the LR rising geometrically from `start_lr` to `end_lr`: (LRs, losses, diverged).
    It stops at a non-finite loss, or where the median of the last 11 losses is `diverge_factor` times the best."""
    task = bar.add_task("LR range test", total=num_steps)
    lrs: list[float] = []
    losses: list[float] = []
    best = math.inf
    for i in range(num_steps):
        lr = start_lr * (end_lr / start_lr) ** (i / (num_steps - 1))
        set_lr(lr)
        loss = float(step(to_device(next(it), device)))  # a host sync per step: fine for a tuner
        lrs.append(lr)
        losses.append(loss)
        bar.update(task, advance=1, description=f"LR range test: lr {lr:.2e} loss {loss:.4f}")
        if not math.isfinite(loss):
            return lrs, losses, True
        # a median over 11 steps: a spike shorter than 6 steps is not a divergence
        recent = float(np.median(losses[-11:]))
        best = min(best, recent)
        if i >= 11 and recent > diverge_factor * best:
            return lrs, losses, True
    return lrs, losses, False


def _trial_fallback(result: LRFinderResult, model, step, set_lr, snap, it, device, bar, *, trial_lrs: int,
                    trial_steps: int) -> LRFinderResult:
    """A range test of low confidence settled by short trials of a few LRs from the same start, each on the same
    batches (`choose_trial`); the best at an edge gets one more LR past it, inside the tested range."""
    batches = [next(it) for _ in range(trial_steps)]  # every candidate trains on these
    task = bar.add_task("LR trial", total=trial_lrs * trial_steps)
    table: dict[float, float] = {}

    def run(lr: float) -> None:
        snap.restore()  # the same weights, optimizer state and RNG for every candidate
        model.train()
        table[lr] = _trial_run(step, set_lr, lr, batches, device, tick=lambda: bar.update(task, advance=1))

    for lr in trial_candidates(result, n=trial_lrs):
        run(lr)
    for _ in range(TRIAL_EXTEND):
        lrs_t = sorted(table)
        best_lr = min(lrs_t, key=lambda a: table[a])
        if best_lr == lrs_t[-1] and lrs_t[-1] * TRIAL_FACTOR <= trial_ceiling(result):
            run(lrs_t[-1] * TRIAL_FACTOR)
        elif best_lr == lrs_t[0] and lrs_t[0] / TRIAL_FACTOR >= result.lrs[0]:
            run(lrs_t[0] / TRIAL_FACTOR)
        else:
            break
    return choose_trial(result, sorted(table.items()), trial_steps=trial_steps)


def _find_lr(model, data, *, loss_fn, step_fn, optimizer, scheduler, scaler, start_lr, end_lr, num_steps, batch_size,
             precision, diverge_factor, plot, progress, seed, fallback, trial_lrs, trial_steps) -> LRFinderResult:
    device = model_device(model)
    prec = resolve_precision(precision, device=device)
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=start_lr, momentum=0.9)
    scaler = scaler if scaler is not None or not prec.needs_scaler else make_grad_scaler(prec)
    snap = StateSnapshot(model, opt, scheduler, scaler)  # also the start of every trial candidate
    it = iter_batches(data, batch_size=batch_size, seed=seed, what="the data for find_lr")
    try:
        base = [g["lr"] for g in opt.param_groups]
        ratios = [b / base[0] if base[0] else 1.0 for b in base]

        def set_lr(lr: float) -> None:
            for g, r in zip(opt.param_groups, ratios):
                g["lr"] = lr * r

        step = TrainStep(model, opt, loss_fn=loss_fn, precision=prec, step_fn=step_fn, scaler=scaler)
        model.train()
        with progress_bar(enabled=progress) as bar:
            lrs, losses, diverged = _range_test(step, set_lr, it, device, bar, start_lr=start_lr, end_lr=end_lr,
                                                num_steps=num_steps, diverge_factor=diverge_factor)
            result = replace(suggest_lr(lrs, losses, diverged=diverged), steps=len(lrs))
            if fallback and result.confidence == "low":
                result = _trial_fallback(result, model, step, set_lr, snap, it, device, bar, trial_lrs=trial_lrs,
                                         trial_steps=trial_steps)
    finally:
        it.close()  # the loader's own generators as they were
        snap.restore()
    if plot is not None:
        plot_lr(result, plot)
        result = replace(result, plot=str(plot))
    return result


TRIAL_FACTOR, TRIAL_WARMUP, TRIAL_EXTEND = 3.0, 4, 2


def trial_ceiling(result: LRFinderResult) -> float:
    """The highest LR of the range test before its smoothed loss rose 10% above where it started (diverging)."""
    smooth = np.asarray(result.smoothed)
    start = float(np.median(smooth[:max(3, len(smooth) // 10)]))
    above = np.nonzero(smooth > 1.1 * max(start, float(smooth.min())))[0]
    above = above[above > int(np.argmin(smooth))]
    return float(result.lrs[int(above[0]) - 1] if len(above) else result.lrs[-1])


def trial_candidates(result: LRFinderResult, *, n: int = 5, factor: float = TRIAL_FACTOR) -> list[float]:
    """The fallback's LRs, low to high: `n`, `factor` apart, the highest at the LR of the lowest smoothed loss
    (past it the loss rises towards divergence), kept inside the tested range."""
    top = max(result.min_loss_lr, result.suggestion, result.lrs[0] * factor ** (n - 1))
    return [float(top / factor ** k) for k in reversed(range(n))]


def warmup_then_constant(i: int, n: int) -> float:
    """The fallback trial's LR factor at step `i` of `n`: a linear warm-up over TRIAL_WARMUP steps, then 1."""
    return min(1.0, (i + 1) / TRIAL_WARMUP)


def _trial_run(step: TrainStep, set_lr, lr: float, batches: list, device, *, tick=lambda: None,
               shape: Callable[[int, int], float] = warmup_then_constant) -> float:
    """Train on `batches` at `lr` x `shape(step, steps)`; the mean loss of the last third (inf once not finite)."""
    losses = []
    for i, b in enumerate(batches):
        set_lr(lr * shape(i, len(batches)))
        loss = float(step(to_device(b, device)))
        tick()
        losses.append(loss)
        if not math.isfinite(loss):
            return math.inf
    return float(np.mean(losses[-max(2, len(losses) // 3):]))


def choose_trial(result: LRFinderResult, table: list[tuple[float, float]], *, trial_steps: int) -> LRFinderResult:
    """The range test's result with the suggestion, max_lr and min_lr taken from the trial's best-scoring LR."""
    finite = [(lr, s) for lr, s in table if math.isfinite(s)]
    if not finite:
        return replace(result, trial=tuple(table), steps=result.steps + len(table) * trial_steps,
                       rule=result.rule + "; the fallback trial diverged at every candidate, so the range test's "
                                          "suggestion stands")
    lr, score = min(finite, key=lambda t: t[1])
    shown = ", ".join(f"{a:.2g}: {b:.3g}" for a, b in table)
    return replace(result, suggestion=lr, max_lr=lr, min_lr=lr / 10, trial=tuple(table),
                   steps=result.steps + len(table) * trial_steps,
                   rule=(f"measured trial (confidence low: the curve cannot be read): {len(table)} LRs x "
                         f"{trial_steps} steps from the same state, lowest mean loss over the last third wins: "
                         f"{lr:.2g} (lr: loss {shown}); the curve's own pick was {result.suggestion:.2g} "
                         f"({result.rule})"))


def _running_median(x: np.ndarray, w: int) -> np.ndarray:
    h = w // 2
    return np.array([np.median(x[max(0, i - h):i + h + 1]) for i in range(len(x))])


def _moving_mean(x: np.ndarray, w: int) -> np.ndarray:
    h = w // 2
    return np.array([np.mean(x[max(0, i - h):i + h + 1]) for i in range(len(x))])


def _valley(loss: np.ndarray) -> tuple[int, int, int]:
    """fastai's valley rule: longest decreasing subsequence; a point 2/3 down it. Returns (start, end, idx)."""
    n = len(loss)
    lds = [1] * n
    max_start = max_end = 0
    for i in range(1, n):
        for j in range(i):
            if loss[i] < loss[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
        if lds[max_end] < lds[i]:
            max_end = i
            max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    idx = max_start + int(sections) + int(sections / 2)
    return max(0, max_start), max_end, min(max(idx, 0), n - 1)


def suggest_lr(lrs, losses, *, diverged: bool = False) -> LRFinderResult:
    """The robust suggestion from a recorded range test (see the module docstring)."""
    lrs_a = np.asarray(lrs, dtype=float)
    raw = np.asarray(losses, dtype=float)
    finite = np.isfinite(raw)
    if finite.sum() < 5:
        raise ValueError(f"the range test recorded only {int(finite.sum())} finite losses; lower start_lr "
                         "or check the model and data (the loss is NaN from the start)")
    n = int(np.argmin(finite)) if not finite.all() else len(raw)  # stop at the first NaN/inf
    lrs_a, raw = lrs_a[:n], raw[:n]
    smooth = _moving_mean(_running_median(raw, 9), 5)
    log_lr = np.log10(lrs_a)
    grad = np.gradient(smooth, log_lr)
    i_min = int(np.argmin(smooth))
    lo = min(2, max(0, i_min - 1))
    i_steep = lo + int(np.argmin(grad[lo:i_min + 1])) if i_min > lo else i_min
    v_start, v_end, i_valley = _valley(smooth)
    if v_start <= i_steep <= v_end:
        i_sug, rule = i_steep, "steepest descent of the smoothed loss (inside the longest valley)"
    else:
        i_sug, rule = i_valley, (f"valley rule: the steepest point (lr {lrs_a[i_steep]:.2e}) lies outside the "
                                 "longest valley, so it is noise, not learning")
    suggestion = float(lrs_a[i_sug])
    min_loss_lr = float(lrs_a[i_min])
    start = float(np.median(smooth[:max(3, len(smooth) // 10)]))
    near = smooth[:i_min + 1] <= smooth[i_min] + BOTTOM * max(start - float(smooth[i_min]), 0.0)
    bottom_lr = float(lrs_a[int(np.argmax(near))])
    max_lr = max(suggestion, bottom_lr)
    if bottom_lr > suggestion:
        rule += f"; one-cycle max_lr {bottom_lr:.2e}: where the smoothed loss has done 90% of its fall"
    confidence, warning = _confidence(raw, smooth, i_min, agree=v_start <= i_steep <= v_end)
    return LRFinderResult(confidence=confidence, warning=warning,lrs=tuple(map(float, lrs_a)), losses=tuple(map(float, raw)),
                          smoothed=tuple(map(float, smooth)), suggestion=suggestion,
                          steepest_lr=float(lrs_a[i_steep]), valley_lr=float(lrs_a[i_valley]),
                          min_loss_lr=min_loss_lr, bottom_lr=bottom_lr, max_lr=float(max_lr), min_lr=float(max_lr / 10), rule=rule,
                          diverged=diverged)


FLAT, NOISY, BOTTOM = 0.10, 0.25, 0.10


def _confidence(raw: np.ndarray, smooth: np.ndarray, i_min: int, *, agree: bool) -> tuple[str, str | None]:
    """("high" | "medium" | "low", why not high): is there a clear fall, above the noise, that the rules agree on?"""
    start = float(np.median(smooth[:max(3, len(smooth) // 10)]))
    fall = start - float(smooth[i_min])
    upto = max(i_min + 1, 5)
    scatter = float(np.median(np.abs(raw[:upto] - smooth[:upto])))
    if not start > 0 or fall < FLAT * start:
        return "low", (f"the loss curve is flat: it falls by {max(fall, 0) / start if start > 0 else 0:.0%} of its "
                       f"start over the range (under {FLAT:.0%}), so the LR is a guess; try a wider range, more "
                       "steps, or check that the model learns at all")
    if scatter > NOISY * fall:
        return "low", (f"the loss curve is noisy: its step-to-step scatter is {scatter / fall:.0%} of its fall "
                       f"(over {NOISY:.0%}); use a larger batch or more steps for the range test")
    if not agree:
        return "medium", "the steepest descent and the valley rule disagree; the valley point was taken"
    return "high", None


def plot_lr(result: LRFinderResult, path: str | Path) -> None:
    """Loss against LR (log scale), with the suggestion, the valley and the one-cycle max LR marked."""
    matplotlib = require("matplotlib", "plot", feature="find_lr(plot=...)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(result.lrs, result.losses, color="#bbbbbb", lw=1, label="loss (raw)")
    ax.plot(result.lrs, result.smoothed, color="#2a7ab0", lw=2, label="de-spiked, smoothed")
    for lr, color, name in ((result.suggestion, "#d1495b", "suggestion"), (result.max_lr, "#66a182", "one-cycle max"),
                            (result.valley_lr, "#edae49", "valley")):
        ax.axvline(lr, color=color, ls="--", lw=1, label=f"{name} {lr:.2e}")
    ax.set_xscale("log")
    finite = [v for v in result.smoothed if math.isfinite(v)]
    if finite:
        ax.set_ylim(min(finite) * 0.9, min(max(result.smoothed[: max(1, len(finite) // 2)]) * 1.5,
                                           max(v for v in result.losses if math.isfinite(v)) * 1.05))
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title("LR range test" + (" (stopped: loss diverged)" if result.diverged else ""), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
