"""The objects the doctor takes from the running script (T02): the model whose forward the script
called, its optimizer, a training batch, the loss module and target, the DataLoaders. The model
checks, the dataset timing and `--verify` work on these after the script stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["Captured", "capture"]


@dataclass
class Captured:
    """Objects taken from the running script for the model checks and `--verify`."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    args: tuple | None = None
    kwargs: dict = field(default_factory=dict)
    loss_module: nn.Module | None = None
    target: object = None
    loaders: list = field(default_factory=list)
    set_to_none: bool = True
    unused_ids: set = field(default_factory=set)   # params in the optimizer without a gradient at a step
    grad_ids: set = field(default_factory=set)     # params that had a gradient at that step
    called: set = field(default_factory=set)       # ids of the modules whose forward ran
    model_info: dict | None = None


def capture(probe) -> Captured:
    """Pick the model (the module with the most optimizer parameters that trained) and what it ran on."""
    cap = Captured()
    opt = probe.step_opt
    cap.optimizer = opt
    opt_ids = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else set()
    best, best_score = None, (-1, -1)
    for mid, mod in probe.module_objs.items():
        params = list(mod.parameters())
        score = (sum(1 for p in params if id(p) in opt_ids), sum(p.numel() for p in params))
        if probe.modules[mid]["train_calls"] == 0:
            score = (score[0] - 10**9, score[1])
        if score > best_score:
            best, best_score = mid, score
    if best is not None:
        cap.model = probe.module_objs[best]
        info = probe.modules[best]
        cap.args = info["args"]
        cap.kwargs = info.get("kwargs") or {}
        cap.model_info = info
    cap.loss_module, cap.target = probe.loss_module, probe.loss_target
    cap.loaders = list(probe.loaders.values())
    cap.set_to_none = probe.zero_grads["set_to_none_false"] == 0
    cap.unused_ids = set(probe.unused_ids)
    cap.grad_ids = set(probe.grad_ids)
    cap.called = probe.called
    return cap
