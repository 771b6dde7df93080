"""Which kernel an optimizer steps with, and how its gradients are cleared (T18, T26).

- `_fused_or_foreach`: torch's fused kernel (one kernel for all parameters) where asked or where the device has
  one (CPU, CUDA), else the foreach (multi-tensor) path; no fused kernel for FSDP2's DTensor shards where the
  optimizer's row says so (T18). optim.py's `create_optimizer` and `MuonAdamW` build through it.
- `zero_grad(optimizer)` sets gradients to None (T26): no memset kernel per parameter, backward writes them.
"""

from __future__ import annotations

import inspect

import torch

from torchspeed.train.loop.lean_step import lean_step_for, steps_with_torch
from torchspeed.train.trial.dynamo_deferred import torch_zero_grad

__all__ = ["zero_grad"]


def _supports(cls: type, kw: str) -> bool:
    return kw in inspect.signature(cls.__init__).parameters


def _is_sharded(params) -> bool:
    return any(type(p).__name__ == "DTensor" for g in params for p in g["params"])


def _device_of(params) -> torch.device:
    for g in params:
        for p in g["params"]:
            return p.device
    return torch.device("cpu")


def _fused_or_foreach(cls: type, groups: list[dict], kwargs: dict, fused: bool | str, *,
                      shards: bool = True) -> torch.optim.Optimizer:
    """torch's fused kernel where asked (`fused=True`) or where the device has one (`"auto"`: CPU, CUDA), else
    the foreach (multi-tensor) path; `shards=False`: no fused kernel for FSDP2's DTensor shards."""
    if fused == "default":
        return cls(groups, **kwargs)  # torch's own choice, as a script's `cls(params, lr=...)` makes
    want_fused = fused is True or (fused == "auto" and _device_of(groups).type in ("cpu", "cuda"))
    if not shards and fused == "auto" and _is_sharded(groups):
        want_fused = False
    if want_fused and _supports(cls, "fused"):
        try:
            return cls(groups, fused=True, **kwargs)
        except (RuntimeError, ValueError):  # e.g. a device or dtype without a fused kernel
            if fused is True:
                raise
    return cls(groups, foreach=fused is not False, **kwargs)


def zero_grad(optimizer: torch.optim.Optimizer, *, set_to_none: bool = True) -> None:
    """Clear gradients; `set_to_none=True` (T26) frees them instead of writing zeros (for a fused Adam/AdamW/SGD
    on the CPU, on the lists `LeanStep` keeps: no per-step walk of the groups; for torch's other optimizers, what
    their `zero_grad(set_to_none=True)` does without its profiler wrapper: 35 -> 5 us a step on SparseAdam)."""
    if set_to_none:
        lean = lean_step_for(optimizer)
        if lean is not None and lean.clear_grads():
            return
        if lean is None and _bare_zero_grad(optimizer):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
    torch_zero_grad(optimizer, set_to_none=set_to_none)  # its first call without importing torch._dynamo


def _bare_zero_grad(optimizer: torch.optim.Optimizer) -> bool:
    """torch's own `zero_grad` (not the class's nor the instance's), no profiler recording, and the run did not ask
    for torch's own calls (`lean_step.step_with_torch`: the naive loop)."""
    return type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad and "zero_grad" not in optimizer.__dict__ \
        and not getattr(torch.autograd.profiler, "_is_profiler_enabled", False) and not steps_with_torch(optimizer)
