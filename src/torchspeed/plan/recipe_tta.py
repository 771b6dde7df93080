"""The recipe's TTA part (T33): flip test-time augmentation, decided after training on a few training batches
(`choose_tta`), kept only when it scores better there; `after_training` does it for a trained `Trainer`.

The check is not training: 2 forward passes per probe batch (the plain and the mirrored view;
the flip score averages the two softmaxes, so the plain logits serve both scores), about
`TTA_COST` training steps. So the plan's "tta_budget" stage (`tta_part`, before training) charges it to the
tuning budget like any part off the run: a run too short to afford it reads an earlier run's check from the cache,
or keeps the prior (no TTA, which costs nothing and changes nothing), and its Decision says which. Where it affords
the check, the "tta" stage runs it after training (`after_training`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.plan.stages import RunContext
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.eval_view import eval_weights
from torchspeed.train.evaluate import averaged_log_probs, is_image_batch, tta_views
from torchspeed.train.trial.precision import resolve_precision
from torchspeed.train.transfer import to_device
from torchspeed.tune._common import decide_once

__all__ = ["TTA_COST", "after_training", "choose_tta", "flip_scores", "tta_part"]

# Training steps' worth of the check: 2 forward passes on each of the recipe's 4 probe batches, a forward pass
# being about a third of a training step (forward + backward + optimizer step).
TTA_COST = 3


def flip_scores(model: nn.Module, batches: Sequence, *, device: torch.device | str | None = None,
                precision="fp32", channels_last: bool = False) -> dict[str, dict[str, float]]:
    """Loss and accuracy of `model` on `batches` of (images, labels), plain and with flip TTA (the mean of the
    softmaxes of the image and its mirror, as `evaluate(tta="flip")` scores it), from 2 forward passes a batch."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if isinstance(precision, str):
        precision = resolve_precision(precision, device=device)
    sums = {"plain": [0.0, 0], "flip": [0.0, 0]}
    n = 0
    was = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in batches:
                x, y = to_device(tuple(batch), device, channels_last=channels_last)
                with precision.autocast():
                    outs = [model(v) for v in tta_views(x, flip=True)]  # the image, then its mirror
                out = outs[0]
                if not isinstance(out, torch.Tensor) or out.dim() != 2:
                    raise ValueError(f"flip TTA needs (N, classes) logits; the model returned {type(out).__name__}"
                                     + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else ""))
                for name, logp in (("plain", averaged_log_probs(outs[:1])), ("flip", averaged_log_probs(outs))):
                    sums[name][0] += float(F.nll_loss(logp, y, reduction="sum"))
                    sums[name][1] += int((logp.argmax(-1) == y).sum())
                n += int(y.shape[0])
    finally:
        model.train(was)
    return {k: {"loss": s[0] / n, "acc": s[1] / n} for k, s in sums.items()}


def choose_tta(model: nn.Module, batches: Sequence, *, device: torch.device | str | None = None,
               precision="fp32", channels_last: bool = False, margin: float = 0.02) -> Decision:
    """Flip test-time augmentation (T33) when it scores better on `batches` (training batches).

    Only for image classifiers ((images, labels) batches, images 4D). "Better": a lower loss by
    more than `margin` (relative) and an accuracy at least as high. Digits, text, or a model that
    learnt orientation: refused. Returns a Decision with both scores measured.
    """
    if not batches:
        return Decision(None, "no training batches to measure on")
    if not is_image_batch(batches[0]):
        return Decision(None, "not an image classifier (4D inputs with targets): no flip")
    try:
        measured = flip_scores(model, batches, device=device, precision=precision, channels_last=channels_last)
    except ValueError as e:
        return Decision(None, f"no flip: {e}")
    plain, flip = measured["plain"], measured["flip"]
    better = flip["loss"] < plain["loss"] * (1 - margin) and flip["acc"] >= plain["acc"]
    how = (f"training batches: loss {plain['loss']:.4f} plain vs {flip['loss']:.4f} with flips, "
           f"accuracy {plain['acc']:.3f} vs {flip['acc']:.3f}")
    return Decision("flip" if better else None, ("flip scores better on " if better else "flip does not score "
                                                 "better on ") + how, measured=measured)


def tta_part(ctx: RunContext) -> None:
    """The "tta_budget" stage: flip TTA checked after training on the probe batches (within the budget), cached, or
    the prior (none)."""
    rec, gate = ctx.rec, ctx.shared.gate
    if not is_image_batch(rec.probe[0]):
        ctx.decisions["tta"] = Decision(None, "not an image classifier ((images, labels) batches): no flip")
    elif gate.measure("tta", TTA_COST):
        rec.pending["tta"] = {"cost": TTA_COST, "key": gate.key,
                              "cache": str(gate.cache.path) if gate.cache is not None else None}
        ctx.decisions["tta"] = Decision(None, f"checked after training on {len(rec.probe)} training batches "
                                              f"(~{TTA_COST} steps' worth, within the budget)")
    else:
        rec.tta = gate.settle("tta", "tta", None, "no flip TTA (it costs nothing and changes nothing)", default=None)


def after_training(trainer, rec) -> Decision | None:
    """The recipe's TTA part for a trained `Trainer`, on the weights it evaluates (`train.eval_view.eval_weights`).

    Measured when the plan left it pending (then cached for the next run of this model), or read
    from the plan's decision (cached or prior); recorded in the trainer's decisions, and a chosen
    TTA becomes its `config.tta` unless one was set. Under DDP rank 0 measures for every rank.
    None when the recipe has no TTA part."""
    if "tta" not in rec.parts:
        return None
    pending = rec.pending.pop("tta", None)
    if pending is None:
        dec = rec.decisions.get("tta") or Decision(None, "not decided")
    else:
        with eval_weights(trainer) as module:  # the weights evaluated and saved (EMA, Schedule-Free's average)
            dec = decide_once(lambda: choose_tta(module, rec.probe, device=trainer.device,
                                                 precision=trainer.precision, channels_last=trainer.channels_last))
        if pending.get("cache") is not None:
            TrialCache(pending["cache"]).merge(pending["key"], {"tta": {"tta": dec.value, "decision": dict(dec)}})
    rec.tta = dec.value
    trainer.decisions.refine("tta", dec)  # the plan's "checked after training" becomes what the check found
    if dec.value and trainer.config.tta is None:
        trainer.config.tta = dec.value
    return dec
