"""How a model is called with a batch's inputs (the batch contract's call, `train.loop.batch`; T13's hot path reads it).

A model's `forward` is read once (its signature cached per function and per object called: not every step):
the dict entries it accepts (`model(**batch)`, Hugging Face style), and whether it takes the batch's target
(`forward(idx, targets=None)` in GPT scripts, `forward(images, targets)` in torchvision's detection models),
in which case the target is passed as the parameter right after the inputs, or by name.

Example:
    >>> takes_target(gpt, 1)                 # "targets"
    >>> call_model(gpt, (idx,), y, "targets")  # gpt(idx, y)
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

from torchspeed.train.wrappers import unwrap_model

__all__ = ["call_model", "takes_target", "TARGET_PARAMS"]

TARGET_PARAMS = ("targets", "target", "labels", "y")  # forward parameters that take the batch's target

Signature = tuple[bool, frozenset, tuple, frozenset]
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward function -> Signature
_OUTER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the object called (a wrapper too) -> Signature


def _signature(model: Callable) -> Signature:
    """(takes **kwargs, parameter names, positional names, keyword-only names) of `model`'s forward, cached
    per function (read once per model class, not every step) and per outer object (no unwrapping per step)."""
    try:
        return _OUTER[model]
    except (KeyError, TypeError):
        pass
    sig = _inner_signature(model)
    try:
        _OUTER[model] = sig
    except TypeError:
        pass
    return sig


def _inner_signature(model: Callable) -> Signature:
    inner = unwrap_model(model)  # the user's module inside the compile controller, DDP and torch.compile
    fn = getattr(inner, "forward", inner)
    key = getattr(fn, "__func__", fn)
    try:
        return _SIGNATURES[key]
    except (KeyError, TypeError):  # TypeError: a callable that takes no weak reference (not cached)
        pass
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        sig: Signature = (True, frozenset(), (), frozenset())
    else:
        positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        sig = (any(p.kind is p.VAR_KEYWORD for p in params), frozenset(p.name for p in params), positional,
               frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY))
    try:
        _SIGNATURES[key] = sig
    except TypeError:
        pass
    return sig


def _keyword_args(model: Callable, inputs: dict) -> dict:
    """The dict entries `model`'s forward accepts (all of them if it takes **kwargs)."""
    takes_all, names, _, _ = _signature(model)
    return inputs if takes_all else {k: v for k, v in inputs.items() if k in names}


def takes_target(model: Callable, n_inputs: int) -> str | None:
    """The name of `model`'s target parameter when it is the positional one right after `n_inputs` inputs
    (`forward(idx, targets=None)`, `forward(images, targets)`) or keyword-only; else None."""
    _, _, positional, keyword_only = _signature(model)
    if len(positional) > n_inputs and positional[n_inputs] in TARGET_PARAMS:
        return positional[n_inputs]
    return next((k for k in TARGET_PARAMS if k in keyword_only), None)


def call_model(model: Callable, inputs: tuple | dict, target=None, target_param: str | None = None):
    """`model(**inputs)` for a dict, else `model(*inputs)`; with `target_param`, the target passed too."""
    if isinstance(inputs, dict):
        return model(**_keyword_args(model, inputs))
    if target_param is None:
        return model(*inputs)
    _, _, positional, _ = _signature(model)
    if len(positional) > len(inputs) and positional[len(inputs)] == target_param:
        return model(*inputs, target)
    return model(*inputs, **{target_param: target})
