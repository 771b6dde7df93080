"""The default loss (T32): cross-entropy over classes, tokens and pixels, with errors that name the shapes.

`default_loss` is what `fit`, `evaluate` and the tuners score a model's logits with when no `loss_fn` is given
(the batch contract, `torchspeed.train.loop.batch`): `nn.CrossEntropyLoss` with label smoothing and `ignore_index`
-100, flattened when the output is a sequence of logits `(B, T, V)` for targets `(B, T)` (language models).
Where torch's own message names neither shape, the error says which shapes came and what the target must be
(`_shape_mismatch`); logits with one class (a regression model, or a binary one, left on the default) are refused
at once: softmax over one class makes the loss 0 whatever the weights, so nothing would train.

Example:
    >>> loss = default_loss(label_smoothing=0.1)(logits, target)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SequenceCrossEntropy", "default_loss", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # the usual "no target here" token (padding), as in F.cross_entropy


_INDEX_DTYPES = (torch.int32, torch.int16, torch.int8, torch.bool)


class SequenceCrossEntropy(nn.CrossEntropyLoss):
    """Cross-entropy that also takes sequence logits (B, T, V) with targets (B, T), flattened, and class indices of
    any integer dtype (int32 from numpy, say)."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.dtype in _INDEX_DTYPES:  # int32 (numpy's on some platforms), int16, int8, bool class indices
            target = target.long()  # what torch's cross-entropy takes (it refuses the others)
        if input.dim() >= 3 and target.dim() == input.dim() - 1 and input.shape[:-1] == target.shape \
                and not target.is_floating_point():
            return super().forward(input.reshape(-1, input.shape[-1]), target.reshape(-1))
        if input.dim() >= 2 and input.shape[1] == 1:  # softmax over one class: the loss is 0, nothing would train
            raise ValueError(_shape_mismatch(input, target) or (
                f"the default cross-entropy got logits with one class (shape {tuple(input.shape)}): its loss is 0 "
                "whatever the weights. For regression pass loss_fn=nn.MSELoss(); for a binary target, "
                "loss_fn=nn.BCEWithLogitsLoss() (float 0/1 targets of the logits' shape); or give the model one "
                "output per class"))
        try:
            return super().forward(input, target)
        except IndexError as e:  # "Target 6 is out of bounds": name the classes the model has and the fix
            raise IndexError(_class_range(input, target) or str(e)) from e
        except (RuntimeError, ValueError) as e:  # torch's words name neither shape: say which and the fix
            why = _shape_mismatch(input, target)
            if why is None:
                raise
            raise ValueError(why) from e


def _class_range(logits: torch.Tensor, target: torch.Tensor) -> str | None:
    """Why class indices do not fit the logits' classes, with the fix; None where they do (another error)."""
    if target.is_floating_point() or logits.dim() < 2 or target.numel() == 0:
        return None
    kept = target[target != IGNORE_INDEX]
    lo, hi, n = (int(kept.min()), int(kept.max()), logits.shape[1]) if kept.numel() else (0, 0, logits.shape[1])
    if 0 <= lo and hi < n:
        return None
    return (f"the default cross-entropy got class indices from {lo} to {hi}, but the model outputs {n} classes "
            f"(logits of shape {tuple(logits.shape)}): give its last layer one output per class (at least {hi + 1}), "
            "or map the labels to 0..classes-1 where the data is built (1-based labels: y - 1)")


def _shape_mismatch(logits: torch.Tensor, target: torch.Tensor) -> str | None:
    """Why the default cross-entropy cannot take these shapes, with the fix; None where they fit (another error)."""
    lt, tt = tuple(logits.shape), tuple(target.shape)
    if target.is_floating_point():  # class probabilities
        fit, want = lt == tt, f"class probabilities of the logits' shape {lt}, or class indices (an integer tensor)"
    else:  # class indices: the logits' shape without its class dimension (the second)
        fit = len(lt) == len(tt) + 1 and lt[:1] == tt[:1] and lt[2:] == tt[1:]
        want = (f"class indices of shape {lt[:1] + lt[2:]} (one per sample{', per position' if len(lt) > 2 else ''})"
                if len(lt) >= 2 else "a 0-dim class index")
    if fit:
        return None
    return (f"the default cross-entropy got logits of shape {lt} and a target of shape {tt} "
            f"({str(target.dtype).replace('torch.', '')}): for these logits the target must be {want}. Check what "
            "the loader yields as the target (a mask or a one-hot where indices were meant, a missing squeeze), or "
            "pass loss_fn= for another loss (nn.MSELoss() for regression)")


def loss_fn_shape_hint(logits: torch.Tensor, target: torch.Tensor) -> str | None:
    """For a `loss_fn` of the user's that refused (output, target): the fix where the two differ only by a trailing
    dimension of one (a binary model's (B, 1) logits against (B,) labels, or the other way); None otherwise."""
    lt, tt = tuple(logits.shape), tuple(target.shape)
    if lt[-1:] == (1,) and lt[:-1] == tt:
        fix = "return output.squeeze(-1) from the model (or its step), or yield targets of shape {lt} (y.view(-1, 1))"
    elif tt[-1:] == (1,) and tt[:-1] == lt:
        fix = "yield targets of shape {lt} (y.squeeze(-1)), or return output of shape {tt} from the model"
    else:
        return None
    return (f"loss_fn got output of shape {lt} and a target of shape {tt}: they differ by a dimension of one, which "
            f"a loop's own code squeezes; {fix.format(lt=lt, tt=tt)}")


def default_loss(label_smoothing: float = 0.0) -> nn.Module:
    return SequenceCrossEntropy(label_smoothing=label_smoothing, ignore_index=IGNORE_INDEX)
