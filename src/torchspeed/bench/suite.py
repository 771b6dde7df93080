"""The workload suite: small workloads of many kinds, each with its plain loop and a target, scored as AlgoPerf does.

One workload is one kind of training a user runs: an image CNN, a language model, a tabular MLP, a
regression, a sequence model, a transformer on non-text input. Each is registered once
(`register_workload(Workload(...))`) with its data (made offline and deterministically from a seed:
scikit-learn's digits, data made here, the standard library's own source text), its model, the plain
loop's optimizer, LR, batch size and epochs (its default budget), its loss, and a target on a
validation metric that the plain loop reaches within that budget. `suite_workloads()` lists what is
registered, in registration order, so a new workload needs no other edit.

`plain_run` is the loop a user writes for such a workload (shuffled index slices of tensors in memory,
the optimizer at a constant LR, an evaluation after each epoch); `plain_to_target` times it to the target.

Scoring (MLCommons AlgoPerf's, Dahl et al. 2023) works on a table `{workload: {row: seconds or None}}`,
None where the row missed the target: `relative_times` (each row's time over the fastest row's, a miss
infinite), `geometric_mean_speed`, `targets_reached`, `performance_profile` (for each tau, the share of
workloads on which a row is within a factor tau of the fastest), `profile_score` and `plot_profile`.
docs/suite.md lists the workloads and their measured plain-loop times.

Example:
    >>> w = WORKLOADS["mlp"]
    >>> plain_run(w, seed=0, epochs=2, n_train=500)["metric"]
    >>> performance_profile({"a": {"fit": 1.0, "plain": 2.0}, "b": {"fit": None, "plain": 3.0}}, (1.0, 2.0))
    {'fit': {1.0: 0.5, 2.0: 0.5}, 'plain': {1.0: 0.5, 2.0: 1.0}}
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed._extras import require
from torchspeed.bench.small import make_small, shuffled_epochs
from torchspeed.bench.text import stdlib_text
from torchspeed.bench.workloads import digits

__all__ = ["Workload", "SuiteData", "WORKLOADS", "register_workload", "suite_workloads", "load_data",
           "make_optimizer", "compute_loss", "evaluate", "reached", "plain_run", "plain_to_target",
           "relative_times", "geometric_mean_speed", "targets_reached", "performance_profile", "profile_score",
           "plot_profile", "median_run", "TAUS", "METRICS", "LOSSES", "OPTIMIZERS"]

METRICS = {"val_acc": "higher", "val_loss": "lower"}  # the target metric -> which way is better
LOSSES = ("cross_entropy", "mse")
OPTIMIZERS = ("adam", "adamw", "sgd")
TAUS = tuple(1.0 + 0.25 * i for i in range(13))  # 1.0, 1.25, ..., 4.0: AlgoPerf's range of the profile
EVAL_BATCH = 500
DATA_SEED = 0  # a workload's data are made from this seed; a run's seed draws its initial weights and batch order


class SuiteData(NamedTuple):
    """A workload's tensors in memory: `x`, `y` to train on, `vx`, `vy` held out."""

    x: torch.Tensor
    y: torch.Tensor
    vx: torch.Tensor
    vy: torch.Tensor


@dataclass(frozen=True)
class Workload:
    """One workload of the suite: its data, model, plain loop (the default budget) and target."""

    name: str
    kind: str                                # "image CNN", "language model", "tabular MLP", ...
    data: Callable[[int], SuiteData]         # seed -> the tensors, made offline and deterministically
    model: Callable[[], nn.Module]           # seeded by the caller (torch.manual_seed)
    optimizer: str                           # one of OPTIMIZERS, at a constant LR
    lr: float
    batch_size: int
    epochs: int                              # the default budget: the plain loop reaches the target within it
    loss: str                                # one of LOSSES
    metric: str                              # one of METRICS
    target: float
    description: str                         # one line, for docs

    def __post_init__(self):
        for field, value, allowed in (("optimizer", self.optimizer, OPTIMIZERS), ("loss", self.loss, LOSSES),
                                      ("metric", self.metric, tuple(METRICS))):
            if value not in allowed:
                raise ValueError(f"workload {self.name!r}: {field} {value!r} is not one of {', '.join(allowed)}")

    @property
    def higher_is_better(self) -> bool:
        return METRICS[self.metric] == "higher"


WORKLOADS: dict[str, Workload] = {}


