"""torch's optimizers without importing torch._dynamo where nothing compiles (T42: the cost before the first step).

`torch.optim.Optimizer`'s `add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` are wrapped in
`torch._disable_dynamo`, which imports `torch._dynamo` on their first call, and `step` imports it on every call
(`_use_grad_for_differentiable`, for its graph breaks). The import is torch's compiler stack (sympy and the
rest): 1.3-2.0 s on 2 CPU cores, as long as `import torch` itself, paid by the first optimizer a process makes.
On a small model that is as long as the training: a script's `time python train.py` pays it, and `fit` need not.

While `torch._dynamo` is not imported nothing can be compiling, so dynamo's `disable` has nothing to disable:

- `deferred_dynamo()`: inside it, those four methods run as themselves (each one's `__dynamo_disable`, the
  wrapped function torch caches on its first call, set to the function); on exit they are as torch left them,
  so a later call outside imports `torch._dynamo` as it always would;
- `torch_step(optimizer)`: torch's own `step` for one of torch.optim's optimizers with nothing around it (no
  hooks, not differentiable, no profiler recording: `bare_step` reads the layers), called as
  `_use_grad_for_differentiable` (or `torch.no_grad`) calls it, grad off, without its graph breaks, its import
  or the hooks' and profiler's wrapper (timed by phase on a tiny embedding model under SparseAdam, 2-core EPYC: the
  step 20-25 us a step cheaper, and `optim_kernel.zero_grad`'s own bare path 35 -> 5 us; for such optimizers,
  whose steps no fused kernel takes, that is what `fit` can win back). The update is torch's, bit for bit
  (tests/train/test_dynamo_deferred.py); `TrainConfig(lean_step=False)` (the naive loop) keeps torch's `step()`.

Their users: the Trainer's optimizer build, `step.optimizer_step`, `zero_grad` (the run's, and the switch trial's
turns timed apart), the checkpoints' `stateful.collect_state`/`restore_state`; the trial's optimizer-kernel stage
times the step through `step.STEP_CLOCK`, not step hooks (with hooks the step would be torch's, and import it).
Where `torch._dynamo` is already imported (a script that compiled, or made an optimizer first) `zero_grad` is
torch's own call. `torch.compile` and `compile="auto"` import it when they run, as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator

import torch

from torchspeed.train.lean_schedulefree import plain_step
from torchspeed.train.optim_foreach import foreach_groups
from torchspeed.train.loop.lean_step import steps_with_torch

__all__ = ["bare_step", "deferred_dynamo", "dynamo_imported", "torch_step", "torch_zero_grad"]

_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_KEY = "__dynamo_disable"  # the attribute torch._disable_dynamo caches the disabled function in


def dynamo_imported() -> bool:
    return "torch._dynamo" in sys.modules


def _raw(fn):
    return getattr(fn, "__wrapped__", None)


@contextlib.contextmanager
def deferred_dynamo() -> Iterator[None]:
    """Optimizer construction, `zero_grad`, `state_dict` and `load_state_dict` without importing torch._dynamo
    while it is not imported (see the module docstring)."""
    if dynamo_imported():
        yield
        return
    made = []
    for name in _METHODS:
        fn = _raw(getattr(torch.optim.Optimizer, name, None))
        if fn is not None and getattr(fn, _KEY, None) is None:
            setattr(fn, _KEY, fn)
            made.append(fn)
    try:
        yield
    finally:
        for fn in made:
            if getattr(fn, _KEY, None) is fn:
                delattr(fn, _KEY)


def torch_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`; for one of torch's own optimizers with nothing around its step (`bare_step`) the same
    step without torch's per-step wrapper (on the foreach kernels where they give the for-loop's numbers:
    `optim_foreach`)."""
    raw = bare_step(type(optimizer))
    if raw is None or not _nothing_around(optimizer):
        optimizer.step()
        return
    if "step" in optimizer.__dict__:
        optimizer._opt_called = True  # what an LR scheduler's wrapper records (its step-order warning)
    groups = foreach_groups(optimizer)  # RMSprop and the like: the foreach kernels, the for-loop's numbers
    for group in groups:
        group["foreach"] = True
    try:
        with torch.no_grad():
            raw(optimizer)
    finally:
        for group in groups:
            group["foreach"] = None


def _nothing_around(optimizer: torch.optim.Optimizer) -> bool:
    """No hook, no replaced step, no scaler flags (`plain_step`), not differentiable, no profiler recording (its
    trace names the step), and the run did not ask for torch's own step (`lean_step.step_with_torch`)."""
    return not steps_with_torch(optimizer) and plain_step(optimizer) and \
        not getattr(torch.autograd.profiler, "_is_profiler_enabled", False) and \
        not any(g.get("differentiable") for g in optimizer.param_groups)


def bare_step(kind: type) -> Callable | None:
    """The function inside `kind.step` where the layers around it are exactly torch's own (the step hooks' and
    profiler's wrapper, then `_use_grad_for_differentiable` or `torch.no_grad`, and dynamo's `disable`, which torch
    puts around some optimizers' steps once something compiled) and it is torch.optim's own code;
    else None (a subclass's step, a wrapper of the user's or a library's: `step()` runs as it is)."""
    return _bare(getattr(kind, "step", None))  # read once per step function (a class's step replaced: anew)


@functools.lru_cache(maxsize=64)
def _bare(fn) -> Callable | None:
    layers = []
    while fn is not None and hasattr(fn, "__code__"):
        layers.append(fn)
        fn = _raw(fn)
    if len(layers) < 3 or layers[0].__code__ is not _TORCH_LAYERS["hooks"]:
        return None
    inner, middle = layers[-1], layers[1:-1]
    grad = [f for f in middle if f.__code__ is _TORCH_LAYERS["use_grad"] or (
        f.__code__ is _TORCH_LAYERS["no_grad"] and _no_grad_factory(f))]
    rest = [f for f in middle if f not in grad]  # dynamo's `disable` (once something compiled): nothing eager
    torch_optim = os.path.dirname(torch.optim.__file__) + os.sep
    ok = len(grad) == 1 and inner.__code__.co_filename.startswith(torch_optim) and all(
        f.__code__.co_name == "_fn" and f.__code__.co_filename.endswith(_DYNAMO_DISABLE) for f in rest)
    return inner if ok else None


_DYNAMO_DISABLE = os.path.join("torch", "_dynamo", "eval_frame.py")


def _torch_layers() -> dict:
    """The code objects of torch's own wrappers around an optimizer's step, made by wrapping a function."""
    def f(*_):
        return None
    from torch.optim.optimizer import _use_grad_for_differentiable
    return {"hooks": torch.optim.Optimizer.profile_hook_step(f).__code__,
            "use_grad": _use_grad_for_differentiable(f).__code__, "no_grad": torch.no_grad()(f).__code__}


_TORCH_LAYERS = _torch_layers()


def _no_grad_factory(fn) -> bool:
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    factory = cells["ctx_factory"].cell_contents if "ctx_factory" in cells else None
    return isinstance(getattr(factory, "__self__", None), torch.no_grad)


def torch_zero_grad(optimizer: torch.optim.Optimizer, *, set_to_none: bool = True) -> None:
    """`optimizer.zero_grad(set_to_none)`, its first call without importing torch._dynamo (`deferred_dynamo`)."""
    with deferred_dynamo():
        optimizer.zero_grad(set_to_none=set_to_none)
