"""`torchspeed.slim`: structured pruning chosen by the time it saves on this machine, not by MACs (T38).

Torch-Pruning's own table cuts ResNet-50's multiply-accumulates 3.85x for 2.19x lower latency, and a
5% prune ran slower than the model it came from: what a prune buys depends on the kernels and the
machine. So `slim` takes a target in the user's currency and measures:

- `ratio=0.5`: remove half of every prunable layer's channels (then measure, for the report);
- `speedup=1.5`: the smallest prune whose train step (forward, backward, optimizer step) runs 1.5x
  faster than the original's, measured side by side;
- `latency_ms=5.0`: the smallest prune whose inference forward of `example_inputs` takes 5 ms or less.

Candidate ratios (`CANDIDATES`) are searched by bisection (fewer channels is assumed never slower),
each pruned copy timed in interleaved rounds with the original (train/rounds.py). The pruning
itself is `torchspeed.model.prune.prune_channels` (magnitude or Taylor importance, the classifier
and `ignored_layers` kept, widths rounded to multiples of 8). The report holds params, MACs, step
time and latency before and after, every candidate measured, and the accuracy before pruning,
after it, and after `finetune` (which trains the pruned model with `fit`) when a validation loader is
given. Timings are fp32 eager on the model's device; the step is timed at the first of `batches`
(else at `example_inputs`, on a stand-in loss).

Cost: one prune and one timed pair (~2 x `rounds` steps and forwards) per candidate measured.

Example:
    >>> res = torchspeed.slim(model, x[:64], speedup=1.5, batches=[next(iter(loader))], val_loader=val)
    >>> print(res.report.table()); torchspeed.finetune(res, loader, val_loader=val, epochs=1)
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from torchspeed._extras import require
from torchspeed.env import sync
from torchspeed.fitting import fit
from torchspeed.model.prune import (ROUND_TO, channel_widths, check_example_inputs, check_ratio, is_channels_last,
                                    prune_channels)
from torchspeed.train.loop.batch import forward_loss
from torchspeed.train.evaluate import evaluate
from torchspeed.train.optim_info import default_lr
from torchspeed.train.result import FitResult
from torchspeed.train.rounds import interleaved, paired_ratios, run_for
from torchspeed.train.loop.step import backward, optimizer_step
from torchspeed.train.transfer import to_device

__all__ = ["CANDIDATES", "SlimReport", "SlimResult", "slim", "finetune", "measure_models"]

CANDIDATES = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)  # the ratios a speed-up or latency target searches
ROUNDS = 5


@dataclass
class SlimReport:
    """What was pruned and what it bought, measured here: each pair is (before, after)."""

    target: dict
    ratio: float
    importance: str
    met: bool
    params: tuple[int, int]
    macs: tuple[int, int]                      # multiply-accumulates of one sample's forward
    step_s: tuple[float, float]                # median train step (forward, backward, optimizer step)
    latency_s: tuple[float, float]             # median forward of example_inputs, eval mode, no grad
    step_speedup: float                        # median of the per-round ratios, original over pruned
    latency_speedup: float
    candidates: list[dict] = field(default_factory=list)  # every ratio measured, in the order measured
    widths: dict = field(default_factory=dict)            # each layer's output width after pruning
    accuracy: dict = field(default_factory=dict)          # "before", "pruned", "finetuned" (val_acc)
    device: str = "cpu"

    @property
    def recovered(self) -> float | None:
        """The share of the accuracy pruning lost that the fine-tune won back (1.0: all of it)."""
        a = self.accuracy
        if not {"before", "pruned", "finetuned"} <= set(a) or a["before"] <= a["pruned"]:
            return None
        return (a["finetuned"] - a["pruned"]) / (a["before"] - a["pruned"])

    def to_dict(self) -> dict:
        return {**asdict(self), "recovered": self.recovered}

    def table(self) -> str:
        """Markdown: the before/after rows (what docs/slim.md shows)."""
        rows = ["| | before | after | ratio |", "|---|---|---|---|",
                f"| params | {self.params[0]:,} | {self.params[1]:,} | {self.params[0] / self.params[1]:.2f}x |",
                f"| MACs / sample | {self.macs[0]:,} | {self.macs[1]:,} | {self.macs[0] / self.macs[1]:.2f}x |",
                f"| train step | {self.step_s[0] * 1e3:.2f} ms | {self.step_s[1] * 1e3:.2f} ms | "
                f"{self.step_speedup:.2f}x |",
                f"| latency | {self.latency_s[0] * 1e3:.2f} ms | {self.latency_s[1] * 1e3:.2f} ms | "
                f"{self.latency_speedup:.2f}x |"]
        for k in ("before", "pruned", "finetuned"):
            if k in self.accuracy:
                rows.append(f"| val_acc ({k}) | {self.accuracy[k]:.4f} | | |")
        return "\n".join(rows)


@dataclass
class SlimResult:
    model: nn.Module
    report: SlimReport


def _energy(out: torch.Tensor, target) -> torch.Tensor:
    """The stand-in loss when no real batch is given: the step's cost does not depend on which loss it is."""
    return out.float().square().mean()


