"""How a model's output is read by the batch contract (batch.py, its **Losses**): `read_output` finds the loss
a model computed itself (a 0-dim tensor, a tuple holding one, a dict with "loss", a dict of losses summed with
each kept in `ModelOutput.parts`, an object with `.loss`) and its logits (a tensor, a dict's "logits", a dict of
logits `{"out", "aux"}`); `model_loss` gives the pair.

No technique of its own: the step (batch.py's `forward_loss`), the doctor and the tuners read outputs this way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["ModelOutput", "read_output", "model_loss"]


@dataclass
class ModelOutput:
    """What a model's output holds: its own `loss`, `logits`, the named losses it summed, an aux head."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    parts: dict[str, torch.Tensor] | None = None
    aux: torch.Tensor | None = None
    form: str = ""  # how the output was read, in words

def _tensor(v) -> torch.Tensor | None:
    return v if isinstance(v, torch.Tensor) else None

def _read_mapping(out: Mapping) -> ModelOutput:
    if isinstance(out.get("loss"), torch.Tensor):  # Hugging Face's ModelOutput is a dict too
        what = "a dict" if type(out) is dict else type(out).__name__
        return ModelOutput(out["loss"], _tensor(out.get("logits")), form=f"{what} with 'loss'")
    losses = {k: v for k, v in out.items() if "loss" in str(k) and isinstance(v, torch.Tensor)}
    if not losses and out and all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()
                                  for v in out.values()):
        losses = dict(out)  # every value a scalar: losses by other names (torchvision's RetinaNet, FCOS, SSD)
    if losses and all(v.dim() == 0 for v in losses.values()):
        total = sum(losses.values())
        names = ", ".join(map(str, losses))
        what = f"a dict of {len(losses)} losses, summed" if len(losses) > 1 else "a dict of 1 loss"
        return ModelOutput(total, _tensor(out.get("logits")), parts=dict(losses), form=f"{what} ({names})")
    if isinstance(out.get("out"), torch.Tensor):
        aux = _tensor(out.get("aux"))
        heads = "'out', 'aux'" if aux is not None else "'out'"
        return ModelOutput(None, out["out"], aux=aux, form=f"a dict of logits ({heads})")
    logits = _tensor(out.get("logits"))
    return ModelOutput(None, logits, form="a dict with 'logits'" if logits is not None else
                       f"a dict with keys {list(out)[:6]}")

def read_output(out) -> ModelOutput:
    """Read a model's output by the contract: its own loss, logits, summed losses, or a dict of logits."""
    if isinstance(out, torch.Tensor):
        return ModelOutput(out, None, form="a 0-dim tensor") if out.dim() == 0 else \
            ModelOutput(None, out, form="logits")
    if isinstance(out, Mapping):
        return _read_mapping(out)
    if isinstance(out, (list, tuple)):  # (logits, loss) as GPT scripts return; (logits, extra...)
        loss = next((v for v in out if isinstance(v, torch.Tensor) and v.dim() == 0), None)
        logits = next((v for v in out if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        held = " holding a 0-dim loss" if loss is not None else ""
        return ModelOutput(loss, logits, form=f"a tuple of {len(out)}{held}")
    loss, logits = _tensor(getattr(out, "loss", None)), _tensor(getattr(out, "logits", None))
    return ModelOutput(loss, logits, form=f"{type(out).__name__} with .loss" if loss is not None else
                       f"{type(out).__name__} with .logits")

def model_loss(output) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(loss the model computed, logits) from a model's output; either may be None."""
    o = read_output(output)
    return o.loss, o.logits
