"""No bias in a convolution directly followed by BatchNorm (T27).

BatchNorm subtracts the per-channel mean of its input, so a per-channel bias added by the
convolution just before it cancels in training mode, and in eval mode it only shifts the
running mean. `remove_conv_bias` drops the bias and subtracts it from the BatchNorm's
running mean, so the model computes exactly the same function in both modes and trains the
same way, with one fewer parameter tensor to update, store and add per conv.

Cost: none. The gain is small (one broadcast add per conv and one optimizer update per
bias), and largest for many thin layers.

Pairs are found by running the model once on an example input and matching a BatchNorm's
input tensor to a convolution's output (exact for any module structure); without an input,
adjacent layers in `nn.Sequential` containers are used.

Example:
    >>> pairs = remove_conv_bias(model, example_input=torch.randn(2, 3, 32, 32))
    >>> [p.conv for p in pairs]
    ['features.0', 'features.3']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ConvBNPair", "find_conv_bn_pairs", "remove_conv_bias"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@dataclass(frozen=True)
class ConvBNPair:
    """A convolution (by qualified name) whose output feeds straight into a BatchNorm."""

    conv: str
    bn: str
    has_bias: bool


def _pairs_from_sequential(model: nn.Module) -> list[tuple[str, str]]:
    out = []
    for prefix, mod in model.named_modules():
        if not isinstance(mod, nn.Sequential):
            continue
        kids = list(mod.named_children())
        for (n1, m1), (n2, m2) in zip(kids, kids[1:]):
            if isinstance(m1, _CONVS) and isinstance(m2, _BNS):
                p = f"{prefix}." if prefix else ""
                out.append((p + n1, p + n2))
    return out


def _pairs_from_trace(model: nn.Module, example_input, example_kwargs=None) -> list[tuple[str, str]]:
    names = {m: n for n, m in model.named_modules()}
    produced: dict[int, str] = {}
    found: list[tuple[str, str]] = []
    handles = []

    keep = []  # keep conv outputs alive so their ids are not reused during the pass

    def conv_hook(mod, args, out):
        if isinstance(out, torch.Tensor):
            keep.append(out)
            produced[id(out)] = names[mod]

    def bn_pre_hook(mod, args):
        if args and isinstance(args[0], torch.Tensor) and id(args[0]) in produced:
            pair = (produced[id(args[0])], names[mod])
            if pair not in found:
                found.append(pair)

    for m in model.modules():
        if isinstance(m, _CONVS):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, _BNS):
            handles.append(m.register_forward_pre_hook(bn_pre_hook))
    was_training = model.training
    try:
        model.eval()  # no running-stat updates while we look
        with torch.no_grad():
            kw = example_kwargs or {}
            if isinstance(example_input, (tuple, list)):
                model(*example_input, **kw)
            else:
                model(example_input, **kw)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return found


def find_conv_bn_pairs(model: nn.Module, *, example_input=None, example_kwargs: dict | None = None) -> list[ConvBNPair]:
    """Convolutions whose output goes straight into a BatchNorm with the same channels.

    `example_input` (a tensor or a tuple of positional arguments) and `example_kwargs` are
    passed to one forward pass that traces the pairs; without them, adjacent layers of
    `nn.Sequential` containers are used.
    """
    traced = example_input is not None or example_kwargs
    raw = _pairs_from_trace(model, example_input if example_input is not None else (), example_kwargs) \
        if traced else _pairs_from_sequential(model)
    mods = dict(model.named_modules())
    out = []
    for c, b in raw:
        conv, bn = mods[c], mods[b]
        if conv.out_channels != bn.num_features:
            continue
        out.append(ConvBNPair(conv=c, bn=b, has_bias=conv.bias is not None))
    return out


def remove_conv_bias(model: nn.Module, *, example_input=None, example_kwargs: dict | None = None) -> list[ConvBNPair]:
    """Drop the bias of every conv followed by BatchNorm, folding it into the running mean.

    Exact: outputs are unchanged in train and eval mode. Returns the pairs that were changed.
    Build the optimizer after calling this (the bias parameters are gone).
    """
    mods = dict(model.named_modules())
    changed = []
    for pair in find_conv_bn_pairs(model, example_input=example_input, example_kwargs=example_kwargs):
        if not pair.has_bias:
            continue
        conv, bn = mods[pair.conv], mods[pair.bn]
        with torch.no_grad():
            if bn.running_mean is not None:
                # eval: BN(x + b) uses (x + b - rm); with rm' = rm - b it is (x - rm').
                bn.running_mean.sub_(conv.bias.detach().to(bn.running_mean.dtype))
        conv.bias = None
        changed.append(pair)
    return changed
