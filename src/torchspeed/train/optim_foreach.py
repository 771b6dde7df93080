"""torch's other optimizers on their foreach kernels where those give the for-loop's numbers (T51, T13).

A script's `torch.optim.RMSprop(params, lr)` on the CPU steps on the for-loop path (`foreach` unset): six or so
kernels a parameter, each called from Python. The foreach path makes the same per-tensor calls from C++ in the
same order, so for fp32 and fp64 parameters it gives the same numbers with one Python call a kernel: on a
32-128-128-10 MLP under RMSprop (6 parameters, 2 cores) the step is about a quarter of a 0.5 ms training step on
the for-loop, and the loop's steps run several percent sooner on the foreach one.

`foreach_groups(optimizer)` names the groups to step that way: exactly one of `SAME_BITS` (RMSprop, Adagrad,
Adamax, Adadelta, Rprop: a for-loop and a foreach run of each, 25 steps on fp32 and fp64 parameters, read equal
to the last bit, tests/train/test_optim_foreach.py), the group's `foreach` unset (None; a group that names its
kernel keeps it), not fused, differentiable or capturable, its LR a number, every parameter a plain CPU tensor in
fp32 or fp64. Left out, because the two paths round otherwise: NAdam, RAdam and ASGD (1 ulp in fp32), and every
kind on bf16 or fp16 parameters. Adagrad's foreach path hands a group with a sparse gradient to the for-loop
itself. `dynamo_deferred.torch_step` sets their `foreach` for the step only and puts it back, so the optimizer's
`param_groups` and `state_dict` stay the user's.

Example:
    >>> groups = foreach_groups(torch.optim.RMSprop(model.parameters(), lr=1e-3))   # [the one group]
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["SAME_BITS", "foreach_groups"]

SAME_BITS = (torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax, torch.optim.Adadelta, torch.optim.Rprop)
_DTYPES = (torch.float32, torch.float64)
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> {id(params): (params, n, dtype, ok)}


def _plain_cpu(params: list) -> bool:
    return bool(params) and all(type(p) is torch.Tensor or type(p) is torch.nn.Parameter for p in params) and all(
        p.device.type == "cpu" and p.dtype in _DTYPES for p in params)


def foreach_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's groups whose step may run torch's foreach kernels for its for-loop (see the module
    docstring); [] for any other optimizer. The parameters' check is made once per parameter list (again where it
    grows or its first parameter's dtype changes: a model cast in place)."""
    if type(optimizer) not in SAME_BITS:
        return []
    seen = _checked.get(optimizer)
    if seen is None:
        seen = _checked[optimizer] = {}
    out = []
    for group in optimizer.param_groups:
        if group.get("foreach") is not None or group.get("fused") or group.get("differentiable") or \
                group.get("capturable") or torch.is_tensor(group.get("lr")):
            continue
        params = group["params"]
        kept = seen.get(id(params))
        if kept is None or kept[0] is not params or kept[1] != len(params) or (params and kept[2] != params[0].dtype):
            kept = seen[id(params)] = (params, len(params), params[0].dtype if params else None, _plain_cpu(params))
        if kept[3]:
            out.append(group)
    return out
