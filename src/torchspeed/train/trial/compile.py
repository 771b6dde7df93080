"""torch.compile, only where it pays (T25).

`torch.compile` fuses pointwise operations into single kernels (what TorchScript did for
T25) and removes Python overhead; with `mode="reduce-overhead"` it also replays the step's
kernels as CUDA graphs, which removes the per-kernel launch cost that dominates small
steps on a fast GPU. It costs compile time (tens of seconds for a ResNet on a 2-core CPU),
and some models or machines cannot compile at all (no C++ compiler, an unsupported
operator). So:

- `compile=True` compiles, and falls back to eager with a message if compilation fails;
- `compile="auto"` measures a few real training steps eager and compiled (on CUDA: the
  default mode and CUDA graphs), and keeps the fastest only when it beats eager by at least
  `min_gain`. A run too short to pay back a compilation (under `min_run_s` of eager
  training left, estimated from the measured eager steps) stays eager without compiling;
- `compile=False` never compiles.

Shapes: `dynamic=None` (torch's automatic dynamic shapes). The first shape compiles a static
graph; the first time a dimension changes (a new padded sequence length, the last smaller
batch) torch recompiles once with that dimension symbolic, and every later length reuses
it. So varying lengths cost two compilations, not one per length (`dynamic=False` would
recompile for each new length until torch's cache limit, then run eager), and fixed-shape
image training keeps its fully static, fastest graph.

`compile_model` is the plain function; `CompileTrial` is the measured decision and
`CompileController` holds the compiled modules and the decision for the trainer.

Example:
    >>> fast = compile_model(model)  # the eager model is returned on failure
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from torchspeed.env import sync
from torchspeed.train.decision import Decision, Decisions
from torchspeed.train.wrappers import unwrap_model

__all__ = ["compile_model", "CompileTrial", "CompileDecision", "CompileController", "MIN_RUN_S", "arm_compile_trial"]

log = logging.getLogger("torchspeed")

# Below this much eager training left, compile="auto" does not compile: one compilation costs
# 30-90 s for a ResNet, and a 1.2x faster step saves a sixth of the run.
MIN_RUN_S = 300.0


def compile_model(model: nn.Module, *, mode: str | None = None, dynamic: bool | None = None) -> nn.Module:
    """`torch.compile(model)`; the model itself (eager) if torch cannot compile here."""
    if not hasattr(torch, "compile"):
        log.warning("torch.compile is not available in torch %s; running eager", torch.__version__)
        return model
    try:
        return torch.compile(model, mode=mode, dynamic=dynamic)
    except Exception as e:  # compile() itself is lazy; this catches set-up failures only
        log.warning("torch.compile failed (%s); running eager", e)
        return model


@dataclass
class CompileDecision:
    use_compiled: bool
    reason: str
    eager_s: float | None = None
    compiled_s: float | None = None
    compile_s: float | None = None
    error: str | None = None
    mode: str | None = None

    @property
    def speedup(self) -> float | None:
        if self.eager_s and self.compiled_s:
            return self.eager_s / self.compiled_s
        return None


def _mode_name(mode: str | None) -> str:
    return mode or "default"


@dataclass
class CompileTrial:
    """Times `steps` eager steps, then `steps` compiled steps per mode, and decides.

    The trainer feeds it real training steps (they train the model as any other step), so
    the trial wastes no work beyond compile time. Timings end with a device sync so that
    queued GPU work is counted. Each compiled mode gets one compiling step and `warmup`
    untimed steps first (CUDA graphs record on their first calls).
    """

    steps: int = 3
    warmup: int = 1
    min_gain: float = 1.03
    modes: tuple[str | None, ...] = (None,)
    remaining_steps: int | None = None  # steps left in the run when the trial started (None: unknown)
    min_run_s: float = 0.0
    eager_times: list[float] = field(default_factory=list)
    compiled_times: dict = field(default_factory=dict)
    compile_times: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    _short: bool = False

    @property
    def compile_s(self) -> float | None:
        return sum(self.compile_times.values()) if self.compile_times else None

    def _eager_median(self) -> float:
        return statistics.median(self.eager_times[self.warmup:])

    def current_mode(self) -> str | None:
        for m in self.modes:
            if m not in self.failed and len(self.compiled_times.get(m, [])) < 1 + self.warmup + self.steps:
                return m
        return None

    def phase(self) -> str:
        if len(self.eager_times) < self.warmup + self.steps:
            return "eager"
        if self.remaining_steps is not None and not self.compiled_times and not self.failed:
            left = self.remaining_steps - len(self.eager_times)
            if left * self._eager_median() < self.min_run_s:
                self._short = True
                return "done"
        if any(m not in self.failed and len(self.compiled_times.get(m, [])) < 1 + self.warmup + self.steps
               for m in self.modes):
            return "compiled"
        return "done"

    def record(self, phase: str, seconds: float) -> None:
        if phase == "eager":
            self.eager_times.append(seconds)
            return
        mode = self.current_mode()
        times = self.compiled_times.setdefault(mode, [])
        times.append(seconds)
        if len(times) == 1:
            self.compile_times[mode] = seconds

    def fail(self, error: BaseException) -> None:
        """The current mode could not compile or run: try the next one, or stay eager."""
        self.failed[self.current_mode()] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"

    def decide(self) -> CompileDecision:
        e = self._eager_median()
        if self._short:
            left = (self.remaining_steps or 0) - len(self.eager_times)
            return CompileDecision(False, f"kept eager: the rest of the run (~{left * e:.0f} s eager) is too short "
                                          f"to pay back a compilation (compile='auto' compiles runs over "
                                          f"{self.min_run_s:.0f} s)", e)
        timed = {m: statistics.median(t[1 + self.warmup:]) for m, t in self.compiled_times.items()
                 if m not in self.failed and len(t) > 1 + self.warmup}
        if not timed:
            errors = "; ".join(f"{_mode_name(m)}: {err}" for m, err in self.failed.items())
            return CompileDecision(False, f"torch.compile failed ({errors}); continuing eager", e,
                                   compile_s=self.compile_s, error=errors or None)
        mode = min(timed, key=timed.get)
        c = timed[mode]
        tried = "" if len(self.modes) == 1 else " (" + ", ".join(
            f"{_mode_name(m)} {e / t:.2f}x" for m, t in timed.items()) + ")"
        label = "" if mode is None else f" (mode={mode})"
        if e / c >= self.min_gain:
            return CompileDecision(True, f"compiled step {e / c:.2f}x faster than eager{label}{tried}", e, c,
                                   self.compile_s, mode=mode)
        return CompileDecision(False, f"compiled step only {e / c:.2f}x eager (< {self.min_gain}x): kept eager{tried}",
                               e, c, self.compile_s, mode=mode)


class CompileController:
    """The trainer's compile switch: which module runs the forward, and the decision behind it.

    `setting` is TrainConfig.compile (True | False | "auto"); `mode` is TrainConfig.compile_mode.
    With "auto" and no mode given, CUDA tries the default mode and CUDA graphs
    ("reduce-overhead"); the CPU tries the default mode.

    Example:
        >>> ctl = CompileController(model, "auto", device=torch.device("cuda"))
        >>> ctl.run(train_step, batch, on_fallback=reset)  # one step; the trial runs while undecided
        >>> ctl.forward(x)                                  # the module the decision picked
    """

    def __init__(self, model: nn.Module, setting: bool | str, *, device: torch.device, mode: str | None = None,
                 min_run_s: float = MIN_RUN_S, decide_all_ranks: Callable[[CompileDecision], CompileDecision]
                 | None = None, decisions: dict | None = None):
        self.model, self.device, self.setting = model, device, setting
        self.decisions = decisions if decisions is not None else Decisions()  # "compile": a Decision
        self._compiled: dict[str | None, nn.Module] = {}
        self._broadcast = decide_all_ranks or (lambda d: d)
        self.active: nn.Module = model
        self.mode: str | None = None  # the mode of the active compiled module
        self.trial: CompileTrial | None = None
        self._verified = True
        if setting == "auto":
            modes = (mode,) if mode is not None else (None, "reduce-overhead") if device.type == "cuda" else (None,)
            warm = 2 if "reduce-overhead" in modes else 1
            self.trial = CompileTrial(modes=modes, warmup=warm, min_run_s=min_run_s)
        elif setting is True:
            self._use(mode)
            self._verified = False
            self.decisions["compile"] = Decision(True, "asked for" + ("" if mode is None else f", mode={mode}"))
        else:
            self.decisions["compile"] = Decision(False, "off")

    @property
    def wrapped_module(self) -> nn.Module:
        """The user's module (`train.wrappers.unwrap_model` looks for this name)."""
        return self.model

    @property
    def undecided(self) -> bool:
        return self.trial is not None

    def plan(self, remaining_steps: int) -> None:
        """Tell an undecided trial how many steps the run has left (enables the short-run rule)."""
        if self.trial is not None and not self.trial.eager_times:
            self.trial.remaining_steps = remaining_steps

    def after_switch_trial(self, eager_times: list[float], remaining_steps: int) -> None:
        """The switch trial's timed steps of its winner are eager steps of this run's settings: the compile trial
        starts from them (no eager phase of its own) and may decide at once that the rest of the run is too short."""
        trial = self.trial
        if trial is None or trial.eager_times or not eager_times:
            return
        need = trial.warmup + trial.steps
        times = [eager_times[0]] * trial.warmup + list(eager_times)  # the first timed step stands in for warm-up
        while len(times) < need:
            times.append(statistics.median(eager_times))
        trial.eager_times = times
        trial.remaining_steps = remaining_steps + len(times)
        self._finish_if_done()

    def finish(self) -> None:
        """The run ended with the trial undecided: decide on what was measured (eager when nothing was)."""
        trial = self.trial
        if trial is None:
            return
        if len(trial.eager_times) <= trial.warmup:
            self.apply(CompileDecision(False, "kept eager: the run ended before the compile trial could measure"))
        else:
            self.apply(self._broadcast(trial.decide()))

    def forward(self, *args, **kwargs):
        return self._running()(*args, **kwargs)

    def _running(self) -> nn.Module:
        """The module this step runs (under CUDA graphs, the step marked begun first)."""
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # this step's outputs may overwrite the last step's
        return self.active

    __call__ = forward  # the controller stands in for the model: `controller(x)` runs the chosen module

    def for_step_fn(self):
        """What a `step_fn(model, batch)` is given: the module that runs this step, the user's own (eager) or torch's
        compiled wrapper of it (an `nn.Module` that reads through to it), as the user's own loop would hand it, so
        `copy.deepcopy(model)`, `AveragedModel(model)`, `torch.func.functional_call(model, ...)`, `isinstance(model,
        nn.Module)` and attributes the step sets see the user's module (a model the user compiled: that object).
        Under DDP this controller instead (its attributes are the user's module's; calling it runs DDP's forward,
        which syncs the gradients); FSDP2 shards the user's module in place, which is handed as it is."""
        return self if isinstance(self.model, nn.parallel.DistributedDataParallel) else self._running()

    def __getattr__(self, name: str):
        """Any other attribute is the user's module's: a `step_fn(model, batch)` given this controller (under DDP:
        `for_step_fn`) may call `model.init_hidden(...)`, read `model.config` or a submodule, as on its own."""
        model = self.__dict__.get("model")
        if model is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(unwrap_model(model), name)

    @contextlib.contextmanager
    def eager(self):
        """Run the plain module inside this block (the switch trial's steps), then what was active again."""
        saved = self.active, self.mode
        self.active, self.mode = self.model, None
        try:
            yield
        finally:
            self.active, self.mode = saved

    def _use(self, mode: str | None) -> None:
        if mode not in self._compiled:
            self._compiled[mode] = compile_model(self.model, mode=mode)
        self.active, self.mode = self._compiled[mode], mode

    def _eager(self) -> None:
        self.active, self.mode = self.model, None

    def run(self, step: Callable, batch, *, on_fallback: Callable[[], None], is_fatal: Callable[[BaseException], bool]):
        """Run one training step `step(batch)`, timing it for the trial or verifying a first compiled step."""
        if self.trial is not None:
            return self._trial_step(step, batch, on_fallback, is_fatal)
        if not self._verified:  # compile=True: the first step compiles; on failure continue eager
            try:
                out = step(batch)
            except Exception as e:
                if is_fatal(e):
                    raise
                self._fall_back(e, on_fallback)
                out = step(batch)
            self._verified = True
            return out
        return step(batch)

    def _trial_step(self, step, batch, on_fallback, is_fatal):
        trial = self.trial
        phase = trial.phase()
        if phase == "compiled":
            self._use(trial.current_mode())
        else:
            self._eager()
        t0 = time.perf_counter()
        try:
            out = step(batch)
        except Exception as e:
            if phase != "compiled" or is_fatal(e):
                raise
            log.warning("torch.compile (mode %s) failed in the trial: %s", _mode_name(trial.current_mode()),
                        str(e).splitlines()[0][:200])
            trial.fail(e)
            on_fallback()
            self._eager()
            out = step(batch)
            self._finish_if_done()
            return out
        sync(self.device)
        trial.record(phase, time.perf_counter() - t0)
        self._finish_if_done()
        return out

    def _finish_if_done(self) -> None:
        if self.trial is not None and self.trial.phase() == "done":
            self.apply(self._broadcast(self.trial.decide()))  # every rank runs what rank 0 measured

    def _fall_back(self, e: BaseException, on_fallback: Callable[[], None]) -> None:
        msg = f"torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); continuing eager"
        log.warning(msg)
        on_fallback()
        self.apply(CompileDecision(False, msg, error=str(e)))

    def apply(self, decision: CompileDecision) -> None:
        self.trial = None
        if decision.use_compiled and (decision.mode in self._compiled):
            self._use(decision.mode)
            self._compiled = {decision.mode: self._compiled[decision.mode]}  # drop the modes not chosen
        else:
            self._eager()
            self._compiled.clear()
        self.decisions.refine("compile", Decision(bool(decision.use_compiled), decision.reason, asdict(decision)))


def arm_compile_trial(trainer, loader, remaining_steps: int | None) -> None:
    """A first-steps part (`Trainer.first_steps`; fit's plan: its "compile_trial" stage): tell the trainer's compile
    trial how many steps the run has left (a run too short to pay back a compilation stays eager)."""
    trainer.compiler.plan(remaining_steps)
