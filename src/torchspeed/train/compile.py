"""torch.compile, only where it pays (T25).

`torch.compile` fuses pointwise operations into single kernels (what TorchScript did for
T25) and removes Python overhead. It costs compile time (tens of seconds for a ResNet on a
2-core CPU), and some models or machines cannot compile at all (no C++ compiler, an
unsupported operator). So:

- `compile=True` compiles, and falls back to eager with a message if compilation fails;
- `compile="auto"` measures a few real training steps eager and compiled, and keeps the
  compiled model only when it is faster by at least `min_gain`;
- `compile=False` never compiles.

`compile_model` is the plain function; `CompileTrial` is the measured decision the trainer
uses.

Example:
    >>> fast = compile_model(model)  # the eager model is returned on failure
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["compile_model", "CompileTrial", "CompileDecision"]

log = logging.getLogger("torchspeed")


def compile_model(model: nn.Module, *, mode: str | None = None, dynamic: bool | None = False) -> nn.Module:
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

    @property
    def speedup(self) -> float | None:
        if self.eager_s and self.compiled_s:
            return self.eager_s / self.compiled_s
        return None


@dataclass
class CompileTrial:
    """Times `steps` eager and `steps` compiled training steps and decides.

    The trainer feeds it real training steps (they train the model as any other step), so
    the trial wastes no work beyond compile time. Timings end with a device sync so that
    queued GPU work is counted.
    """

    steps: int = 3
    warmup: int = 1
    min_gain: float = 1.03
    eager_times: list[float] = field(default_factory=list)
    compiled_times: list[float] = field(default_factory=list)
    compile_s: float | None = None

    def phase(self) -> str:
        if len(self.eager_times) < self.warmup + self.steps:
            return "eager"
        if len(self.compiled_times) < 1 + self.warmup + self.steps:  # 1: the compiling step
            return "compiled"
        return "done"

    def record(self, phase: str, seconds: float) -> None:
        (self.eager_times if phase == "eager" else self.compiled_times).append(seconds)
        if phase == "compiled" and len(self.compiled_times) == 1:
            self.compile_s = seconds

    def decide(self) -> CompileDecision:
        eager = sorted(self.eager_times[self.warmup:])
        comp = sorted(self.compiled_times[1 + self.warmup:])
        e, c = eager[len(eager) // 2], comp[len(comp) // 2]  # medians: robust to one noisy step
        if e / c >= self.min_gain:
            return CompileDecision(True, f"compiled step {e / c:.2f}x faster than eager", e, c, self.compile_s)
        return CompileDecision(False, f"compiled step only {e / c:.2f}x eager (< {self.min_gain}x): kept eager",
                               e, c, self.compile_s)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
