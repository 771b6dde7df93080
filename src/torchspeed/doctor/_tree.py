"""Helpers over the nested values a training script passes around (T02): tuples, lists and dicts of
tensors as model inputs and outputs. One home for them: the probe, the model checks and `--verify` use
these, nothing else in the doctor walks a batch or turns an output into a loss.
"""

from __future__ import annotations

import torch

from torchspeed.train.loop.model_output import model_loss

__all__ = ["map_tensors", "clone_args", "first_tensor", "call_model", "generic_loss"]


def map_tensors(x, fn):
    """`x` with `fn` applied to every tensor inside (tuples stay tuples, lists lists, dicts dicts)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, list):
        return [map_tensors(v, fn) for v in x]
    if isinstance(x, tuple):
        return tuple(map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    return x


def clone_args(args):
    """A detached copy of every tensor in `args` (the script may change its batch in place later)."""
    return map_tensors(args, lambda t: t.detach().clone())


def first_tensor(x):
    """The first tensor found depth-first in `x`, or None."""
    if isinstance(x, torch.Tensor):
        return x
    values = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()
    for v in values:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


def call_model(model, args, kwargs=None):
    """`model(*args, **kwargs)`, or `model(args, **kwargs)` when the captured input is not a sequence."""
    kwargs = kwargs or {}
    return model(*args, **kwargs) if isinstance(args, (tuple, list)) else model(args, **kwargs)


def generic_loss(out):
    """A scalar to backpropagate: the model's own loss when it returns one (a 0-dim tensor, a dict with
    "loss", an object with .loss: the batch contract of `torchspeed.train.loop.batch`), else a mean square."""
    loss, _ = model_loss(out)
    if loss is not None:
        return loss.float()
    if isinstance(out, torch.Tensor):
        return out.float() if out.dim() == 0 else out.float().square().mean()
    if isinstance(out, dict):
        if isinstance(out.get("loss"), torch.Tensor):
            return out["loss"].float()
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        ts = [o for o in out if isinstance(o, torch.Tensor) and o.is_floating_point()]
        return sum(t.float().square().mean() for t in ts)
    raise TypeError(f"cannot build a loss from a model output of type {type(out).__name__}")
