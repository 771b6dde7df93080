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
- `torch_step(optimizer)`: torch's own `step` for exactly Adam, AdamW or SGD with nothing around it (no hooks,
  not differentiable: `LeanStep`'s conditions), called as `_use_grad_for_differentiable` calls it (grad off)
  without its graph breaks. The update is torch's, bit for bit (tests/train/test_dynamo_deferred.py).

Their users: the Trainer's optimizer build, `step.optimizer_step`, `zero_grad` (the run's, and the switch trial's
turns timed apart), the checkpoints' `stateful.collect_state`/`restore_state`; the trial's optimizer-kernel stage
times the step through `step.STEP_CLOCK`, not step hooks (with hooks the step would be torch's, and import it).
Where `torch._dynamo` is already imported (a script that compiled, or made an optimizer first) both are
torch's own calls. `torch.compile` and `compile="auto"` import it when they run, as before.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

__all__ = ["deferred_dynamo", "dynamo_imported", "torch_step", "torch_zero_grad"]

_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_KINDS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # torch's own step: `LeanStep`'s kinds
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


def torch_step(optimizer: torch.optim.Optimizer, lean=None) -> None:
    """`optimizer.step()`; for torch's Adam/AdamW/SGD with nothing around the step (`lean`: its `LeanStep`, which
    says so) and torch._dynamo not imported, the same step without the import."""
    raw = type(optimizer).step
    while _raw(raw) is not None:
        raw = _raw(raw)
    plain = (type(optimizer) in _KINDS and lean is not None and lean._plain() and not dynamo_imported()
             and not any(g.get("differentiable") for g in optimizer.param_groups) and raw is not type(optimizer).step)
    if not plain:
        optimizer.step()
        return
    if "step" in optimizer.__dict__:
        optimizer._opt_called = True  # what an LR scheduler's wrapper records (its step-order warning)
    with torch.no_grad():
        raw(optimizer)


def torch_zero_grad(optimizer: torch.optim.Optimizer, *, set_to_none: bool = True) -> None:
    """`optimizer.zero_grad(set_to_none)`, its first call without importing torch._dynamo (`deferred_dynamo`)."""
    with deferred_dynamo():
        optimizer.zero_grad(set_to_none=set_to_none)
