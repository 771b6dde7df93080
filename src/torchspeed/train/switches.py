"""Every automatic switch measured on the user's own model (T18, T21, T23; T25 in compile.py; threads).

A fixed rule ("bf16 whenever the CPU has it", "channels_last for any conv net") loses on
models unlike the one it was tuned on: torchvision's ImageNet-stem ResNet-18 on 32 px images
runs slower with bf16 + channels_last on a bf16 CPU than a plain fp32 loop, while the same
rules give 2x on a CIFAR ResNet-20. So `fit` measures instead:

1. **Candidates** (`candidate_grid`, a pure function of the device's capabilities and the
   settings left on "auto"): precision (fp32, and the half precision the hardware runs
   natively: emulated bf16 is 20-50x slower and is never tried) x channels_last (only for
   models with 2D convolutions), with the optimizer's fused kernel. Then, on the winner, the
   fused kernel against foreach (SGD/Adam/AdamW), and on a CPU whose DataLoader has worker
   processes, the intra-op thread count (all usable cores, or the cores the workers leave).
   Switches interact (bf16 with channels_last can lose where each alone wins), so the first
   stage is a grid, not one switch at a time; the later stages are pruned to the winner.
2. **Measurement** (`SwitchTrial`): a throw-away copy of the model and optimizer trains on a
   few of the user's real batches; every candidate is timed for `steps` steps after a
   `warmup` step, in `rounds` interleaved rounds (a slow phase of the machine hits every
   candidate alike), median per candidate. The user's model, optimizer, RNG and data order
   are left exactly as they were.
3. **Choice** (`choose`, pure): the fastest candidate, except that a candidate with fewer
   changes from the plain loop wins when it is within `min_gain` (2%) of the fastest: noise
   does not buy a change. A half precision whose loss, at the same weights on the same
   batch, differs from fp32's by more than `loss_tol` is not taken (the numerics guard).
4. **Cost**: the trial costs about `trial_steps()` steps; it runs only when the run has at
   least `MIN_RUN_FACTOR` times as many steps left (otherwise the rules decide, and the
   decision says so), and its result is cached per (model, input shape, machine, torch
   version) in `TrialCache`, so the next run pays nothing.

torch.compile is measured on real training steps after this trial, on top of its winner
(`compile.py`): one compilation costs tens of seconds, too much to cross with every candidate.

Example:
    >>> trial = SwitchTrial(model, optimizer, batches, device=torch.device("cpu"))
    >>> best, report = trial.run(candidate_grid(caps=DeviceCaps.of("cpu"), has_conv=True))
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from torchspeed.env import DeviceCaps, sync
from torchspeed.train.batch import forward_loss
from torchspeed.train.memory_format import has_conv2d
from torchspeed.train.transfer import to_device

__all__ = ["Switches", "candidate_grid", "rule_switches", "choose", "numerics_ok", "SwitchTrial", "fusable",
           "set_fused", "trial_steps", "MIN_RUN_FACTOR"]

log = logging.getLogger("torchspeed")

MIN_RUN_FACTOR = 10  # the trial runs when the run has >= 10x its steps left (it costs <= ~10% of the run)
FUSABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class Switches:
    """One combination of the measured switches. `fused`/`threads` None: left as they are."""

    precision: str = "fp32"
    channels_last: bool = False
    fused: bool | None = None
    threads: int | None = None

    def label(self) -> str:
        parts = [self.precision] + (["channels_last"] if self.channels_last else [])
        if self.fused is not None:
            parts.append("fused" if self.fused else "foreach")
        if self.threads is not None:
            parts.append(f"{self.threads} threads")
        return "+".join(parts)

    def changes(self, plain: "Switches") -> int:
        """How many switches differ from `plain` (ties go to fewer changes)."""
        return sum(getattr(self, k) != getattr(plain, k) for k in ("precision", "channels_last", "fused", "threads"))


def fusable(optimizer: torch.optim.Optimizer | None) -> bool:
    """True when `optimizer` has a fused kernel to switch (torch's SGD, Adam, AdamW)."""
    return type(optimizer) in FUSABLE and "fused" in optimizer.defaults


def set_fused(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Switch a torch SGD/Adam/AdamW between its fused kernel and the foreach (multi-tensor) path, in place."""
    for group in [optimizer.defaults, *optimizer.param_groups]:
        group["fused"], group["foreach"] = (True, False) if fused else (None, True)
    if hasattr(optimizer, "_step_supports_amp_scaling"):
        optimizer._step_supports_amp_scaling = fused  # a fused step unscales inside its kernel (GradScaler)


def _precisions(setting: str, caps: DeviceCaps) -> list[str]:
    if setting != "auto":
        return [setting]
    return ["fp32"] + ([caps.half] if caps.half else [])


def _layouts(setting, has_conv: bool) -> list[bool]:
    if setting != "auto":
        return [bool(setting)]
    return [False, True] if has_conv else [False]


def candidate_grid(*, caps: DeviceCaps, has_conv: bool, precision: str = "auto",
                   channels_last: bool | str = "auto", fused: bool | None = None) -> list[Switches]:
    """Stage 1: every precision x memory layout left to choose, plain loop first (pure function)."""
    return [Switches(p, cl, fused) for p in _precisions(precision, caps) for cl in _layouts(channels_last, has_conv)]


def rule_switches(*, caps: DeviceCaps, has_conv: bool, precision: str = "auto", channels_last: bool | str = "auto",
                  fused: bool | None = None) -> Switches:
    """The fixed rules, used when no trial runs: the native half precision, channels_last for conv nets."""
    p = (caps.half or "fp32") if precision == "auto" else precision
    cl = has_conv if channels_last == "auto" else bool(channels_last)
    return Switches(p, cl, fused)


def numerics_ok(reference_loss: float, loss: float, *, tol: float) -> bool:
    """A candidate's loss at the same weights on the same batch is within `tol` (relative) of fp32's."""
    if not (loss == loss) or abs(loss) == float("inf"):  # NaN or inf
        return False
    return abs(loss - reference_loss) <= tol * abs(reference_loss) + 1e-4


def choose(times: dict[Switches, list[float]], *, plain: Switches, min_gain: float = 1.02,
           rejected: dict[Switches, str] | None = None) -> tuple[Switches, str]:
    """The fastest candidate (median seconds per step), or one with fewer changes within `min_gain` of it."""
    rejected = rejected or {}
    med = {s: statistics.median(t) for s, t in times.items() if t and s not in rejected}
    if not med:
        return plain, "no candidate could be measured: kept the plain settings"
    best = min(med, key=med.get)
    near = [s for s in med if med[s] <= med[best] * min_gain]
    pick = min(near, key=lambda s: (s.changes(plain), med[s]))
    ref = med.get(plain)
    if pick == plain:
        why = "the plain settings measured fastest" if best == plain else (
            f"{best.label()} was only {med[plain] / med[best]:.2f}x the plain settings (< {min_gain}x): not worth a change")
    else:
        why = (f"{ref / med[pick]:.2f}x the plain settings ({plain.label()})" if ref else "fastest measured")
    return pick, why


def trial_steps(n_candidates: int, *, rounds: int, steps: int, warmup: int) -> int:
    return n_candidates * rounds * (steps + warmup)


def _clone_optimizer(optimizer: torch.optim.Optimizer | None, model: nn.Module, source: nn.Module,
                     fused: bool | None) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters over `model` (a copy of `source`), fresh state."""
    index = {id(p): i for i, p in enumerate(source.parameters())}
    params = list(model.parameters())
    if optimizer is None:
        return torch.optim.SGD(params, lr=1e-3)
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [params[index[id(p)]] for p in g["params"]
                                                                           if id(p) in index]}
              for g in optimizer.param_groups]
    groups = [g for g in groups if g["params"]]
    try:
        opt = type(optimizer)(groups)
    except Exception:  # an optimizer that cannot be rebuilt from its groups: time with SGD instead
        return torch.optim.SGD(params, lr=1e-3)
    if fused is not None and fusable(opt):
        set_fused(opt, fused)
    return opt


