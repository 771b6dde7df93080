"""`decide_switches`: the trainer's measured choice of precision, channels_last, fused kernels and threads
(T18, T21, T23; the trial itself is `switches.py`).

One call turns the settings left on "auto" into `Decision`s: from the trial cache when this
model, input shape, machine and torch version were measured before; by a `SwitchTrial` on a
copy of the model and the first few real batches when the run is long enough to pay for it;
else by the fixed rules (which the decision then names as such). Under DDP rank 0 decides and
every rank applies its choice (`broadcast`). The user's model, optimizer, RNG and the loader's
data order are untouched: the batches are drawn with every generator saved and put back.

Example:
    >>> sw, decisions = decide_switches(model, optimizer, loader, device=dev, caps=DeviceCaps.of(dev),
    ...                                 precision="auto", channels_last="auto", fused="auto", remaining_steps=5000)
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from torchspeed.env import DeviceCaps, detect
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.distributed import all_reduce_max, broadcast_object, is_rank_zero
from torchspeed.train.guard import NonFiniteGuard
from torchspeed.train.optim import describe_optimizer
from torchspeed.train.precision import MixedPrecision, Precision
from torchspeed.train.memory_format import has_conv2d
from torchspeed.train.precision import normalize_precision
from torchspeed.train.rng import capture_rng_state, restore_rng_state
from torchspeed.train.switches import (MIN_RUN_FACTOR, Switches, SwitchTrial, batch_signature, candidate_grid,
                                       fusable, model_signature, rule_switches, set_fused, trial_steps)

__all__ = ["decide_switches", "rule_choice", "first_batches", "TRIAL_SETTINGS", "MeasuredSwitches"]

TRIAL_SETTINGS = {"rounds": 3, "steps": 3, "warmup": 2}


def kernel_isa() -> dict:
    """The instruction sets torch's kernels run with here: ATen's dispatch level (ATEN_CPU_CAPABILITY can lower
    it) and oneDNN's cap. A trial measured under other kernels is not reused."""
    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")}


def _generators(loader) -> list[torch.Generator]:
    found = []
    for obj in (loader, getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in found):
            found.append(g)
    return found


def first_batches(loader: Iterable, n: int = 3) -> list:
    """The first `n` batches of `loader`, leaving every RNG (global and the loader's own) as it was,
    so the run that follows sees the same data order as it would without this call."""
    gens = _generators(loader)
    saved = [g.get_state() for g in gens]
    rng = capture_rng_state()
    try:
        return list(itertools.islice(iter(loader), n))
    finally:
        for g, s in zip(gens, saved):
            g.set_state(s)
        restore_rng_state(rng)


def _current_fused(optimizer) -> bool | None:
    return bool(optimizer.defaults.get("fused")) if fusable(optimizer) else None


def _thread_choices(loader, device: torch.device, caps: DeviceCaps) -> tuple[int, ...]:
    workers = getattr(loader, "num_workers", 0) or 0
    if device.type != "cpu" or workers <= 0 or caps.cores < 2:
        return ()
    return tuple(dict.fromkeys((caps.cores, max(1, caps.cores - workers))))


def _as_decisions(sw: Switches, how: str, why: str, measured: dict | None, *, fixed: dict) -> dict[str, Decision]:
    """One Decision per switch: 'asked for' where the user fixed it, else `how` (measured/cached/rule)."""
    out = {"precision": Decision(sw.precision, fixed.get("precision") or f"{how}: {why}", measured),
           "channels_last": Decision(sw.channels_last, fixed.get("channels_last") or f"{how}: {why}", measured)}
    if sw.fused is not None:
        out["fused_optimizer"] = Decision(sw.fused, fixed.get("fused") or f"{how}: {why}", measured)
    if sw.threads is not None:
        out["threads"] = Decision(sw.threads, f"{how}: {why}", measured)
    return out


