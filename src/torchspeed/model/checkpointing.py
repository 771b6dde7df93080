"""Activation checkpointing of sequential blocks (T29).

Backward needs the activations that forward computed. A checkpointed block stores only its
input and recomputes its activations during backward, so activation memory falls to about
one block's worth plus the block inputs, and a larger batch fits. Gradients are the same
(dropout sees the same random numbers: the RNG state is saved and restored).

Cost: one extra forward of each checkpointed block per step (about +30% step time). Use it
to raise the batch, not for speed at a fixed batch. BatchNorm inside a checkpointed block
updates its running statistics twice per step (its momentum effectively doubles).

Example:
    >>> names = apply_activation_checkpointing(model)            # children of nn.Sequential blocks
    >>> names = apply_activation_checkpointing(model, block_types=(MyBlock,))
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CheckpointWrapper", "apply_activation_checkpointing"]


class CheckpointWrapper(nn.Module):
    """Runs `module` under `torch.utils.checkpoint` in training mode (plainly otherwise)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.module, *args, use_reentrant=False, **kwargs)
        return self.module(*args, **kwargs)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def apply_activation_checkpointing(model: nn.Module, *, block_types: tuple[type, ...] | None = None,
                                   min_blocks: int = 2) -> list[str]:
    """Wrap blocks in `CheckpointWrapper`, in place; return the wrapped names.

    With `block_types`, every (outermost) module of those types is wrapped. Otherwise the
    blocks are the children with parameters of each `nn.Sequential` holding at least
    `min_blocks` such children (a ResNet stage, a transformer's layer list, an MLP's layers).
    """
    wrapped: list[str] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            qual = f"{prefix}{name}"
            if isinstance(child, CheckpointWrapper):
                continue
            if block_types is not None:
                if isinstance(child, block_types):
                    parent._modules[name] = CheckpointWrapper(child)
                    wrapped.append(qual)
                    continue
            elif isinstance(child, nn.Sequential):
                blocks = [n for n, m in child.named_children() if _has_params(m)]
                if len(blocks) >= min_blocks:
                    for n in blocks:
                        child._modules[n] = CheckpointWrapper(child._modules[n])
                        wrapped.append(f"{qual}.{n}")
                    continue
            visit(child, qual + ".")

    if block_types is None and isinstance(model, nn.Sequential):
        blocks = [n for n, m in model.named_children() if _has_params(m)]
        if len(blocks) >= min_blocks:
            for n in blocks:
                model._modules[n] = CheckpointWrapper(model._modules[n])
                wrapped.append(n)
            return wrapped
    visit(model, "")
    return wrapped