def _step_call(model: nn.Module, batch, loss_fn) -> Callable[[], None]:
    """One training step of a private copy of `model` (SGD with momentum: the weights of the copy move)."""
    m = copy.deepcopy(model).train()
    opt = torch.optim.SGD(m.parameters(), lr=1e-4, momentum=0.9)

    def one() -> None:
        backward(forward_loss(m, batch, loss_fn=loss_fn).loss)
        optimizer_step(opt)
        opt.zero_grad(set_to_none=True)
    return one


def _latency_call(model: nn.Module, example_inputs) -> Callable[[], None]:
    m = copy.deepcopy(model).eval()
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)

    def one() -> None:
        with torch.inference_mode():
            m(*args)
    return one


def _per_call(call: Callable[[], None], device: torch.device, min_time: float) -> Callable[[], float]:
    def measure() -> float:
        n, s = run_for(call, min_calls=2, min_time=min_time, sync=lambda: sync(device))
        return s / n
    return measure


def measure_models(models: dict[str, nn.Module], example_inputs, *, batch=None, loss_fn=None,
                   rounds: int = ROUNDS, min_time: float = 0.05) -> dict[str, dict]:
    """Each model's median train step and latency, timed in interleaved rounds after a warm-up; with the
    per-round speed-up of each over the first model. `batch`: the step's batch (default: `example_inputs`
    with a stand-in loss)."""
    if batch is None:
        batch, loss_fn = (example_inputs, torch.zeros(1)), _energy
    first = next(iter(models.values()))
    device = next(first.parameters()).device
    if is_channels_last(first):  # time the layout the model trains in: its inputs channels_last too (T23)
        batch, example_inputs = (to_device(v, device, non_blocking=False, channels_last=True)
                                 for v in (batch, example_inputs))
    out: dict[str, dict] = {}
    for what, make in (("step_s", lambda m: _step_call(m, batch, loss_fn)),
                       ("latency_s", lambda m: _latency_call(m, example_inputs))):
        r = interleaved({k: _per_call(make(m), device, min_time) for k, m in models.items()},
                        rounds=rounds, warmup=1)
        ref = next(iter(models))
        for k, times in r.times.items():
            row = out.setdefault(k, {})
            row[what] = statistics.median(times)
            row[what.replace("_s", "_speedup")] = statistics.median(paired_ratios(r.times[ref], times))
            row[what + "_rounds"] = times
    return out


def _count(model: nn.Module, example_inputs) -> tuple[int, int]:
    """(MACs of one sample's forward, parameters), Torch-Pruning's counter."""
    tp = require("torch_pruning", "slim", feature="structured pruning (torchspeed.slim)")
    one = tuple(t[:1] for t in example_inputs) if isinstance(example_inputs, tuple) else example_inputs[:1]
    macs, params = tp.utils.count_ops_and_params(model, one)
    return int(macs), int(params)


def _check_target(ratio, speedup, latency_ms) -> dict:
    given = {k: v for k, v in (("ratio", ratio), ("speedup", speedup), ("latency_ms", latency_ms)) if v is not None}
    if len(given) != 1:
        raise ValueError(f"give slim one target, not {len(given)}: ratio=0.5 (the share of channels to remove), "
                         "speedup=1.5 (the train step that much faster) or latency_ms=5.0 (an inference bound)")
    if "ratio" in given:
        check_ratio(ratio)
    elif "speedup" in given and not speedup > 1.0:
        raise ValueError(f"speedup={speedup!r}: the train step's speed-up to reach must be above 1 (e.g. 1.5)")
    elif "latency_ms" in given and not latency_ms > 0:
        raise ValueError(f"latency_ms={latency_ms!r}: the inference latency bound must be a positive number of "
                         "milliseconds")
    return given


def _meets(target: dict, row: dict) -> bool:
    if "speedup" in target:
        return row["step_speedup"] >= target["speedup"]
    if "latency_ms" in target:
        return row["latency_s"] * 1e3 <= target["latency_ms"]
    return True


def _search(target: dict, measure_at: Callable[[float], tuple[nn.Module, dict]],
            candidates: Sequence[float]) -> tuple[float, nn.Module, dict, list[dict], bool]:
    """(ratio, pruned model, its row, every row measured, met): a ratio as given, else the smallest candidate
    meeting the target by bisection (none meets: the largest, `met` False)."""
    if "ratio" in target:
        pruned, row = measure_at(target["ratio"])
        return target["ratio"], pruned, row, [row], True
    cands = sorted(candidates)
    lo, hi, rows, found = -1, len(cands), [], {}
    while hi - lo > 1:
        i = (lo + hi) // 2
        found[i] = measure_at(cands[i])
        rows.append(found[i][1])
        if _meets(target, found[i][1]):
            hi = i
        else:
            lo = i
    i, met = (hi, True) if hi < len(cands) else (max(found), False)
    return cands[i], found[i][0], found[i][1], rows, met