class SwitchTrial:
    """Measure `Switches` candidates on a throw-away copy of `model` with the user's real `batches`.

    `batches` are host batches as the loader yields them (a few are enough: they are cycled).
    `measure_fn(switches) -> (seconds per step, loss at the starting weights)` replaces the
    timing (tests inject measurements with it; nothing else changes).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batches: list, *,
                 device: torch.device, loss_fn: Callable | None = None, step_fn: Callable | None = None,
                 rounds: int = 2, steps: int = 2, warmup: int = 1, min_gain: float = 1.02, loss_tol: float = 0.05,
                 live_batches: Callable[[], Iterable] | None = None,
                 measure_fn: Callable[[Switches], tuple[float, float]] | None = None,
                 progress: Callable[[str], None] | None = None):
        self.source, self.optimizer, self.batches, self.device = model, optimizer, batches, device
        self.loss_fn, self.step_fn = loss_fn, step_fn
        self.rounds, self.steps, self.warmup = rounds, steps, warmup
        self.min_gain, self.loss_tol = min_gain, loss_tol
        self.live_batches = live_batches
        self.measure_fn = measure_fn or self._measure
        self.progress = progress
        self.steps_run = 0
        self._copy: nn.Module | None = None
        self._start: dict | None = None

    # ------------------------------------------------------------------ one measurement
    def _model_copy(self) -> nn.Module:
        if self._copy is None:
            self._copy = copy.deepcopy(self.source)
            self._start = copy.deepcopy(self._copy.state_dict())
        self._copy.load_state_dict(self._start)  # every candidate starts from the same weights
        return self._copy

    def _measure(self, s: Switches) -> tuple[float, float]:
        model = self._model_copy()
        model.to(memory_format=torch.channels_last if s.channels_last else torch.contiguous_format)
        model.train()
        opt = _clone_optimizer(self.optimizer, model, self.source, s.fused)
        dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[s.precision]
        threads = torch.get_num_threads()
        if s.threads is not None:
            torch.set_num_threads(s.threads)
        live = iter(self.live_batches()) if (s.threads is not None and self.live_batches) else None
        first_loss = float("nan")
        try:
            times = []
            for i in range(self.warmup + self.steps):
                batch = next(live) if live is not None else self.batches[i % len(self.batches)]
                t0 = time.perf_counter()
                batch = to_device(batch, self.device, channels_last=s.channels_last)
                with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = forward_loss(model, batch, loss_fn=self.loss_fn, step_fn=self.step_fn).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i == 0:
                    first_loss = float(loss.detach().float())  # at the shared starting weights: the numerics guard
                sync(self.device)
                times.append(time.perf_counter() - t0)
                self.steps_run += 1
        finally:
            torch.set_num_threads(threads)
        return statistics.median(times[self.warmup:]), first_loss

    # ------------------------------------------------------------------ the search
    def _interleaved(self, candidates: list[Switches], report: dict) -> tuple[dict, dict]:
        times: dict[Switches, list[float]] = {s: [] for s in candidates}
        losses: dict[Switches, float] = {}
        for r in range(self.rounds):  # interleaved: a slow phase of the machine hits every candidate alike
            for s in candidates:
                if self.progress:
                    self.progress(f"measuring {s.label()} (round {r + 1}/{self.rounds})")
                try:
                    sec, loss = self.measure_fn(s)
                except Exception as e:  # e.g. a precision this model cannot run: out of the race, said why
                    report["failed"][s.label()] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    times.pop(s, None)
                    continue
                if s in times:
                    times[s].append(sec)
                    losses.setdefault(s, loss)
        return times, losses

    @staticmethod
    def _stage(name: str, times: dict, chosen: Switches, why: str) -> dict:
        return {"stage": name, "chosen": chosen.label(), "why": why,
                "seconds_per_step": {s.label(): statistics.median(t) for s, t in times.items() if t}}

    def run(self, grid: list[Switches], *, fused_choice: bool = False,
            thread_choices: tuple[int, ...] = ()) -> tuple[Switches, dict]:
        """Stage 1 on `grid`, then fused vs foreach and thread counts on the winner; (winner, report)."""
        report: dict = {"failed": {}, "rejected": {}, "stages": []}
        plain = grid[0]
        times, losses = self._interleaved(grid, report)
        rejected = {}
        ref = losses.get(plain)
        for s, loss in losses.items():
            if ref is not None and s.precision != plain.precision and not numerics_ok(ref, loss, tol=self.loss_tol):
                rejected[s] = (f"loss {loss:.4g} vs {ref:.4g} in {plain.precision} at the same weights "
                               f"(> {self.loss_tol:.0%} apart)")
                report["rejected"][s.label()] = rejected[s]
        best, why = choose(times, plain=plain, min_gain=self.min_gain, rejected=rejected)
        report["stages"].append(self._stage("precision x layout", times, best, why))
        report["losses"] = {s.label(): v for s, v in losses.items()}
        if fused_choice and best.fused is not None:
            other = replace(best, fused=not best.fused)
            t2, _ = self._interleaved([best, other], report)
            pick, why = choose(t2, plain=replace(best, fused=False), min_gain=self.min_gain)
            report["stages"].append(self._stage("optimizer kernel", t2, pick, why))
            best = pick
        if len(thread_choices) > 1:
            cands = [replace(best, threads=n) for n in thread_choices]
            t3, _ = self._interleaved(cands, report)
            pick, why = choose(t3, plain=cands[0], min_gain=self.min_gain)
            report["stages"].append(self._stage("threads", t3, pick, why))
            best = pick
        report["steps"] = self.steps_run
        report["chosen"] = best.label()
        report["switches"] = asdict(best)
        self._copy = self._start = None  # free the copy
        return best, report


def model_signature(model: nn.Module) -> dict:
    """What identifies a model for the trial cache: its class and parameter shapes and dtypes."""
    shapes = [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()]
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}", "params": shapes,
            "conv2d": has_conv2d(model)}


def batch_signature(batch) -> object:
    """Shapes and dtypes of a batch's tensors (nested), for the trial cache."""
    if isinstance(batch, torch.Tensor):
        return [list(batch.shape), str(batch.dtype)]
    if isinstance(batch, dict):
        return {k: batch_signature(v) for k, v in sorted(batch.items())}
    if isinstance(batch, (list, tuple)):
        return [batch_signature(b) for b in batch]
    return type(batch).__name__