def register_workload(workload: Workload, *, replace: bool = False) -> Workload:
    """Add `workload` to the suite (`WORKLOADS`); a name already there is refused unless `replace`."""
    if workload.name in WORKLOADS and not replace:
        raise ValueError(f"a workload named {workload.name!r} is already registered")
    WORKLOADS[workload.name] = workload
    return workload


def suite_workloads(names: Iterable[str] | None = None) -> list[Workload]:
    """The registered workloads in registration order, or those of `names` in that order."""
    if names is None:
        return list(WORKLOADS.values())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"no workload {', '.join(map(repr, unknown))}; registered: {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]


def load_data(workload: Workload, data_seed: int = DATA_SEED, *, n_train: int | None = None,
              n_val: int | None = None) -> SuiteData:
    """The workload's tensors (its own: made from `DATA_SEED`), the training part cut to `n_train` samples
    and the held-out part to `n_val`."""
    d = workload.data(data_seed)
    return SuiteData(d.x[:n_train], d.y[:n_train], d.vx[:n_val], d.vy[:n_val])


# ---------------------------------------------------------------- the registered workloads' data and models
def _small(name: str) -> tuple[Callable[[int], SuiteData], Callable[[], nn.Module], float, int]:
    """bench/small.py's workload `name`: its data by seed, its model builder, its LR and batch size."""
    spec = make_small(name, n_train=1, n_val=1)

    def data(seed: int) -> SuiteData:
        w = make_small(name, seed=seed)
        return SuiteData(w.x, w.y, w.vx, w.vy)

    return data, spec.model, spec.lr, spec.batch_size


def _digits_data(seed: int) -> SuiteData:
    """scikit-learn's 1,797 handwritten digits at their own 8x8, one channel, normalised; a quarter held out."""
    train, val = digits(size=8, seed=seed)
    (x, y), (vx, vy) = train.tensors, val.tensors
    return SuiteData(x[:, :1].contiguous(), y, vx[:, :1].contiguous(), vy)


def digits_cnn() -> nn.Module:
    """Three 3x3 conv layers (32, 32, 64 channels) with one 2x2 max-pool, global pooling and a linear head."""
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _regression_data(seed: int, n_train: int = 4000, n_val: int = 1000, features: int = 16) -> SuiteData:
    """Rows of 16 Gaussian features; the target is a random tanh teacher network's output at unit variance,
    plus noise of standard deviation 0.1 (a floor of 0.01 on the validation MSE)."""
    g = torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        x = torch.randn(n_train + n_val, features, generator=g)
        y = teacher(x)
        y = (y - y.mean()) / y.std() + 0.1 * torch.randn(y.shape, generator=g)
    return SuiteData(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def regression_mlp(features: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))


LM_BLOCK, LM_BYTES = 32, 1_000_000


def _text_data(seed: int, n_train: int = 4000, n_val: int = 500) -> SuiteData:
    """Windows of 32 bytes of the standard library's source (x) and the same shifted by one (y): train
    windows from the first 90% of the text, held-out ones from the rest, at offsets drawn from `seed`."""
    text = stdlib_text(LM_BYTES).data
    cut = int(text.numel() * 0.9)
    g = torch.Generator().manual_seed(seed)

    def windows(part: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, part.numel() - LM_BLOCK - 1, (n,), generator=g)
        w = part[starts[:, None] + torch.arange(LM_BLOCK + 1)].long()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    (x, y), (vx, vy) = windows(text[:cut], n_train), windows(text[cut:], n_val)
    return SuiteData(x, y, vx, vy)