def rule_choice(model: nn.Module, *, caps: DeviceCaps, precision: str = "auto",
                channels_last: bool | str = "auto") -> tuple[Switches, dict[str, Decision]]:
    """The fixed rules' precision and layout, with their decisions: what the loop runs until (or unless)
    `decide_switches` measures. bf16/fp16 where the hardware runs it natively; channels_last for conv nets."""
    key = normalize_precision(precision)
    sw = rule_switches(caps=caps, has_conv=has_conv2d(model), precision=key, channels_last=channels_last)
    half_why = {"bf16": f"{caps.device_type.upper()} runs bf16 natively", "fp16": "fp16 Tensor Cores, no fast bf16",
                "fp32": f"no native half precision on this {caps.device_type.upper()}"}[sw.precision]
    return sw, {"precision": Decision(sw.precision, "asked for" if key != "auto" else f"rule: {half_why}"),
                "channels_last": Decision(sw.channels_last, "asked for" if channels_last != "auto" else (
                    "rule: a conv net" if sw.channels_last else "rule: no 2D convolutions"))}


def decide_switches(model: nn.Module, optimizer: torch.optim.Optimizer | None, loader: Iterable, *,
                    device: torch.device, caps: DeviceCaps, precision: str = "auto",
                    channels_last: bool | str = "auto", fused: bool | str = "auto", trial: bool | str = "auto",
                    remaining_steps: int | None = None, loss_fn: Callable | None = None,
                    step_fn: Callable | None = None, cache: TrialCache | None = None,
                    progress: Callable[[str], None] | None = None,
                    measure_fn: Callable | None = None) -> tuple[Switches, dict[str, Decision]]:
    """Choose the switches for this run; return them and their decisions (see the module docstring)."""
    precision = normalize_precision(precision)
    has_conv = has_conv2d(model)
    cur_fused = _current_fused(optimizer)
    fixed = {"precision": None if precision == "auto" else "asked for",
             "channels_last": None if channels_last == "auto" else ("asked for" if has_conv or not channels_last
                                                                    else "asked for (no 2D convolutions to change)"),
             "fused": None if fused == "auto" else "asked for"}
    grid = candidate_grid(caps=caps, has_conv=has_conv, precision=precision, channels_last=channels_last,
                          fused=cur_fused)
    fused_choice = fused == "auto" and cur_fused is not None
    threads = _thread_choices(loader, device, caps)
    prior = rule_switches(caps=caps, has_conv=has_conv, precision=precision, channels_last=channels_last,
                          fused=cur_fused)
    n_cand = len(grid) + (1 if fused_choice else 0) + len(threads)
    cost = trial_steps(n_cand, **{k: TRIAL_SETTINGS[k] for k in ("rounds", "steps", "warmup")})
    if len(grid) == 1 and not fused_choice and len(threads) < 2:
        return prior, _as_decisions(prior, "rule", "nothing left to choose", None, fixed=fixed) | {
            "switch_trial": Decision("none", "every switch is fixed or has one option here")}
    rule_why = (f"{prior.precision} is the half precision this {caps.device_type.upper()} runs natively"
                if prior.precision != "fp32" else "no native half precision") + (
        ", channels_last for a conv net" if prior.channels_last else "")
    if trial is False:
        return prior, _as_decisions(prior, "rule", rule_why, None, fixed=fixed) | {
            "switch_trial": Decision("off", "trial=False: the fixed rules decide")}
    if trial == "auto" and remaining_steps is not None and remaining_steps < MIN_RUN_FACTOR * cost:
        return prior, _as_decisions(prior, "rule", rule_why, None, fixed=fixed) | {
            "switch_trial": Decision("skipped", f"the run has {remaining_steps} steps left, under {MIN_RUN_FACTOR}x "
                                                f"the trial's ~{cost} steps: too short to pay for measuring")}
    batches = first_batches(loader)
    if not batches:
        return prior, _as_decisions(prior, "rule", rule_why, None, fixed=fixed) | {
            "switch_trial": Decision("skipped", "the loader yielded no batch")}
    info = detect()
    cache = cache if cache is not None else TrialCache()
    key = TrialCache.key({"model": model_signature(model), "batch": batch_signature(batches[0]),
                          "optimizer": type(optimizer).__name__, "caps": caps, "cpu": info.cpu_model,
                          "device": info.device_name if device.type != "cpu" else "cpu", "torch": torch.__version__,
                          "grid": [s.label() for s in grid], "fused_choice": fused_choice, "threads": threads,
                          "loss": getattr(loss_fn, "__class__", type(None)).__name__, "kernels": kernel_isa()})
    hit = cache.get(key) if measure_fn is None else None
    if hit is not None:
        sw = Switches(**hit["switches"])
        report = hit | {"steps": 0, "trial_s": 0.0, "cached_trial_s": hit.get("trial_s")}
        return sw, _as_decisions(sw, "cached trial", _summary(hit), report, fixed=fixed) | {
            "switch_trial": Decision("cached", f"measured before on this model, input and machine "
                                               f"({hit.get('trial_s', 0):.1f} s then, 0 s now)", report)}
    t0 = time.perf_counter()
    runner = SwitchTrial(model, optimizer, batches, device=device, loss_fn=loss_fn, step_fn=step_fn,
                         live_batches=(lambda: loader) if threads else None, measure_fn=measure_fn,
                         progress=progress, **TRIAL_SETTINGS)
    try:
        sw, report = runner.run(grid, fused_choice=fused_choice, thread_choices=threads)
    except Exception as e:  # e.g. no memory for a copy of a large model: the rules decide, and say why
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return prior, _as_decisions(prior, "rule", rule_why, None, fixed=fixed) | {
            "switch_trial": Decision("failed", f"the trial could not run ({why}); the fixed rules decide")}
    report["trial_s"] = time.perf_counter() - t0
    if measure_fn is None:
        cache.put(key, report)
    return sw, _as_decisions(sw, "measured", _summary(report), report, fixed=fixed) | {
        "switch_trial": Decision("measured", f"{report['steps']} steps on a copy of the model, "
                                             f"{report['trial_s']:.1f} s", report)}


