"""One home for the optimizers the tuners and the recipe's trials measure with (T18, T26, T42, T14's alternative).

A tuner (the batch finder, the LR range test and its one-cycle trial, the recipe's batch part, the optimizer trial)
measures with an optimizer that is not the run's: the run's own object where the user gave one (the tuners put
back what they touch), else a fresh one built from a name. A fresh one is built from the user's row: the
momentum, betas and weight decay `fit` was given (`optimizer_options`), so that what a candidate is measured with
is what the run would train with; `create_optimizer` hands each optimizer the options it takes (SGD's momentum,
AdamW's betas) and leaves the rest.

Example:
    >>> opt = candidate_optimizer("sgd", model, lr=1e-6, weight_decay=None, options={"momentum": 0.8})
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from torchspeed.train.optim import create_optimizer

__all__ = ["candidate_optimizer"]


def candidate_optimizer(optimizer: str | torch.optim.Optimizer, model: nn.Module, *, lr: float,
                        name: str | None = None, weight_decay: float | None = None,
                        options: Mapping | None = None) -> torch.optim.Optimizer:
    """The run's optimizer object as it is; else a fresh `name` (default: `optimizer`, a name) over `model` at `lr`,
    with the user's `options` (momentum, nesterov, betas) and `weight_decay` (None: the optimizer's default)."""
    if not isinstance(optimizer, str):
        return optimizer
    return create_optimizer(name or optimizer, model, lr=lr, weight_decay=weight_decay, **dict(options or {}))
