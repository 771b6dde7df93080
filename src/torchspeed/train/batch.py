"""The batch contract: what a batch may look like and how a loss and metrics come out of it.

One home for the rules that `fit`, `Trainer`, `evaluate`, the tuners (`find_lr`,
`find_batch_size`), the doctor's `--verify` and the bench share:

- **Batches.** A tuple/list `(inputs..., target)` calls `model(*inputs)`; a 1-tuple or a
  bare tensor calls `model(x)` with no target; a dict calls `model(**batch)` with the keys
  the model's `forward` accepts (Hugging Face style: `{"input_ids", "attention_mask",
  "labels"}`); its target is `labels` / `label` / `target` / `targets` / `y` when present.
  Moving to the device, channels_last (T23) and autocast (T21) reach every tensor in the
  structure (`transfer.to_device`).
- **Losses.** A model that returns its own loss (a 0-dim tensor, a dict with `"loss"`, or an
  object with `.loss`, as Hugging Face models do when given labels) is trained on that loss.
  Otherwise `loss_fn(output, target)`; the default is cross-entropy, flattened when the
  output is a sequence of logits `(B, T, V)` for targets `(B, T)` (language models).
- **Anything else**: `step_fn(model, batch)` returns the loss (or an output as above).
- **Metrics by task** (T13: counted on the device). Accuracy is counted only when the output
  and target look like classification: integer targets and logits with one more (class)
  dimension; per token for sequences, ignoring targets equal to -100. A regression model
  gets its loss alone, so `best_metric="auto"` picks `val_loss`.

Example:
    >>> out = forward_loss(model, batch, loss_fn=None)
    >>> out.loss.backward(); out.correct, out.counted   # device tensors, or None
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from torchspeed.train.wrappers import unwrap_model

__all__ = ["StepOutput", "split_batch", "forward_loss", "batch_size", "count_correct", "SequenceCrossEntropy", "model_loss",
           "call_model",
           "default_loss", "TARGET_KEYS", "IGNORE_INDEX"]

TARGET_KEYS = ("labels", "label", "target", "targets", "y")
IGNORE_INDEX = -100  # the usual "no target here" token (padding), as in F.cross_entropy


class SequenceCrossEntropy(nn.CrossEntropyLoss):
    """Cross-entropy that also takes sequence logits (B, T, V) with targets (B, T), flattened."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() >= 3 and target.dim() == input.dim() - 1 and input.shape[:-1] == target.shape \
                and not target.is_floating_point():
            return super().forward(input.reshape(-1, input.shape[-1]), target.reshape(-1))
        return super().forward(input, target)


def default_loss(label_smoothing: float = 0.0) -> nn.Module:
    return SequenceCrossEntropy(label_smoothing=label_smoothing, ignore_index=IGNORE_INDEX)


