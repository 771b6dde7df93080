"""Pad hidden sizes to multiples of 8 (T24), exactly.

Tensor Cores (fp16/bf16 on NVIDIA GPUs) run matrix products fastest when the dimensions are
multiples of 8 (64 on A100 and later); a hidden size of 100 leaves them partly idle.
`pad_to_multiple` widens a Linear (or Conv2d) and the layer that consumes its output with
zero weights, so the extra units output 0, contribute 0 and receive zero gradient: the
model computes the same function and trains the same way (plain SGD/Adam/AdamW updates
keep zeros at zero).

Only chains inside `nn.Sequential` are padded, where that is exact: producer (Linear /
Conv2d without groups), then any of ReLU, GELU, SiLU, Tanh, LeakyReLU, ELU, Hardswish,
Mish, Dropout, Identity and per-channel BatchNorm (all map 0 to 0, feature by feature),
then the consumer (Linear / Conv2d without groups). Input and output sizes of the model
are never changed.

Cost: a little more compute and memory for the padded units; on CPU there is no gain.
Build the optimizer after padding (the padded layers are new modules).

Example:
    >>> result = pad_to_multiple(model, multiple=8)
    >>> result.padded
    (('net.0', 100, 104),)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["PaddingResult", "pad_to_multiple"]

# Element-wise layers with f(0) == 0: padded units stay exactly zero through them.
_TRANSPARENT = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.LeakyReLU, nn.ELU, nn.Hardswish,
                nn.Mish, nn.Hardtanh, nn.Dropout, nn.Identity)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d)


@dataclass(frozen=True)
class PaddingResult:
    """Each padded producer layer: (qualified name, old size, new size)."""

    padded: tuple[tuple[str, int, int], ...]


def _producer_size(m: nn.Module) -> int | None:
    if isinstance(m, nn.Linear):
        return m.out_features
    if isinstance(m, nn.Conv2d) and m.groups == 1:
        return m.out_channels
    return None


def _consumer_size(m: nn.Module) -> int | None:
    if isinstance(m, nn.Linear):
        return m.in_features
    if isinstance(m, nn.Conv2d) and m.groups == 1:
        return m.in_channels
    return None


def _widen_out(m: nn.Module, new: int) -> nn.Module:
    old = _producer_size(m)
    if isinstance(m, nn.Linear):
        w = m.weight.new_zeros(new, m.in_features)
        nm = nn.Linear(m.in_features, new, bias=m.bias is not None, device=m.weight.device, dtype=m.weight.dtype)
    else:
        w = m.weight.new_zeros(new, *m.weight.shape[1:])
        nm = nn.Conv2d(m.in_channels, new, m.kernel_size, stride=m.stride, padding=m.padding, dilation=m.dilation,
                       bias=m.bias is not None, padding_mode=m.padding_mode, device=m.weight.device,
                       dtype=m.weight.dtype)
    with torch.no_grad():
        w[:old] = m.weight
        nm.weight.copy_(w)
        if m.bias is not None:
            nm.bias.zero_()
            nm.bias[:old] = m.bias
    return nm


def _widen_in(m: nn.Module, new: int) -> nn.Module:
    old = _consumer_size(m)
    if isinstance(m, nn.Linear):
        nm = nn.Linear(new, m.out_features, bias=m.bias is not None, device=m.weight.device, dtype=m.weight.dtype)
    else:
        nm = nn.Conv2d(new, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding, dilation=m.dilation,
                       bias=m.bias is not None, padding_mode=m.padding_mode, device=m.weight.device,
                       dtype=m.weight.dtype)
    with torch.no_grad():
        nm.weight.zero_()
        nm.weight[:, :old] = m.weight
        if m.bias is not None:
            nm.bias.copy_(m.bias)
    return nm


def _widen_bn(m: nn.Module, new: int) -> nn.Module:
    old = m.num_features
    nm = type(m)(new, eps=m.eps, momentum=m.momentum, affine=m.affine, track_running_stats=m.track_running_stats,
                 device=m.weight.device if m.affine else None)
    with torch.no_grad():
        if m.affine:
            nm.weight[:old] = m.weight
            nm.bias[:old] = m.bias
        if m.track_running_stats:
            nm.running_mean[:old] = m.running_mean
            nm.running_var[:old] = m.running_var
            nm.num_batches_tracked.copy_(m.num_batches_tracked)
    nm.train(m.training)
    return nm


def pad_to_multiple(model: nn.Module, *, multiple: int = 8) -> PaddingResult:
    """Pad hidden sizes inside `nn.Sequential` chains to multiples of `multiple`, in place."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple} must be >= 1")
    padded = []
    for prefix, seq in list(model.named_modules()):
        if not isinstance(seq, nn.Sequential):
            continue
        keys = list(seq._modules.keys())
        i = 0
        while i < len(keys):
            prod = seq._modules[keys[i]]
            size = _producer_size(prod)
            if size is None or size % multiple == 0:
                i += 1
                continue
            j = i + 1
            while j < len(keys) and isinstance(seq._modules[keys[j]], _TRANSPARENT + _BN):
                j += 1
            cons = seq._modules[keys[j]] if j < len(keys) else None
            bns_ok = all(not isinstance(seq._modules[keys[k]], _BN) or seq._modules[keys[k]].num_features == size
                         for k in range(i + 1, j))
            same_kind = cons is not None and isinstance(cons, type(prod)) and _consumer_size(cons) == size
            if not (same_kind and bns_ok):
                i += 1
                continue
            new = -(-size // multiple) * multiple
            seq._modules[keys[i]] = _widen_out(prod, new)
            for k in range(i + 1, j):
                if isinstance(seq._modules[keys[k]], _BN):
                    seq._modules[keys[k]] = _widen_bn(seq._modules[keys[k]], new)
            seq._modules[keys[j]] = _widen_in(cons, new)
            padded.append((f"{prefix}.{keys[i]}" if prefix else keys[i], size, new))
            i = j
    return PaddingResult(padded=tuple(padded))