class CharGRU(nn.Module):
    """A character-level language model: byte embeddings (32 wide), one GRU layer (64 wide), a linear head."""

    def __init__(self, vocab: int = 256, embed: int = 32, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.head(self.gru(self.embed(x))[0])


def _register_builtin() -> None:
    small = {  # name: kind, LR (None: bench/small.py's), epochs, target, description
        "cnn1d": ("sequence", None, 10, 0.82, "a 1D CNN (three Conv1d layers, 5k parameters) on 4,000 noisy "
                  "waveforms of four shapes"),
        "mlp": ("tabular MLP", None, 4, 0.84, "a two-hidden-layer MLP (512 wide) on 4,000 rows of 20 features, "
                "five classes set by a random teacher network"),
        "transformer": ("transformer on non-text input", None, 12, 0.95, "a 2-layer, 32-wide transformer "
                        "encoder on 4,000 token sequences, classed by which of four markers comes first")}
    for name, (kind, lr, epochs, target, line) in small.items():
        data, model, small_lr, batch_size = _small(name)
        register_workload(Workload(name, kind, data, model, "adam", lr or small_lr, batch_size, epochs,
                                   "cross_entropy", "val_acc", target, line))
    register_workload(Workload(
        "digits_cnn", "image CNN", _digits_data, digits_cnn, "sgd", 0.05, 64, 5, "cross_entropy", "val_acc", 0.94,
        "a 3-layer CNN with BatchNorm on scikit-learn's real 8x8 handwritten digits (1,348 to train, 449 held out)"))
    register_workload(Workload(
        "regression", "regression", _regression_data, regression_mlp, "adam", 1e-3, 100, 10, "mse", "val_loss", 0.05,
        "an MLP (two 512-wide hidden layers) regressing a random teacher network's output from 16 features, MSE"))
    register_workload(Workload(
        "char_lm", "language model", _text_data, CharGRU, "adam", 3e-3, 32, 5, "cross_entropy", "val_loss", 2.1,
        "a character-level GRU language model on 32-byte windows of the standard library's own source"))


_register_builtin()


# ---------------------------------------------------------------- the plain loop
def make_optimizer(workload: Workload, model: nn.Module) -> torch.optim.Optimizer:
    """The workload's optimizer at its constant LR: Adam, AdamW (weight decay 0.01), or SGD with momentum 0.9."""
    if workload.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=workload.lr, momentum=0.9)
    if workload.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=0.01)
    return torch.optim.Adam(model.parameters(), lr=workload.lr)


