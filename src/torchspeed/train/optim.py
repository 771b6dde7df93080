"""Optimizers by name, with fused kernels, and the cheap zero_grad (T18, T26).

- `create_optimizer("sgd" | "adamw" | "lamb" | "lars", model, lr=...)`: SGD with Nesterov
  momentum, AdamW (decoupled weight decay), and timm's LAMB and LARS for large batches
  (timm's implementations are maintained and tested; we do not rewrite them). Bias and
  normalisation parameters get no weight decay (timm's `param_groups_weight_decay`).
- `fused="auto"` asks torch for its fused kernel (one kernel for all parameters) where the
  optimizer and device have one (SGD/Adam/AdamW on CPU and CUDA), else the foreach
  (multi-tensor) path. Fused SGD measured about +8% step throughput on a 2-core CPU.
- `zero_grad(optimizer)` sets gradients to None (T26): no memset kernel per parameter, and
  backward writes the gradient instead of adding into zeros.

Example:
    >>> opt = create_optimizer("sgd", model, lr=0.1, momentum=0.9, weight_decay=5e-4)
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

__all__ = ["OPTIMIZERS", "create_optimizer", "zero_grad", "param_groups", "describe_optimizer"]

OPTIMIZERS = ("sgd", "adamw", "lamb", "lars")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weights with decay, biases and 1-D (norm) parameters without."""
    from timm.optim import param_groups_weight_decay

    if weight_decay == 0:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    return param_groups_weight_decay(model, weight_decay=weight_decay)


def _supports(cls: type, kw: str) -> bool:
    return kw in inspect.signature(cls.__init__).parameters


def _is_sharded(params) -> bool:
    return any(type(p).__name__ == "DTensor" for g in params for p in g["params"])


def _device_of(params) -> torch.device:
    for g in params:
        for p in g["params"]:
            return p.device
    return torch.device("cpu")


def create_optimizer(name: str, model: nn.Module, *, lr: float, weight_decay: float = 0.0,
                     momentum: float = 0.9, nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                     fused: bool | str = "auto") -> torch.optim.Optimizer:
    """Build optimizer `name` over `model`'s trainable parameters."""
    key = name.lower()
    groups = param_groups(model, weight_decay)
    if key in ("sgd", "adamw"):
        cls = torch.optim.SGD if key == "sgd" else torch.optim.AdamW
        kwargs: dict = {"lr": lr, "weight_decay": weight_decay}
        if key == "sgd":
            kwargs.update(momentum=momentum, nesterov=nesterov and momentum > 0)
        else:
            kwargs.update(betas=betas)
        dev = _device_of(groups)
        want_fused = fused is True or (fused == "auto" and dev.type in ("cpu", "cuda"))
        if key == "sgd" and fused == "auto" and _is_sharded(groups):
            want_fused = False  # FSDP2's DTensor shards have no fused-SGD kernel (AdamW's works)
        if want_fused and _supports(cls, "fused"):
            try:
                return cls(groups, fused=True, **kwargs)
            except (RuntimeError, ValueError) as e:  # e.g. a device or dtype without a fused kernel
                if fused is True:
                    raise
                del e
        return cls(groups, foreach=fused is not False, **kwargs)
    if key == "lamb":
        from timm.optim import Lamb

        return Lamb(groups, lr=lr, weight_decay=weight_decay, betas=betas)
    if key == "lars":
        from timm.optim import Lars

        return Lars(groups, lr=lr, weight_decay=weight_decay, momentum=momentum)
    raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}; or pass a torch.optim.Optimizer")


def zero_grad(optimizer: torch.optim.Optimizer, *, set_to_none: bool = True) -> None:
    """Clear gradients; `set_to_none=True` (T26) frees them instead of writing zeros."""
    optimizer.zero_grad(set_to_none=set_to_none)


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    """e.g. "SGD (fused)": the optimizer class and its kernel (fused, foreach or for-loop)."""
    d = opt.defaults
    kind = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"
    return f"{type(opt).__name__} ({kind})"
