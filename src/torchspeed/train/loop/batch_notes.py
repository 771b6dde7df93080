"""What an error on a run's first step is told besides torch's words (the batch contract: batch.py, docs/models.md):
how the batch was read, and the fix for the dtypes and target forms torch's messages do not name (float64 data from
NumPy, integer or half-precision inputs, a target of Python values); and, before any work, a `step_fn` or `loss_fn`
that cannot be called as `fit` calls it (`check_step_fn`: a Lightning `training_step(batch, batch_idx)`,
`nn.CTCLoss` as the loss_fn), named with how it ports.

Example:
    >>> try:
    ...     model(x)
    ... except Exception as e:
    ...     first_step_notes(e, "model(x)", (x,), y)
    ...     raise
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["first_step_notes", "check_step_fn"]

_HALF = (torch.float16, torch.bfloat16)
_DTYPE_WORDS = ("same dtype", "should be the same", "expected scalar type")


def _any(v, pred: Callable[[torch.Tensor], bool], leaf: Callable[[object], bool] = torch.is_tensor) -> bool:
    """Whether a leaf in `v` (a tensor, or a dict, list or tuple of them, nested; `leaf` says what a leaf is)
    satisfies `pred`."""
    if leaf(v):
        return pred(v)
    values = list(v.values()) if isinstance(v, Mapping) else v if isinstance(v, (list, tuple)) else ()
    return any(_any(e, pred, leaf) for e in values)


def _numpy(v) -> bool:
    return type(v).__module__ == "numpy"  # an array or a numpy scalar


def first_step_notes(e: BaseException, call: str, inputs, target) -> None:
    """Notes on `e`, raised on the first step: the call and the target as read, and the fix its cause asks for."""
    e.add_note(f"torchspeed called the model as {call}"
               + ("" if isinstance(inputs, dict) or target is None else
                  f", the batch's last of {len(inputs) + 1} elements as the target")
               + " (the batch contract: docs/models.md). If your batch is laid out otherwise (the label "
                 "first, say), pass step_fn=lambda model, batch: <the loss>.")
    words = str(e)
    if "ouble" in words and _any((inputs, target), lambda t: t.dtype is torch.float64):  # torch says Double
        e.add_note("The batch holds float64 tensors (numpy's default, which torch.from_numpy keeps) and the "
                   "model's weights are float32: make the data float32 where it is built (torch.as_tensor(x, "
                   "dtype=torch.float32), or .float() on the TensorDataset's tensors), or cast in step_fn.")
    elif any(w in words for w in _DTYPE_WORDS) and \
            _any(inputs, lambda t: not (t.is_floating_point() or t.is_complex() or t.dtype is torch.bool)):
        e.add_note("The model's inputs are integer tensors (uint8 images, int64 ids) and its weights are "
                   "float: convert them where the data is built (x.float() / 255 for images) or in a "
                   "transform; an integer input is right only for a model that starts with an nn.Embedding.")
    elif any(w in words for w in _DTYPE_WORDS) and _any(inputs, lambda t: t.dtype in _HALF):
        e.add_note("The batch holds float16/bfloat16 tensors and the model's weights are float32: keep the "
                   "data float32 (x.float() where it is built); fit picks the precision itself "
                   "(precision='auto': bf16 autocast where this hardware gains from it).")
    if _any((inputs, target), lambda a: True, leaf=_numpy):
        e.add_note("The batch holds numpy arrays, not tensors: a DataLoader's default collate makes tensors of "
                   "them; batches you yield or list yourself need torch.as_tensor(x) (float32 inputs).")
    if isinstance(target, (list, tuple)) and target and not _any(target, lambda t: True):
        e.add_note(f"The target is a {type(target).__name__} of {len(target)} Python values, not a tensor: "
                   "yield it as one (torch.tensor(labels); a DataLoader's default collate does).")


def check_step_fn(step_fn: Callable | None, loss_fn: Callable | None = None) -> None:
    """A clear error before any work for a `step_fn` that cannot be called as `step_fn(model, batch)` (a Lightning
    `training_step(batch, batch_idx)` brought as it is), or a `loss_fn` that cannot be called as
    `loss_fn(output, target)` (`nn.CTCLoss`, a loss with a mask: they go in a step_fn; with a step_fn, the loss is
    its own)."""
    if isinstance(step_fn, nn.modules.loss._Loss) or getattr(step_fn, "__module__", None) == "torch.nn.functional":
        own = getattr(step_fn, "__name__", type(step_fn).__name__)
        raise TypeError(f"step_fn={own} is a loss of (output, target), and a step_fn is called as step_fn(model, "
                        f"batch): pass it as loss_fn={own}, which fit calls on the model's output and the target")
    _callable_as(step_fn, "step_fn(model, batch) and returns the loss", "A Lightning training_step(self, batch, "
                 "batch_idx) ports as step_fn=lambda model, batch: ... with what it computes (docs/models.md)")
    _callable_as(None if step_fn is not None else loss_fn, "loss_fn(output, target)", "A loss that needs more "
                 "than the model's output and the target goes in a step_fn: step_fn=lambda model, batch: <the loss> "
                 "(docs/models.md)")


def _callable_as(fn: Callable | None, call: str, hint: str) -> None:
    if fn is None:
        return
    name = call.split("(")[0]
    if not callable(fn):
        raise TypeError(f"{name} must be a function called as {call}, got {type(fn).__name__}")
    if isinstance(fn, type):  # `loss_fn=nn.CrossEntropyLoss`: calling the class would build a loss, not compute one
        raise TypeError(f"{name}={fn.__name__} is the class, not a loss: pass an instance, {name}={fn.__name__}() "
                        f"(it is called as {call})")
    try:
        signature = inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
        signature.bind(None, None)
    except ValueError:  # no signature to read (a builtin, a C callable): called as it is
        return
    except TypeError as e:
        own = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(f"{name} is called as {call}; {own}{signature} cannot be ({e}). {hint}") from None