def compute_loss(workload: Workload, out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The workload's loss: cross-entropy over the last dimension (class or next-token logits), or MSE."""
    if workload.loss == "mse":
        return F.mse_loss(out, y, reduction=reduction)
    return F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(workload: Workload, model: nn.Module, vx: torch.Tensor, vy: torch.Tensor) -> float:
    """The workload's metric on (`vx`, `vy`) in eval mode: accuracy, or the mean loss per target element."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(vx), EVAL_BATCH):
        out, y = model(vx[i:i + EVAL_BATCH]), vy[i:i + EVAL_BATCH]
        if workload.metric == "val_acc":
            total += float((out.argmax(-1) == y).sum())
        else:
            total += float(compute_loss(workload, out, y, reduction="sum"))
    model.train(was_training)
    return total / vy.numel()


def reached(workload: Workload, metric: float) -> bool:
    """Whether `metric` is at the workload's target (at or above it for accuracy, at or below for a loss)."""
    if math.isnan(metric):
        return False
    return metric >= workload.target if workload.higher_is_better else metric <= workload.target


def plain_run(workload: Workload, seed: int = 0, *, epochs: int | None = None,
              on_epoch: Callable[[int, float], bool] | None = None, n_train: int | None = None,
              n_val: int | None = None, data: SuiteData | None = None) -> dict:
    """The workload's plain loop: its optimizer at a constant LR over shuffled index slices, an evaluation per epoch.

    The data are the workload's own (`load_data`); `seed` draws the model's initial weights (the model is
    built after `torch.manual_seed(seed)`) and the batch order, as AlgoPerf's trials vary on one data set.
    The batches are those a `DataLoader(shuffle=True, generator=torch.Generator().manual_seed(seed))` draws,
    so a trainer fed that loader sees the same batches. `epochs` defaults to the workload's budget;
    `on_epoch(epoch, metric)` returning True stops the run. `data` replaces the workload's data (`n_train`
    and `n_val` cut it). Returns the seconds (data building not counted), the steps, the epochs run, the
    final metric and each epoch's metric (`history`).
    """
    d = data if data is not None else load_data(workload, n_train=n_train, n_val=n_val)
    torch.manual_seed(seed)
    model = workload.model()
    out = shuffled_epochs(model, make_optimizer(workload, model), d.x, d.y,
                          loss_fn=lambda out, y: compute_loss(workload, out, y), batch_size=workload.batch_size,
                          epochs=workload.epochs if epochs is None else epochs, seed=seed,
                          evaluate=lambda m: evaluate(workload, m, d.vx, d.vy), on_epoch=on_epoch)
    history = out["history"]
    return out | {"epochs": len(history), "metric": history[-1] if history else float("nan")}


def plain_to_target(workload: Workload, seed: int = 0, *, epochs: int | None = None) -> dict:
    """The plain loop run until its first evaluation at the target: `plain_run`'s result, with `to_target_s`
    and `to_target_steps` (None where the budget ran out first)."""
    d = load_data(workload)
    at: list[float] = []

    def stop(epoch: int, metric: float) -> bool:
        if reached(workload, metric):
            at.append(time.perf_counter() - t0)
            return True
        return False

    t0 = time.perf_counter()
    out = plain_run(workload, seed, epochs=epochs, on_epoch=stop, data=d)
    return {**out, "to_target_s": at[0] if at else None, "to_target_steps": out["steps"] if at else None}


# ---------------------------------------------------------------- scoring (AlgoPerf)
Table = Mapping[str, Mapping[str, "float | None"]]


def _rows(table: Table) -> list[str]:
    """Every row named on any workload, in first-seen order."""
    return list(dict.fromkeys(r for per in table.values() for r in per))


def median_run(runs: Sequence[dict]) -> dict:
    """Of repeats of one run, the one of median seconds to target (a miss infinitely slow), with every repeat's
    seconds to target as `repeats_s` and the repeats' whole seconds as `all_repeats_s` (one run: itself)."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: math.inf if r["to_target_s"] is None else r["to_target_s"])
    return ordered[len(ordered) // 2] | {"repeats_s": [r["to_target_s"] for r in runs],
                                         "all_repeats_s": sum(r.get("seconds", 0.0) for r in runs)}


def relative_times(table: Table) -> dict[str, dict[str, float]]:
    """Per workload, each row's seconds over the fastest row's there (1.0 for the fastest, ties included).

    A miss (None, or a row absent on that workload) is infinite; so is every row where no row reached the target.
    """
    rows = _rows(table)
    out = {}
    for w, per in table.items():
        secs = {r: math.inf if per.get(r) is None else float(per[r]) for r in rows}
        best = min(secs.values(), default=math.inf)
        out[w] = {r: s / best if math.isfinite(s) else math.inf for r, s in secs.items()}
    return out


def geometric_mean_speed(table: Table, row: str, reference: str) -> float | None:
    """`row`'s speed against `reference` (reference seconds over row seconds, above 1 is faster), the geometric
    mean over the workloads on which both reached the target; None where there is none. A miss is not
    averaged in: `targets_reached` counts it."""
    speeds = [per[reference] / per[row] for per in table.values()
              if per.get(row) is not None and per.get(reference) is not None]
    if not speeds:
        return None
    return math.exp(sum(math.log(s) for s in speeds) / len(speeds))


def targets_reached(table: Table) -> dict[str, int]:
    """How many workloads' targets each row reached."""
    return {r: sum(per.get(r) is not None for per in table.values()) for r in _rows(table)}


def performance_profile(table: Table, taus: Sequence[float] = TAUS) -> dict[str, dict[float, float]]:
    """AlgoPerf's performance profile: for each row and each tau, the share of all the workloads on which the
    row's relative time is at most tau (a miss never counts; the denominator is every workload)."""
    rel = relative_times(table)
    n = len(rel)
    return {r: {tau: sum(per[r] <= tau for per in rel.values()) / n if n else 0.0 for tau in taus}
            for r in _rows(table)}


def profile_score(profile: Mapping[str, Mapping[float, float]]) -> dict[str, float]:
    """AlgoPerf's benchmark score: the area under each row's profile over its taus (trapezoids), divided by
    the taus' range: 1.0 for a row fastest on every workload, 0.0 for one that reached no target."""
    out = {}
    for row, curve in profile.items():
        taus = sorted(curve)
        span = taus[-1] - taus[0]
        area = sum((b - a) * (curve[a] + curve[b]) / 2 for a, b in zip(taus, taus[1:]))
        out[row] = area / span if span > 0 else curve[taus[0]]
    return out


def plot_profile(profile: Mapping[str, Mapping[float, float]], path, *, title: str = "performance profile") -> None:
    """Draw each row's profile as a step curve to `path` (PNG, SVG, PDF by its suffix); needs matplotlib."""
    matplotlib = require("matplotlib", "plot", feature="plot_profile")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row, curve in profile.items():
        taus = sorted(curve)
        ax.step(taus, [curve[t] for t in taus], where="post", label=row)
    ax.set_xlabel("tau: time to target over the fastest row's")
    ax.set_ylabel("share of workloads within tau")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
