"""channels_last memory format (T23).

Convolutions on NHWC tensors map onto the fast kernels of oneDNN (CPU) and cuDNN Tensor
Cores (GPU); with bf16/fp16 the gain is largest. `apply_channels_last` converts a model's
4D parameters and buffers in place; inputs are converted with `to_channels_last` so the
first convolution does not convert them back.

Cost: none for conv nets; a model without 2D convolutions is left alone.

Example:
    >>> model = apply_channels_last(model)
    >>> out = model(to_channels_last(images))
"""

from __future__ import annotations

import torch
from torch import nn

from torchspeed.train.loop.lean_step import forget_lists

__all__ = ["has_conv2d", "has_conv", "apply_channels_last", "to_channels_last", "is_channels_last",
           "state_follows_layout"]


def has_conv2d(model: nn.Module) -> bool:
    """True when the model holds at least one 2D convolution."""
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in model.modules())


def has_conv(model: nn.Module) -> bool:
    """True when the model holds a convolution of any dimension (1D, 2D or 3D, transposed or not)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def apply_channels_last(model: nn.Module, channels_last: bool = True) -> nn.Module:
    """Convert the model's 4D weights and buffers (and their gradients) to channels_last in place (`channels_last`
    False: back to the contiguous layout); return the model. 4D tensors only: `model.to(memory_format=...)` also
    takes 5D ones, which channels_last refuses (timm's lambda_resnet26t: "required rank 4 tensor to use
    channels_last format")."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.dim() == 4 and not t.is_contiguous(memory_format=fmt):
                t.data = t.data.contiguous(memory_format=fmt)
                if t.grad is not None:
                    t.grad = t.grad.contiguous(memory_format=fmt)
    return model


def to_channels_last(x):
    """Return a 4D tensor in channels_last layout (anything else unchanged)."""
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x


def is_channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last)


def state_follows_layout(optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state (momentum, Adam moments) in the memory layout of its parameter, after a layout change; the
    optimizer's lean step (`lean_step.LeanStep`, `LeanScheduleFree`) reads the new tensors before its next update."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st or p.dim() != 4:
                continue
            fmt = torch.channels_last if (p.is_contiguous(memory_format=torch.channels_last)
                                          and not p.is_contiguous()) else torch.contiguous_format
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    st[k] = v.contiguous(memory_format=fmt)
    forget_lists(optimizer)  # the lean step's kept lists held the tensors just replaced
