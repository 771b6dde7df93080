"""The hand-written ceiling: the best plain PyTorch loop for this machine (T18, T21, T23, T25, T26).

`torchspeed bench` compares torchspeed not only with the naive loop but with the loop a
skilled engineer writes by hand: plain PyTorch, no torchspeed code in the step, with the
settings that are fastest on this machine found by trying them. `HandLoop` is that loop
(autocast, channels_last, fused SGD, torch.compile, `zero_grad(set_to_none=True)`, the
loss read once per round, `non_blocking` copies from a pinned DataLoader on CUDA).
`search_hand_settings` finds its settings by measuring:

1. every eager combination of precision x channels_last x fused optimizer, interleaved in
   two passes, each timed over a few steps after one untimed step; the fastest wins;
2. torch.compile on top of the winner, kept if the compiled steps are faster.

Precisions tried: fp32, plus bf16 where this device runs it natively (CUDA sm80+, CPUs with
AVX512-BF16/AMX) and fp16 on older GPUs. Emulated bf16 is not tried: on a CPU without those
units one bf16 convolution runs 20-50x slower than fp32 (docs/bench.md), which a skilled
engineer knows without trying. The compile step is not crossed with every eager
combination because one compilation costs tens of seconds on a CPU; compile's gain
multiplies on top of the eager settings.

Example:
    >>> settings, log = search_hand_settings(make_model, loader, device)
    >>> loop = HandLoop(make_model(), loader, device, settings=settings, lr=0.05)
    >>> seconds = loop.run(20)
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.env import sync
from torchspeed.train.trial.precision import half_precision
from torchspeed.train.rounds import interleaved

__all__ = ["HandSettings", "HandLoop", "search_hand_settings", "hand_precisions"]


@dataclass(frozen=True)
class HandSettings:
    precision: str = "fp32"        # "fp32" | "bf16" | "fp16"
    channels_last: bool = False
    fused: bool = False
    compile: bool = False

    def label(self) -> str:
        parts = [self.precision] + [k for k in ("channels_last", "fused", "compile") if getattr(self, k)]
        return "+".join(parts)


def hand_precisions(device: torch.device) -> list[str]:
    """The precisions worth trying on `device`: fp32 and the half precision its hardware runs natively."""
    half = half_precision(device)
    return ["fp32"] + ([half] if half else [])


class HandLoop:
    """A plain training loop: SGD (Nesterov momentum, no decay on biases and norms), cross-entropy
    (per token for a language model's (B, T, V) logits)."""

    def __init__(self, model: nn.Module, loader: Iterable, device: torch.device, *, settings: HandSettings,
                 lr: float = 0.05, momentum: float = 0.9, weight_decay: float = 5e-4):
        self.device, self.settings, self.loader = device, settings, loader
        self.model = model.to(device)
        if settings.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        decay = [p for p in self.model.parameters() if p.ndim > 1]
        no_decay = [p for p in self.model.parameters() if p.ndim <= 1]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = {"fused": True} if settings.fused else {"foreach": False}
        self.opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=True, **fused)
        self.forward = torch.compile(self.model) if settings.compile else self.model
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[settings.precision]
        self.scaler = torch.amp.GradScaler(device.type) if settings.precision == "fp16" else None
        self.loss_sum = torch.zeros((), device=device)
        self.samples = 0
        self._it = None

    def _batches(self):
        while True:
            for x, y in self.loader:
                x = x.to(self.device, non_blocking=True)
                if self.settings.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                yield x, y.to(self.device, non_blocking=True)

    def restart(self) -> None:
        """Start the data over (the caller reloads weights and optimizer state)."""
        self._it = None
        self.loss_sum.zero_()
        self.samples = 0

    def run(self, n: int) -> float:
        """Train `n` steps; return the seconds they took (the device synced at the end)."""
        if self._it is None:
            self._it = self._batches()
        self.model.train()
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = next(self._it)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                logits = self.forward(x)  # (B, classes), or (B, T, V) for a language model: flattened
                loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
            self._backward_and_step(loss)
            self.opt.zero_grad(set_to_none=True)
            self.loss_sum += loss.detach().float() * y.shape[0]
            self.samples += y.shape[0]
        sync(self.device)
        return time.perf_counter() - t0

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()

    def train_loss(self) -> float:
        return float(self.loss_sum.item()) / max(self.samples, 1)

    @torch.no_grad()
    def evaluate(self, loader: Iterable) -> float:
        self.model.eval()
        correct = total = 0
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            if self.settings.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
                correct += int((self.model(x).argmax(-1) == y).sum())
            total += y.numel()  # per token for a language model
        return correct / max(total, 1)


def _time_candidate(make_model: Callable[[], nn.Module], loader: Iterable, device: torch.device,
                    settings: HandSettings, steps: int, warm: int) -> float:
    loop = HandLoop(make_model(), loader, device, settings=settings)
    loop.run(warm)
    seconds = loop.run(steps) / steps
    del loop
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def search_hand_settings(make_model: Callable[[], nn.Module], loader: Iterable, device: torch.device, *,
                         steps: int = 2, passes: int = 2, try_compile: bool = True,
                         progress: Callable[[str], None] | None = None) -> tuple[HandSettings, dict]:
    """Measure the eager grid, then compile on the winner; return the fastest settings and the log.

    `make_model()` must return a fresh model (on the CPU) each call; `loader` yields (x, y).
    The log maps each tried setting's label to its seconds per step (median over passes).
    """
    has_conv = any(isinstance(m, nn.Conv2d) for m in make_model().modules())
    grid = [HandSettings(p, cl, fu) for p, cl, fu in itertools.product(
        hand_precisions(device), (False, True) if has_conv else (False,), (False, True))]
    # interleaved passes (each candidate warms up inside its own measurement, on a fresh model): a slow
    # phase of the machine hits every candidate alike
    say = (lambda s, r: progress(f"hand search: {s.label()}")) if progress else None
    per_step = interleaved({s: (lambda s=s: _time_candidate(make_model, loader, device, s, steps, warm=1))
                            for s in grid}, rounds=passes, before=say).medians()
    best = min(per_step, key=per_step.get)
    if try_compile:
        compiled = HandSettings(**(asdict(best) | {"compile": True}))
        if progress:
            progress(f"hand search: {compiled.label()} (compiling)")
        per_step[compiled] = _time_candidate(make_model, loader, device, compiled, steps, warm=2)
        if per_step[compiled] < per_step[best]:
            best = compiled
    return best, {"tried": {s.label(): t for s, t in per_step.items()}, "chosen": best.label(),
                  "settings": asdict(best)}


def fresh_copies(model: nn.Module) -> Callable[[], nn.Module]:
    """A factory of independent copies of `model` (its current weights), for the search."""
    state = copy.deepcopy(model).cpu()
    return lambda: copy.deepcopy(state)
