"""Which optimizer learns faster on this model: a short trial of each, from the same state (T42, T18).

What it does: `compare_optimizers` trains the model with each candidate optimizer (by name,
`torchspeed.train.optim.create_optimizer`: "adamw", "muon", "sgd", ...) for `steps` steps,
every candidate from the same saved weights, on the same batches in the same order, with the
same seed. Each is scored by its mean loss on `eval_batches` held-back training batches (never
trained on; no gradient, eval mode) after those steps: "learns faster" is a lower loss after
the same number of steps. The first name is the baseline (the simpler optimizer): another
candidate wins only when its loss is lower by more than `margin` (2%) of the baseline's, so
noise does not switch optimizers. A candidate that does not apply (e.g. "muon" on a model
with no hidden 2-D matrices) or whose loss is not finite loses, with the reason in the table.

Afterwards the model's weights, buffers, gradients, train/eval modes and every RNG are put
back bit for bit (`StateSnapshot`); the optimizers are built here and thrown away.

When it helps: "muon" (Muon for the hidden matrices, AdamW for the rest) on models whose
weights are mostly 2-D matrices (transformers, MLPs; `mostly_matrices(model)`), where it can
reach a lower loss in the same steps; on a convolutional net it has little to work on.
What it costs: `steps` training steps per candidate, plus the held-back batches in memory.

Example:
    >>> trial = compare_optimizers(model, train_set, lr=3e-3, steps=60)
    >>> trial.best, trial.reason
    >>> opt = create_optimizer(trial.best, model, lr=3e-3, weight_decay=None)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from torchspeed.train.eval_view import recalibrate_averaged
from torchspeed.train.optim import (SCHEDULE_FREE_BN_BATCHES, eval_mode, is_schedule_free,
                                    set_schedule_free_warmup)
from torchspeed.train.trial.precision import make_grad_scaler, resolve_precision
from torchspeed.train.loop.progress import progress_bar
from torchspeed.train.sampler import take_batches
from torchspeed.train.schedule import create_scheduler
from torchspeed.train.transfer import to_device
from torchspeed.train.wrappers import unwrap_model
from torchspeed.train.optim_candidate import candidate_optimizer
from torchspeed.tune._common import StateSnapshot, TrainStep, decide_once, model_device

__all__ = ["OptimizerTrial", "compare_optimizers", "pick_optimizer"]


@dataclass(frozen=True)
class OptimizerTrial:
    """The trial's winner, why, and one row per candidate (name, lr, loss, train_loss, error)."""

    best: str
    table: tuple[dict, ...]
    reason: str
    steps: int

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        rows = [f"  {r['name']:<8} lr {r['lr']:.2g}  held-back loss {r['loss']:.4f}"
                + (f"  ({r['error']})" if r.get("error") else "") for r in self.table]
        return f"optimizer: {self.best} ({self.reason})\n" + "\n".join(rows)


def pick_optimizer(losses: Mapping[str, float], *, margin: float = 0.02) -> tuple[str, str]:
    """(name, reason): the first name (the baseline) unless another's loss is lower by more than `margin`."""
    names = list(losses)
    if not names:
        raise ValueError("no candidates to pick from")
    base = names[0]
    finite = {n: v for n, v in losses.items() if math.isfinite(v)}
    if not finite:
        raise RuntimeError(f"no candidate reached a finite loss ({', '.join(names)}): lower the learning rate")
    best = min(finite, key=lambda n: (finite[n], names.index(n)))
    if base not in finite:
        return best, f"{base} did not reach a finite loss; {best} {finite[best]:.4f}"
    if best == base:
        return base, f"{base} {finite[base]:.4f} is the lowest loss"
    gain = 1 - finite[best] / finite[base] if finite[base] > 0 else 0.0
    if gain > margin:
        return best, f"{best} {finite[best]:.4f} vs {base} {finite[base]:.4f}: {gain:.1%} lower loss"
    return base, (f"{best} {finite[best]:.4f} vs {base} {finite[base]:.4f}: {gain:.1%} lower, within the "
                  f"{margin:.0%} margin, so the simpler {base}")


