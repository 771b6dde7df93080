"""The recipe's TTA part (T33): flip test-time augmentation, decided after training on a few training batches
(`choose_tta`), kept only when it scores better there; `decide_tta` does it for a trained `Trainer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from torchspeed.train.decision import Decision

__all__ = ["choose_tta", "decide_tta"]


def choose_tta(model: nn.Module, batches: Sequence, *, device: torch.device | str | None = None,
               precision: str = "fp32", channels_last: bool = False, margin: float = 0.02) -> Decision:
    """Flip test-time augmentation (T33) when it scores better on `batches` (training batches).

    Only for image classifiers (4D inputs). "Better": a lower loss by more than `margin`
    (relative) and an accuracy at least as high. Digits, text, or a model that learnt
    orientation: refused. Returns a Decision with both scores measured.
    """
    from torchspeed.train.batch import split_batch
    from torchspeed.train.evaluate import evaluate

    if not batches:
        return Decision(None, "no training batches to measure on")
    inputs, target = split_batch(batches[0])
    x = inputs[0] if isinstance(inputs, tuple) and inputs else None
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or target is None:
        return Decision(None, "not an image classifier (4D inputs with targets): no flip")
    kw = dict(device=device, precision=precision, channels_last=channels_last)
    plain = evaluate(model, batches, **kw)
    flip = evaluate(model, batches, tta="flip", **kw)
    measured = {"plain": {"loss": plain["val_loss"], "acc": plain["val_acc"]},
                "flip": {"loss": flip["val_loss"], "acc": flip["val_acc"]}}
    better = (flip["val_loss"] < plain["val_loss"] * (1 - margin)
              and (flip["val_acc"] or 0) >= (plain["val_acc"] or 0))
    how = (f"training batches: loss {plain['val_loss']:.4f} plain vs {flip['val_loss']:.4f} with flips, "
           f"accuracy {plain['val_acc']:.3f} vs {flip['val_acc']:.3f}")
    return Decision("flip" if better else None, ("flip scores better on " if better else "flip does not score "
                                                 "better on ") + how, measured=measured)


def decide_tta(trainer, batches: Sequence) -> Decision:
    """`choose_tta` for a trained `Trainer` (the weights it evaluates: the EMA's when one is on), recorded in its
    decisions; a chosen TTA becomes its `config.tta` unless one was set. Under DDP rank 0 decides for every rank."""
    from torchspeed.tune._common import decide_once

    module = trainer.callbacks.eval_module(trainer.module)
    dec = decide_once(lambda: choose_tta(module, batches, device=trainer.device, precision=trainer.precision,
                                         channels_last=trainer.channels_last))
    trainer.decisions["tta"] = dec
    if dec.value and trainer.config.tta is None:
        trainer.config.tta = dec.value
    return dec