def slim(model: nn.Module, example_inputs, *, ratio: float | None = None, speedup: float | None = None,
         latency_ms: float | None = None, importance: str = "magnitude", batches: Sequence | None = None,
         loss_fn: Callable | None = None, ignored_layers: Iterable[nn.Module | str] = (),
         round_to: int | None = ROUND_TO, val_loader: Iterable | None = None,
         candidates: Sequence[float] = CANDIDATES, rounds: int = ROUNDS) -> SlimResult:
    """Prune `model`'s channels to the one target given (`ratio`, `speedup` of the train step, or
    `latency_ms`), measured on this machine; the original is left as it is.

    `example_inputs`: a batch of inputs as the model takes them (traced for the dependency graph, timed
    for latency). `batches`: a few real (inputs..., target) batches: Taylor importance's gradients and the
    train step's timing. `val_loader`: accuracy before and after pruning in the report.

    Example:
        >>> res = slim(model, x[:64], ratio=0.5)
        >>> res.report.step_speedup, res.model
    """
    target = _check_target(ratio, speedup, latency_ms)
    out = check_example_inputs(model, example_inputs)
    batches = list(batches or ())
    step_batch = batches[0] if batches else None
    original = copy.deepcopy(model)

    def measure_at(r: float) -> tuple[nn.Module, dict]:
        pruned = prune_channels(original, example_inputs, ratio=r, importance=importance, batches=batches,
                                loss_fn=loss_fn, ignored_layers=_names(model, ignored_layers), round_to=round_to)
        if check_example_inputs(pruned, example_inputs).shape != out.shape:
            raise RuntimeError(f"pruning at {r} changed the output's shape: report this model to torchspeed")
        rows = measure_models({"original": original, "pruned": pruned}, example_inputs, batch=step_batch,
                              loss_fn=loss_fn, rounds=rounds)
        return pruned, {"ratio": r, "macs": _count(pruned, example_inputs)[0], **rows["pruned"],
                        "original_step_s": rows["original"]["step_s"],
                        "original_latency_s": rows["original"]["latency_s"]}

    chosen, pruned, row, rows, met = _search(target, measure_at, candidates)
    macs0, params0 = _count(original, example_inputs)
    macs1, params1 = _count(pruned, example_inputs)
    report = SlimReport(target=target, ratio=chosen, importance=importance, met=met, params=(params0, params1),
                        macs=(macs0, macs1), step_s=(row["original_step_s"], row["step_s"]),
                        latency_s=(row["original_latency_s"], row["latency_s"]), step_speedup=row["step_speedup"],
                        latency_speedup=row["latency_speedup"], candidates=rows, widths=channel_widths(pruned),
                        device=str(next(model.parameters()).device))
    if val_loader is not None:
        report.accuracy = {"before": evaluate(original, val_loader)["val_acc"],
                           "pruned": evaluate(pruned, val_loader)["val_acc"]}
    return SlimResult(pruned, report)


def _names(model: nn.Module, layers: Iterable[nn.Module | str]) -> list[str]:
    """`ignored_layers` as module names (the pruner works on a copy, where the same names find them)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for layer in layers:
        if not isinstance(layer, str) and id(layer) not in names:
            raise ValueError(f"ignored_layers holds a {type(layer).__name__} that is not part of the model: "
                             "pass the model's own modules (or their names)")
        out.append(layer if isinstance(layer, str) else names[id(layer)])
    return out


FINETUNE_LR_SHARE = 0.1  # a fine-tune given no LR: this share of the optimizer's default LR, constant


def finetune(result: SlimResult, train_loader: Iterable, *, val_loader: Iterable | None = None,
             **fit_options) -> FitResult:
    """Train the pruned model with `fit` (every option of `fit`), and record its final `val_acc` in the report
    (`report.accuracy["finetuned"]`, `report.recovered`).

    The pruned model starts from trained weights, so without `lr=` (and `recipe=`) it fine-tunes at a tenth of the
    optimizer's default LR (SGD: 0.01), held constant: `fit`'s default for a model trained from scratch (one-cycle
    to 0.1) throws those weights away first. Measured on ResNet-20 pruned 50% on the digits, 20% of the full
    run's steps (docs/slim.md): 0.9844 against 0.9889 unpruned, where the from-scratch default reached 0.9599."""
    if fit_options.get("lr") is None and not fit_options.get("recipe"):
        opt = fit_options.get("optimizer", "sgd")
        if isinstance(opt, str):
            fit_options["lr"] = FINETUNE_LR_SHARE * default_lr(opt)
    res = fit(result.model, train_loader, val_loader=val_loader, **fit_options)
    if val_loader is not None and res.final.get("val_acc") is not None:
        result.report.accuracy["finetuned"] = float(res.final["val_acc"])
    return res