def compare_optimizers(model: nn.Module, data: Iterable, names: Sequence[str] = ("adamw", "muon"), *,
                       lr: float | Mapping[str, float], steps: int = 50, loss_fn: Callable | None = None,
                       step_fn: Callable | None = None, precision: str = "fp32", seed: int = 0,
                       progress: bool = False, batch_size: int = 32, eval_batches: int = 4,
                       weight_decay: float | None = None, schedule: str | None = None,
                       margin: float = 0.02, optimizer_options: Mapping | None = None) -> OptimizerTrial:
    """Train `model` `steps` steps with each optimizer in `names` from the same state; the one that learns faster.

    `data` is a DataLoader (or any iterable of batches, cycled) or a Dataset (batched here with
    `batch_size`); the first `eval_batches` batches are held back for scoring, the next `steps`
    are trained on, the same for every candidate. `lr` is one learning rate or one per name
    (e.g. {"adamw": 1e-3, "muon": 2e-3}); `weight_decay=None` takes each optimizer's default;
    `schedule` (e.g. "onecycle") runs over the `steps`. Returns `best` (the first name unless
    another is better by more than `margin`), the `reason`, and the `table`. Under
    torch.distributed, rank 0 runs the trial and every rank gets its result.
    """
    names = tuple(n.lower() for n in names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"names must be distinct optimizer names, got {names!r}")
    if steps < 1 or eval_batches < 1:
        raise ValueError(f"steps and eval_batches must be positive, got steps={steps}, eval_batches={eval_batches}")
    if isinstance(lr, Mapping):
        missing = [n for n in names if n not in lr]
        if missing:
            raise ValueError(f"lr has no learning rate for {missing}: give one per name, or one for all")
        lrs = {n: float(lr[n]) for n in names}
    else:
        lrs = dict.fromkeys(names, float(lr))
    return decide_once(lambda: _compare(unwrap_model(model), data, names, lrs=lrs, steps=steps, loss_fn=loss_fn,
                                        step_fn=step_fn, precision=precision, seed=seed, progress=progress,
                                        batch_size=batch_size, eval_batches=eval_batches,
                                        weight_decay=weight_decay, schedule=schedule, margin=margin,
                                        optimizer_options=optimizer_options))