def split_batch(batch) -> tuple[tuple | dict, torch.Tensor | None]:
    """(inputs, target): inputs are positional (a tuple) or keyword (a dict) arguments of the model."""
    if isinstance(batch, torch.Tensor):
        return (batch,), None
    if isinstance(batch, Mapping):
        target = next((batch[k] for k in TARGET_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
        return dict(batch), target
    if isinstance(batch, (list, tuple)):
        if len(batch) == 0:
            raise ValueError("an empty batch: the loader yielded () or []")
        if len(batch) == 1:
            return (batch[0],), None
        return tuple(batch[:-1]), batch[-1]
    raise TypeError(f"a batch of type {type(batch).__name__} is not understood: yield (inputs..., target) tuples, "
                    "dicts of tensors, or pass step_fn(model, batch) that returns the loss")


def batch_size(batch) -> int:
    """The number of samples in `batch` (the first dimension of its first tensor)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim():
            return int(v.shape[0])
        if isinstance(v, (list, tuple, Mapping)):
            n = batch_size(v)
            if n:
                return n
    return 0


_ACCEPTS: dict[int, tuple[bool, frozenset]] = {}


def _keyword_args(model: Callable, inputs: dict) -> dict:
    """The dict entries `model`'s forward accepts (all of them if it takes **kwargs)."""
    inner = unwrap_model(model)  # the user's module inside the compile controller, DDP and torch.compile
    fn = getattr(inner, "forward", inner)
    key = id(getattr(fn, "__func__", fn))
    if key not in _ACCEPTS:
        try:
            params = inspect.signature(fn).parameters.values()
            _ACCEPTS[key] = (any(p.kind is p.VAR_KEYWORD for p in params), frozenset(p.name for p in params))
        except (TypeError, ValueError):
            _ACCEPTS[key] = (True, frozenset())
    takes_all, names = _ACCEPTS[key]
    return inputs if takes_all else {k: v for k, v in inputs.items() if k in names}


def call_model(model: Callable, inputs: tuple | dict):
    return model(**_keyword_args(model, inputs)) if isinstance(inputs, dict) else model(*inputs)


def model_loss(output) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss the model computed, logits) from a model's output; either may be None."""
    if isinstance(output, torch.Tensor):
        return (output, None) if output.dim() == 0 else (None, output)
    if isinstance(output, Mapping):
        loss, logits = output.get("loss"), output.get("logits")
    elif isinstance(output, (list, tuple)):  # (logits, extra...) as some models return
        return None, output[0] if output and isinstance(output[0], torch.Tensor) else None
    else:
        loss, logits = getattr(output, "loss", None), getattr(output, "logits", None)
    return (loss if isinstance(loss, torch.Tensor) else None), (logits if isinstance(logits, torch.Tensor) else None)


def count_correct(logits: torch.Tensor | None, target: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(correct, counted) on the device when this looks like classification, else None.

    Classification: integer targets, logits with one extra trailing class dimension. For
    sequences every token counts (targets equal to -100 are padding and do not).
    """
    if logits is None or target is None or target.is_floating_point() or target.is_complex():
        return None
    if logits.dim() != target.dim() + 1 or logits.shape[:-1] != target.shape or logits.shape[-1] < 2:
        return None
    pred = logits.detach().argmax(-1)
    if target.dim() == 1:
        return (pred == target).sum(), torch.tensor(target.shape[0], device=target.device)
    valid = target != IGNORE_INDEX
    return ((pred == target) & valid).sum(), valid.sum()


@dataclass
class StepOutput:
    loss: torch.Tensor
    logits: torch.Tensor | None
    target: torch.Tensor | None
    n: int  # samples in the batch

    def correct(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return count_correct(self.logits, self.target)


def forward_loss(model: Callable, batch, *, loss_fn: Callable | None = None,
                 step_fn: Callable | None = None) -> StepOutput:
    """Run `model` on `batch` by the contract above; return the loss, logits and target."""
    if step_fn is not None:
        out = step_fn(model, batch)
        loss, logits = model_loss(out)
        if loss is None and isinstance(out, torch.Tensor):
            loss = out.mean() if out.numel() == 1 else None
        if loss is None:
            raise TypeError("step_fn(model, batch) must return the loss: a 0-dim tensor, a dict with 'loss', or an "
                            f"object with .loss; it returned {type(out).__name__}")
        return StepOutput(loss, logits, split_batch(batch)[1] if logits is not None else None, batch_size(batch))
    inputs, target = split_batch(batch)
    out = call_model(model, inputs)
    loss, logits = model_loss(out)
    if loss is None:
        if logits is None:
            raise TypeError(f"the model returned {type(out).__name__}: return logits (a tensor), a loss, or a dict/"
                            "object with 'loss' or 'logits'; or pass step_fn(model, batch) that returns the loss")
        if target is None:
            raise ValueError("the batch has no target and the model returned no loss: yield (inputs..., target), "
                             f"a dict with one of {list(TARGET_KEYS)}, let the model return its loss, or pass "
                             "step_fn(model, batch)")
        loss = (loss_fn or default_loss())(logits, target)
    return StepOutput(loss, logits, target, batch_size(batch))
