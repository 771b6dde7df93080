"""The optimizer step with loss scaling, accumulation and clipping (T19, T20, T21).

The order matters and is easy to get wrong in a hand-written loop:

1. `backward(loss, scaler=..., accum_steps=k)` divides the loss by k (so k micro-batches add
   up to the gradient of one batch k times larger, T19) and scales it for fp16. A window the
   epoch's end cuts short (10 batches, k=4: windows of 4, 4 and 2) divides by the micro-batches
   it holds and steps at the epoch's end, as Accelerate and Lightning do: an epoch takes
   ceil(batches / k) optimizer steps, the count the LR schedule is sized for (`AccumulationWindow`).
2. `optimizer_step(...)` unscales the gradients once (`scaler.unscale_`), *then* runs your code that reads or
   changes them (`before_step`: a callback's `on_before_optimizer_step`), *then* clips their norm, or each value
   (T20; clipping scaled gradients would clip at the wrong threshold; both given: the values, then the norm), then
   `scaler.step` skips the update if any gradient overflowed, and `scaler.update` adjusts
   the scale. The skip is returned as a device tensor: counting skipped steps costs no
   host sync.
3. An optimizer whose `step` needs a closure (`torch.optim.LBFGS`: it evaluates the loss again
   at the points of its line search; an optimizer of the script's own whose `step` takes one, such as SAM,
   which climbs to a nearby point and needs the gradient there) gets `closure_for(...)`: its first call
   returns the loss and gradients already computed on this batch while the weights are as they were, and
   otherwise runs forward and backward on the same batch again. Clipping applies to the first gradient.

Example:
    >>> backward(loss, scaler=scaler, accum_steps=4)   # the epoch's last window: the micro-batches it holds
    >>> if (i + 1) % 4 == 0 or i + 1 == len(loader):
    ...     skipped += optimizer_step(opt, scaler=scaler, clip_grad_norm=1.0, parameters=model.parameters())
    ...     opt.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterable

import torch

from torchspeed.env import sync
from torchspeed.train.trial.dynamo_deferred import torch_step
from torchspeed.train.loop.lean_step import lean_step_for

__all__ = ["backward", "optimizer_step", "AccumulationWindow", "needs_closure", "closure_for", "OptimizerClock"]


_NO_CONTEXT = contextlib.nullcontext()  # reusable: the window's context when there is nothing to skip
_NOT_SKIPPED = torch.zeros((), dtype=torch.int64)  # read-only: optimizer_step's "not skipped" (no tensor made per step)
STEP_CLOCK = "_torchspeed_step_clock"  # an optimizer attribute: an object whose start()/stop() time its steps (the
# switch trial's optimizer-kernel stage); step hooks would take the lean step and torch._dynamo's deferral away


class AccumulationWindow:
    """The gradient-accumulation window (T19, with T31): `k` micro-batches make one optimizer step.

    On every micro-batch but the last, DDP's gradient all-reduce is skipped (`sync(model)` is its
    `no_sync()`); the loss is divided by the window's `size` in `backward`; `advance()` says when the last one
    has run, so the caller steps the optimizer. nanoGPT's loop in one object.

    `left`: the micro-batches left before the epoch ends, counting the next one (None: no end known, a stream
    without len(), or one not to close at: a BatchRamp's epochs but its last); the trainer sets it before each
    micro-batch of an epoch. A window the end cuts short holds only those (`size` < k): its last micro-batch
    all-reduces, its losses are divided by its own size (the mean over the micro-batches it holds), and it closes
    there, so no window reaches over an epoch's end.

    Example:
        >>> win = AccumulationWindow(4)
        >>> win.left = len(loader) - i              # optional: the epoch's end closes a partial window
        >>> with win.sync(ddp_model):
        ...     backward(loss, accum_steps=win.size)
        >>> if win.advance():
        ...     optimizer_step(opt)
    """

    def __init__(self, k: int = 1):
        if k < 1:
            raise ValueError(f"grad_accum must be >= 1, got {k}")
        self.k, self.micro = k, 0
        self.left: int | None = None

    @property
    def size(self) -> int:
        """The micro-batches the open window holds when it closes: k, or fewer where the epoch ends first."""
        if self.left is None or self.left < 1:  # (a loader that gives more batches than its len(): k)
            return self.k
        return min(self.k, self.micro + self.left)

    @property
    def last(self) -> bool:
        """The next micro-batch closes the window (its backward all-reduces; then the step)."""
        return self.micro + 1 >= self.size

    @property
    def at_boundary(self) -> bool:
        """No micro-batch of an open window has run (a safe point to checkpoint or stop)."""
        return self.micro == 0

    def sync(self, model):
        """DDP's `no_sync()` on all but the last micro-batch; nothing to do otherwise."""
        if self.k == 1:  # every micro-batch closes its window: nothing to skip
            return _NO_CONTEXT
        return model.no_sync() if not self.last and hasattr(model, "no_sync") else _NO_CONTEXT

    def advance(self) -> bool:
        """Count a micro-batch; True when it closed the window (time for the optimizer step)."""
        size, self.micro = self.size, self.micro + 1
        if self.micro >= size:
            self.micro, self.left = 0, None  # the next window's end is the caller's to say again
            return True
        if self.left is not None:
            self.left -= 1
        return False

    def reset(self) -> None:
        """Drop a partial window (after a failed step); `left` stays (the failed micro-batch was not counted)."""
        self.micro = 0


def backward(loss: torch.Tensor, *, scaler: torch.amp.GradScaler | None = None, accum_steps: int = 1) -> None:
    """Backward of `loss / accum_steps`, scaled for fp16 when a scaler is given. A graph already backed through
    is named with its two usual causes in a ported loop and their fixes (torch's own words suggest retain_graph)."""
    if accum_steps > 1:
        loss = loss / accum_steps
    try:
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
    except RuntimeError as e:
        if "backward through the graph a second time" not in str(e):
            raise
        raise RuntimeError(f"{e}\n{SECOND_BACKWARD}") from e


SECOND_BACKWARD = (
    "torchspeed: fit runs the backward of the loss your step returns, once a step, then the optimizer step. This "
    "graph was backed through already. Usually: (1) your step_fn called loss.backward() (or torch.autograd.grad) "
    "itself: return the loss instead, and fit backs and steps it (a step that trains another model inside, a GAN's "
    "discriminator, backs and steps that one's own loss and returns only the loss fit trains); or (2) a tensor "
    "carried from an earlier step is still attached to that step's graph, a recurrent hidden state most often: "
    "detach it each batch (hidden = hidden.detach(), as PyTorch's word_language_model example's repackage_hidden "
    "does).")


_STEP_ON_GRADS = ("torch", "torchspeed", "schedulefree", "timm")  # their optimizers step on the gradients they have


@functools.lru_cache(maxsize=64)
def _step_needs_closure(kind: type) -> bool:
    try:
        param = inspect.signature(kind.step).parameters.get("closure")
    except (TypeError, ValueError):  # a step with no signature to read: called as optimizers are, with none
        return False
    if param is None:
        return False
    # torch's optimizers, and those torchspeed builds (Schedule-Free's, timm's, its own Muon), take an optional closure
    # and step on the gradients they have; one of the script's own that takes a closure may need it (SAM asserts it
    # is given: its second gradient is the closure's), and one that only evaluates it gets the computed loss back
    home = getattr(inspect.unwrap(kind.step), "__module__", None) or ""  # where the step is written (torch wraps it)
    return param.default is inspect.Parameter.empty or home.split(".")[0] not in _STEP_ON_GRADS


def needs_closure(optimizer) -> bool:
    """Whether `optimizer.step` must be given a closure: its `closure` parameter has no default (LBFGS), or the
    optimizer is not torch's and its `step` takes one (SAM's two-pass step)."""
    return _step_needs_closure(type(optimizer))


def closure_for(optimizer, loss: torch.Tensor, recompute: Callable[[], torch.Tensor]) -> Callable | None:
    """None for an optimizer that steps on the gradients it has; for one that needs a closure, a closure whose first
    call returns `loss` (its gradients are in place) while the weights are those it was computed at (no parameter
    written since: their version counters), and otherwise zeroes the gradients and returns `recompute()` (forward
    and backward on the same batch, detached): LBFGS's first call is at the same weights, SAM's after its ascent."""
    if not needs_closure(optimizer):
        return None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    versions, first = [p._version for p in params], [True]

    def closure() -> torch.Tensor:
        if first[0]:
            first[0] = False
            if [p._version for p in params] == versions:
                return loss
        optimizer.zero_grad(set_to_none=True)
        return recompute().detach()

    return closure


def optimizer_step(optimizer: torch.optim.Optimizer, *, scaler: torch.amp.GradScaler | None = None,
                   clip_grad_norm: float | None = None, parameters: Iterable[torch.Tensor] | None = None,
                   closure: Callable | None = None, clip_grad_value: float | None = None,
                   before_step: Callable[[], object] | None = None) -> torch.Tensor:
    """Unscale, your `before_step()`, clip, step, update. Returns a 0-d tensor: 1 if the step was skipped, else 0.
    `closure`: for an optimizer that needs one (`closure_for`). Clipping covers `parameters` (default: the
    optimizer's)."""
    if clip_grad_norm is not None or clip_grad_value is not None or before_step is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)  # once, before your code and clipping: they see the true gradient
        if before_step is not None:
            before_step()
        if clip_grad_norm is not None or clip_grad_value is not None:
            params = list(parameters) if parameters is not None else [
                p for g in optimizer.param_groups for p in g["params"]]
            if clip_grad_value is not None:
                torch.nn.utils.clip_grad_value_(params, clip_grad_value)
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    clock = optimizer.__dict__.get(STEP_CLOCK)
    if clock is not None:
        clock.start()
    if scaler is None:
        if closure is not None:
            optimizer.step(closure)
        elif (lean := lean_step_for(optimizer)) is None or not lean.step():  # T51: the fused kernels, no wrapper
            torch_step(optimizer)  # torch's step (its first without importing torch._dynamo)
            if lean is not None:
                lean.prepare()  # the first step made the state: the lists now, their one-off cost in this step
        if clock is not None:
            clock.stop()
        return _NOT_SKIPPED
    scale = getattr(scaler, "_scale", None)
    before = scale.clone() if isinstance(scale, torch.Tensor) else scaler.get_scale()
    scaler.step(optimizer) if closure is None else scaler.step(optimizer, closure=closure)  # (torch refuses it)
    if clock is not None:
        clock.stop()
    scaler.update()
    after = getattr(scaler, "_scale", None)
    if isinstance(after, torch.Tensor) and isinstance(before, torch.Tensor):
        return (after < before).to(torch.int64)  # the scale backs off exactly when the step was skipped
    return torch.tensor(int(scaler.get_scale() < before))


class OptimizerClock:
    """Seconds spent in the optimizer's step while attached (`step.optimizer_step` times it: the lean step or
    torch's, as the run will step; synced on a GPU). None when no step ran (a micro-batch inside an accumulation
    window). Not step hooks: with them the lean step stands aside and torch's step imports torch._dynamo."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.device, self.seconds, self._t0, self._optimizer = device, None, 0.0, optimizer
        optimizer.__dict__[STEP_CLOCK] = self

    def start(self) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        sync(self.device)
        self.seconds = (self.seconds or 0.0) + time.perf_counter() - self._t0

    def remove(self) -> None:
        self._optimizer.__dict__.pop(STEP_CLOCK, None)