def _compare(model, data, names, *, lrs, steps, loss_fn, step_fn, precision, seed, progress, batch_size,
             eval_batches, weight_decay, schedule, margin, optimizer_options=None) -> OptimizerTrial:
    device = model_device(model)
    prec = resolve_precision(precision, device=device)
    snap = StateSnapshot(model)
    rows: list[dict] = []
    try:
        batches = take_batches(data, eval_batches + steps, batch_size=batch_size, seed=seed, cycle=True,
                               what="the data for compare_optimizers")
        held, train = batches[:eval_batches], batches[eval_batches:]
        with progress_bar(enabled=progress) as bar:
            for name in names:
                snap.restore()
                for p in model.parameters():
                    p.grad = None
                torch.manual_seed(seed)
                row = {"name": name, "lr": lrs[name], "loss": math.inf, "train_loss": math.inf, "error": None}
                rows.append(row)
                try:
                    opt = candidate_optimizer(name, model, lr=lrs[name], weight_decay=weight_decay,
                                              options=optimizer_options)  # the user's momentum and betas
                except ValueError as e:  # e.g. "muon" on a model with no hidden matrices
                    row["error"] = str(e)
                    continue
                free = is_schedule_free(opt)
                if free:  # its own warm-up (the Trainer's rule), no schedule; TrainStep puts it in train mode
                    set_schedule_free_warmup(opt, steps)
                sched = None if free else create_scheduler(schedule, opt, total_steps=steps)
                step = TrainStep(model, opt, loss_fn=loss_fn, step_fn=step_fn, precision=prec,
                                 scaler=make_grad_scaler(prec))
                task = bar.add_task(f"optimizer trial: {name}", total=steps)
                # a challenger is also scored at CHECKPOINTS points on the way: when it reached the first
                # candidate's final held-back loss, in training seconds (`_judge_by_time`)
                every = max(1, steps // CHECKPOINTS) if name != names[0] else steps + 1
                _train_candidate(row, model, opt, step, sched, train, held, prec, device,
                                 tick=lambda: bar.update(task, advance=1), every=every)
                del opt, sched, step
    finally:
        snap.restore()
    best, reason = pick_optimizer({r["name"]: r["loss"] for r in rows}, margin=margin)
    if best != names[0]:  # it learns more per step; it must also reach the baseline's loss in less time
        best, reason = _judge_by_time(rows, names[0], best, reason, margin=margin)
    for r in rows:
        r["s_per_step"] = statistics.median(r.pop("step_s", None) or [math.nan])
        r.pop("curve", None), r.pop("held_curve", None)
    return OptimizerTrial(best=best, table=tuple(rows), reason=reason, steps=steps)


def _train_candidate(row: dict, model, opt, step, sched, train: list, held: list, prec, device, *, tick,
                     every: int) -> None:
    """One candidate's steps on `train` (timed, each a host sync: fine for a trial), its held-back loss every
    `every` steps and at the end, written into `row`; a non-finite loss ends it with the error."""
    losses, clock, row["held_curve"] = [], [], []
    model.train()
    for i, b in enumerate(train, 1):
        t0 = time.perf_counter()
        losses.append(float(step(to_device(b, device))))
        clock.append(time.perf_counter() - t0)
        if sched is not None:
            sched.step()
        tick()
        if not math.isfinite(losses[-1]):
            row["error"] = f"the loss was not finite at step {len(losses)}"
            break
        if i % every == 0 and i < len(train):
            row["held_curve"].append((sum(clock), _held_loss(model, opt, step, held, train[:i], prec)))
    tail = losses[-max(1, len(losses) // 5):]
    row["train_loss"] = sum(tail) / len(tail)
    row["curve"], row["step_s"] = losses, clock
    if row["error"] is None:
        row["loss"] = _held_loss(model, opt, step, held, train, prec, resume=False)
        row["held_curve"].append((sum(clock), row["loss"]))
        if not math.isfinite(row["loss"]):
            row["error"], row["loss"] = "the held-back loss was not finite", math.inf


CHECKPOINTS = 4  # a challenger's held-back loss is read every steps / 4 (3 reads on the way, and the end)


def _held_loss(model, opt, step, held: list, trained: list, prec, *, resume: bool = True) -> float:
    """The mean loss on the held-back batches at the weights the optimizer is judged by: a Schedule-Free
    optimizer's average, with BatchNorm statistics recalibrated on the newest batches trained on, as it evaluates
    (`train/eval_view.py`). Eval mode, no gradient; `resume`: the model back to training after."""
    device = model_device(model)
    free = is_schedule_free(opt)
    if free:  # judged at its averaged weights (in eval mode already after an earlier look: as they are)
        eval_mode(opt)
        recalibrate_averaged(model, trained[-SCHEDULE_FREE_BN_BATCHES:], prec, device=device, step_fn=step.step_fn)
    model.eval()
    with torch.no_grad():
        out = [float(step.loss(to_device(b, device))) for b in held]
    if resume:
        model.train()  # the optimizer goes back to train mode with its next step (TrainStep)
    return sum(out) / len(out)


def seconds_to_loss(curve: Sequence[float], step_s: Sequence[float], target: float, window: int = 5) -> float:
    """Seconds (summed step times, the first step's compile-free median standing in for it) until the moving
    average of `curve` over `window` steps first reaches `target`; inf when it never does."""
    if not curve:
        return math.inf
    typical = statistics.median(step_s[1:] or step_s)
    elapsed = 0.0
    for i in range(len(curve)):
        elapsed += typical if i == 0 else step_s[i]
        lo = max(0, i + 1 - window)
        if sum(curve[lo:i + 1]) / (i + 1 - lo) <= target:
            return elapsed
    return math.inf


def _judge_by_time(rows: list[dict], base: str, best: str, reason: str, *, margin: float) -> tuple[str, str]:
    """The per-step winner `best` is kept only when it reaches the baseline's final loss in fewer seconds (by more
    than `margin`): a faster-learning optimizer whose steps are slower must win on time. Read on the held-back loss
    at the weights each is judged by (`held_curve`: training seconds, loss), where the trial scored it on the way;
    else on the training-loss curves (a Schedule-Free optimizer's training loss is not that of its average)."""
    r = {row["name"]: row for row in rows}
    b, c = r[base], r[best]
    if not b.get("curve") or not c.get("curve"):
        return best, reason
    t_base = sum(b["step_s"])
    if c.get("held_curve") and math.isfinite(b.get("loss", math.inf)):
        what = "held-back loss"
        t_best = next((t for t, loss in c["held_curve"] if loss <= b["loss"]), math.inf)
    else:
        what = "training loss"
        window = max(1, len(b["curve"]) // 5)
        t_best = seconds_to_loss(c["curve"], c["step_s"], sum(b["curve"][-window:]) / window, window)
    c["seconds_to_baseline_loss"], b["seconds_to_baseline_loss"] = t_best, t_base
    if t_best < t_base * (1 - margin):
        return best, reason + (f"; it reached {base}'s final {what} in {t_best:.2f} s against {t_base:.2f} s "
                               "(judged on time)")
    return base, (f"{best} learned more per step but reached {base}'s final {what} in "
                  f"{t_best:.2f} s against {t_base:.2f} s: {base} is sooner in time")