def _summary(report: dict) -> str:
    return "; ".join(f"{s['stage']}: {s['chosen']}, {s['why']}" for s in report.get("stages", []))


class MeasuredSwitches:
    """The trainer's side of the measured switches (a mixin of `Trainer`): run the decision once, put the
    winner into effect on the live model, optimizer and precision, and report what is in effect."""

    def prepare(self, loader: Iterable, *, remaining_steps: int | None = None) -> None:
        """Measure the switches left on "auto" on this model and `loader`'s first batches and apply the winner
        (`autoswitch.decide_switches`; `remaining_steps` None: a long run). Once; fit and the bench's `all` call it."""
        if self._prepared:
            return
        self._prepared, cfg = True, self.config
        trial = False if cfg.deterministic else cfg.trial  # a timing-dependent choice would break bit-identical reruns
        # Under DDP the gradient buckets were laid out for the current memory format: the layout stays.
        layout = self.channels_last if self.dist is not None else cfg.channels_last
        chosen = decide_switches(self.module, self.optimizer, loader, device=self.device, caps=self.caps,
                                 precision=cfg.precision, channels_last=layout, fused=cfg.fused_optimizer, trial=trial,
                                 remaining_steps=remaining_steps, loss_fn=self.loss_fn,
                                 step_fn=self.step_fn) if is_rank_zero() else None
        sw, decisions = broadcast_object(chosen)  # every rank runs what rank 0 measured
        self.apply_switches(sw)
        self.decisions.update(decisions)

    def apply_switches(self, sw: Switches) -> None:
        """Put `sw` into effect: autocast dtype (and its scaler), memory layout, optimizer kernel, threads."""
        if sw.precision != self.precision.name:
            self.precision = MixedPrecision(Precision(sw.precision, self.device.type, "measured"))
            self.guard = NonFiniteGuard(self.config.max_nonfinite, optimizer=self.optimizer, device=self.device,
                                        scaler=self.precision.scaler, all_ranks_max=all_reduce_max if self.dist else None)
        if sw.channels_last != self.channels_last:
            self.module.to(memory_format=torch.channels_last if sw.channels_last else torch.contiguous_format)
        self.channels_last = sw.channels_last
        if sw.fused is not None and fusable(self.optimizer) and bool(self.optimizer.defaults.get("fused")) != sw.fused:
            set_fused(self.optimizer, sw.fused)
            self.decisions["optimizer"] = Decision(describe_optimizer(self.optimizer), "measured")
        if sw.threads is not None:
            torch.set_num_threads(sw.threads)

    def switches(self) -> Switches:  # in effect; saved in checkpoints: a resume runs what the run it continues ran
        fused = bool(self.optimizer.defaults.get("fused")) if fusable(self.optimizer) else None
        return Switches(self.precision.name, self.channels_last, fused, torch.get_num_threads() if self.dist is None
                        and self.device.type == "cpu" else None)
