"""Freeze BatchNorm when fine-tuning (T34).

With small fine-tuning batches, BatchNorm's batch statistics are noisy and its running
statistics drift away from the ones the pretrained weights expect. Freezing keeps every
BatchNorm in eval mode (running statistics used and not updated) even after
`model.train()`, and by default also stops training its affine weight and bias.

Cost: none at run time (eval-mode BatchNorm is slightly cheaper); it is wrong for training
from scratch, where the statistics must be learned.

Example:
    >>> frozen = freeze_batchnorm(model)          # names of the frozen layers
    >>> model.train()                              # BatchNorm stays in eval mode
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["freeze_batchnorm"]


def _keep_eval(module: nn.Module, args) -> None:
    module.training = False  # model.train() sets it back; this runs before every forward


def freeze_batchnorm(model: nn.Module, *, affine: bool = True) -> list[str]:
    """Keep every BatchNorm's statistics fixed (and its affine weights when `affine`)."""
    frozen = []
    for name, m in model.named_modules():
        if not isinstance(m, _BatchNorm) or getattr(m, "_torchspeed_frozen", False):
            continue
        m.eval()
        m.register_forward_pre_hook(_keep_eval)
        if affine:
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
        m._torchspeed_frozen = True
        frozen.append(name)
    return frozen
