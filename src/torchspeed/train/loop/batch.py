"""The batch contract: what a batch may look like and how a loss and metrics come out of it.

One home for the rules that `fit`, `Trainer`, `evaluate`, the tuners (`find_lr`,
`find_batch_size`), the doctor's `--verify` and the bench share (docs/models.md has the
model forms it covers, each trained in tests/train/test_model_zoo.py):

- **Batches.** A tuple/list `(inputs..., target)` calls `model(*inputs)`; a 1-tuple or a
  bare tensor calls `model(x)` with no target; a dict calls `model(**batch)` with the keys
  the model's `forward` accepts (Hugging Face style: `{"input_ids", "attention_mask",
  "labels"}`); its target is `labels` / `label` / `target` / `targets` / `y` when present.
  An input or target may be a list (detection: a list of variable-size images and a list of
  target dicts); the batch size is then the list's length. Moving to the device, channels_last
  (T23) and autocast (T21) reach every tensor in the structure (`transfer.to_device`).
- **Models that take their target.** When `forward`'s parameter right after the inputs (or a
  keyword-only one) is named `targets` / `target` / `labels` / `y` and the batch has a target,
  the call is `model(*inputs, target)`: GPT training scripts (`forward(idx, targets=None)`),
  torchvision's detection models (`forward(images, targets)`).
- **Losses.** A model that returns its own loss is trained on it: a 0-dim tensor, a tuple
  holding one (`(logits, loss)`), a dict with `"loss"`, a dict of losses (keys containing
  "loss", or every value a scalar as torchvision's RetinaNet, FCOS and SSD return; summed; each kept in
  `StepOutput.parts`), or an object with `.loss` (Hugging Face).
  Otherwise `loss_fn(logits, target)`; the default is cross-entropy, flattened when the
  output is a sequence of logits `(B, T, V)` for targets `(B, T)` (language models), per pixel
  for `(N, C, H, W)` logits and `(N, H, W)` masks. A dict of logits `{"out", "aux"}`
  (torchvision segmentation) is scored `loss_fn(out) + AUX_WEIGHT * loss_fn(aux)`.
- **Anything else**: `step_fn(model, batch)` returns the loss (or an output as above).
- **Metrics by task** (T13: counted on the device). Accuracy is counted only when the logits
  and target look like classification: integer targets and logits with one more (class)
  dimension, last (per token for sequences) or second (per pixel for masks); targets equal
  to -100 are padding and do not count. With `loss_fn=nn.BCEWithLogitsLoss()` (or `BCELoss`), the
  accuracy is per element, the output thresholded (binary and multi-label). A model's own logits
  feed the metrics too. A regression model gets its loss alone (`best_metric="auto"`: `val_loss`).
A model's output is read by `model_output.read_output`. How the contract read a model (the call, where the loss
came from) is recorded once as the `Decision` `decisions["batch_contract"]` (pass `decisions=` to `forward_loss`).

Example:
    >>> out = forward_loss(model, batch, loss_fn=None)
    >>> out.loss.backward(); out.correct()   # (correct on the device, counted), or None
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from torchspeed.train.trial.compile import CompileController, CompileDecision
from torchspeed.train.decision import Decision
from torchspeed.train.losses import IGNORE_INDEX, SequenceCrossEntropy, default_loss, loss_fn_shape_hint
from torchspeed.train.loop.batch_notes import first_step_notes
from torchspeed.train.transfer import map_tensors
from torchspeed.train.loop.model_call import call_model, takes_target
from torchspeed.train.loop.model_output import ModelOutput, read_output
from torchspeed.train.wrappers import unwrap_model

__all__ = ["StepOutput", "split_batch", "forward_loss", "batch_size", "count_correct",
           "list_inputs", "shifts_labels", "first_samples", "TARGET_KEYS", "AUX_WEIGHT"]

TARGET_KEYS = ("labels", "label", "target", "targets", "y")
AUX_WEIGHT = 0.5  # the auxiliary head's share of a {"out", "aux"} loss (torchvision's segmentation recipe)


def split_batch(batch) -> tuple[tuple | dict, object]:
    """(inputs, target): inputs are positional (a tuple) or keyword (a dict) arguments of the model.

    The target is a tensor, or a list (of target dicts, for detection); None when the batch has none."""
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


def _is_sample_list(v) -> bool:
    """A list of per-sample items: target dicts (detection), images of different sizes; never a named tuple."""
    if not isinstance(v, (list, tuple)) or not v or hasattr(v, "_fields"):
        return False
    if all(isinstance(e, Mapping) for e in v):
        return True
    return all(isinstance(e, torch.Tensor) and e.dim() >= 2 for e in v) and len({tuple(e.shape) for e in v}) > 1


def batch_size(batch) -> int:
    """The number of samples in `batch`: the length of a list of samples (target dicts, variable-size
    images), else the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if type(batch) in (list, tuple) and batch and all(type(v) is torch.Tensor for v in batch) and batch[0].dim():
        return batch[0].shape[0]  # (x, y) tensors, the common case: no sample lists to look for
    values = list(batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ())
    for v in values:
        if _is_sample_list(v):
            return len(v)
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim():
            return int(v.shape[0])
        if isinstance(v, (list, tuple, Mapping)):
            n = batch_size(v)
            if n:
                return n
    return 0


def first_samples(batch, n: int):
    """The batch cut to its first `n` samples, copied (a forward that writes its input leaves the batch as it was):
    every tensor (and list of samples) whose first dimension is the batch's size; any other tensor whole. A batch
    holding a sparse tensor (a graph's adjacency, whose rows are not samples) is copied whole."""
    sparse = []
    map_tensors(batch, lambda t: sparse.append(t.layout != torch.strided))
    return _cut(batch, -1 if any(sparse) else batch_size(batch), n)


def _cut(v, b: int, n: int):
    if isinstance(v, torch.Tensor):
        return (v[:n] if v.dim() and v.shape[0] == b else v).clone()
    if isinstance(v, Mapping):
        return {k: _cut(e, b, n) for k, e in v.items()}
    if isinstance(v, (list, tuple)):
        make = v._make if hasattr(v, "_fields") else type(v)  # a named tuple stays one
        if _is_sample_list(v) and len(v) == b:
            return make(_cut(e, -1, n) for e in v[:n])
        return make(_cut(e, b, n) for e in v)
    return v


def list_inputs(inputs) -> bool:
    """True when an input is a list of tensors (e.g. variable-size images) rather than one batched tensor."""
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    return any(isinstance(v, (list, tuple)) and v and all(isinstance(e, torch.Tensor) for e in v) for v in values)


def count_correct(logits: torch.Tensor | None, target, binary: str | None = None, *, max_elements: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | int] | None:
    """(correct, counted) when this looks like classification, else None: `correct` a device tensor, `counted`
    the batch size (an int) for one target per sample, else a device tensor (tokens or pixels, padding left out).

    Classification: integer targets, logits with one extra class dimension: last (`(B, C)` for
    `(B,)`, `(B, T, V)` for `(B, T)`: every token counts) or second (`(N, C, H, W)` for `(N, H, W)`:
    every pixel counts). Targets equal to -100 are padding and do not count. `binary` (the loss is
    `BCEWithLogitsLoss`: "logits", or `BCELoss`: "probs"): float 0/1 targets of the output's shape, one decision
    per element at 0 (logits) or 0.5 (probabilities), the target read at 0.5 (soft labels too).

    `max_elements`: count only the batch's first samples, as many as hold that many output elements (one at least):
    the training loop's per-step count (`TRAIN_COUNT_ELEMENTS`) reads a bounded part of a dense output (a
    segmentation map, a language model's vocabulary logits) instead of all of it. The predicted class is
    `max(dim).indices`, which equals `argmax(dim)` (the first maximum on ties) and on the CPU costs a fraction of it
    over a dimension that is not the last (a (4, 5, 64, 64) map: 0.05 against 1.2 ms) and in bf16 (a (8, 64, 50257)
    LM output: 11 against 46 ms), measured on a 2-core EPYC.
    """
    if max_elements is not None and isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor) and \
            logits.dim() >= 1 and target.dim() >= 1 and logits.shape[0] == target.shape[0] and \
            logits.numel() > max_elements:
        rows = max(1, max_elements // max(1, logits[0].numel()))
        logits, target = logits[:rows], target[:rows]
    if binary and isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor) and \
            logits.shape == target.shape:
        pred = logits.detach() > (0.0 if binary == "logits" else 0.5)
        return (pred == (target > 0.5)).sum(), target.numel()
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor) or \
            target.is_floating_point() or target.is_complex() or logits.dim() != target.dim() + 1:
        return None
    if logits.shape[:-1] == target.shape and logits.shape[-1] >= 2:
        pred = logits.detach().max(-1).indices
    elif logits.dim() >= 3 and logits.shape[0] == target.shape[0] and logits.shape[2:] == target.shape[1:] \
            and logits.shape[1] >= 2:
        pred = logits.detach().max(1).indices  # per pixel (the class dimension second, as F.cross_entropy reads it)
    else:
        return None
    if target.dim() == 1:  # every sample counts: the count is the batch size, known on the host
        return (pred == target).sum(), target.shape[0]
    valid = target != IGNORE_INDEX
    return ((pred == target) & valid).sum(), valid.sum()


@dataclass
class StepOutput:
    loss: torch.Tensor
    logits: torch.Tensor | None
    target: object  # a tensor, a list of target dicts, or None
    n: int  # samples in the batch
    parts: dict[str, torch.Tensor] | None = field(default=None)  # the named losses a model summed (detection)
    own_loss: bool = False  # the model computed the loss (loss_fn and label smoothing play no part)
    binary: str | None = None  # "logits" / "probs": loss_fn is BCEWithLogitsLoss / BCELoss (accuracy per element)

    def correct(self, max_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        return count_correct(self.logits, self.target, self.binary, max_elements=max_elements)


def _binary(loss_fn: Callable | None) -> str | None:  # how a binary loss reads the output (StepOutput.binary)
    if isinstance(loss_fn, nn.BCEWithLogitsLoss) or loss_fn is F.binary_cross_entropy_with_logits:
        return "logits"
    return "probs" if isinstance(loss_fn, nn.BCELoss) or loss_fn is F.binary_cross_entropy else None


def _from_step_fn(model: Callable, batch, step_fn: Callable) -> tuple[StepOutput, str]:
    if isinstance(model, CompileController):  # the step is handed the module that runs, as its own loop would
        model = model.for_step_fn()
    out = step_fn(model, batch)
    o = read_output(out)
    loss = o.loss
    if loss is None and isinstance(out, torch.Tensor):
        loss = out.mean() if out.numel() == 1 else None
    if loss is None:
        shape = ""
        if torch.is_tensor(out):
            shape = f" of shape {tuple(out.shape)}: reduce it to one value (.mean())"
        elif isinstance(out, (float, int)):
            shape = ": return the loss tensor itself, not loss.item() or float(loss) (fit runs its backward)"
        raise TypeError("step_fn(model, batch) must return the loss: a 0-dim tensor, a dict with 'loss', or an "
                        f"object with .loss; it returned {type(out).__name__}{shape}")
    target = split_batch(batch)[1] if o.logits is not None else None
    return StepOutput(loss, o.logits, target, batch_size(batch), o.parts, own_loss=True), \
        "step_fn(model, batch) returns the loss"


def _score(model: Callable, o: ModelOutput, out, target, loss_fn: Callable | None) -> tuple[torch.Tensor, str]:
    """The loss of a model that returned logits (no loss of its own)."""
    if o.logits is None:
        raise TypeError(f"the model returned {type(out).__name__} ({o.form or 'no tensor'}) with no loss and no "
                        "logits: return logits (a tensor), a loss, or a dict/object with 'loss' or 'logits'; or "
                        "pass step_fn(model, batch) that returns the loss" + _eval_hint(model))
    if target is None:
        raise ValueError("the batch has no target and the model returned no loss: yield (inputs..., target), "
                         f"a dict with one of {list(TARGET_KEYS)}, let the model return its loss, or pass "
                         "step_fn(model, batch)")
    fn = loss_fn or default_loss()
    name = "loss_fn" if loss_fn is not None and not isinstance(loss_fn, SequenceCrossEntropy) else "cross-entropy"
    if o.aux is not None:
        return fn(o.logits, target) + AUX_WEIGHT * fn(o.aux, target), \
            f"{name} on 'out' + {AUX_WEIGHT} x {name} on 'aux' (per pixel for masks)"
    extra = "; the output's 0-dim tensor is not added (step_fn= adds it)" if "0-dim" in o.form else ""
    try:
        return fn(o.logits, target), f"{name}(logits, target){extra}"
    except (ValueError, RuntimeError) as e:  # a binary model's (B, 1) against (B,) labels: name the squeeze
        hint = loss_fn_shape_hint(o.logits, target) if isinstance(target, torch.Tensor) else None
        if hint is None:
            raise
        raise ValueError(f"{e}: {hint}") from e


def _extra_scalar(o: ModelOutput, loss_fn: Callable | None, param: str | None) -> bool:
    """A tuple's 0-dim tensor is the model's loss only when the model was handed the target or no loss_fn was
    given: else (`(logits, aux_loss)` with loss_fn=) loss_fn scores the logits and the scalar is not added."""
    given = loss_fn is not None and not isinstance(loss_fn, SequenceCrossEntropy)
    return given and param is None and o.logits is not None and o.form.startswith("a tuple")


def _eval_hint(model) -> str:
    if getattr(unwrap_model(model), "training", True):
        return ""
    return (". In eval mode some models (torchvision's detection models) return predictions, not losses: "
            "score them with step_fn(model, batch) or your own metric, or leave val_loader out")


_NOT_RUN = object()  # forward_loss's `out`: the model has not run on the batch yet


def forward_loss(model: Callable, batch, *, loss_fn: Callable | None = None, step_fn: Callable | None = None,
                 decisions: dict | None = None, out=_NOT_RUN) -> StepOutput:
    """Run `model` on `batch` by the contract above; return the loss, logits and target.

    `decisions`: a dict (the trainer's) that gets `"batch_contract"`, how the model was read, once. `out`: the
    model's output on `batch` where it has already run."""
    if step_fn is not None:
        res, why = _from_step_fn(model, batch, step_fn)
        _record(decisions, "step_fn", why)
        return res
    if out is _NOT_RUN and loss_fn is not None and (decisions is None or "batch_contract" in decisions):
        fast = _logits_step(model, batch, loss_fn, decisions)  # the contract is read: the common case first
        if fast is not None:
            return fast
    inputs, target = split_batch(batch)
    param = takes_target(model, len(inputs)) if target is not None and not isinstance(inputs, dict) else None
    if isinstance(model, CompileController) and model.undecided and list_inputs(inputs):
        _no_compile_trial(model)
    try:
        out = call_model(model, inputs, target, param) if out is _NOT_RUN else out
        o = read_output(out)
        if o.loss is not None and _extra_scalar(o, loss_fn, param):  # the user's loss_fn scores the logits
            o = ModelOutput(None, o.logits, form=o.form)
        if o.loss is not None:
            loss, how = o.loss, f"the model returns its own loss ({o.form})"
        else:
            loss, how = _score(model, o, out, target, loss_fn)
    except Exception as e:
        if decisions is not None and "batch_contract" not in decisions:  # the first step: say how the batch was read
            first_step_notes(e, _call_text(inputs, param), inputs, target)
        raise
    logits, scored = o.logits, target
    if o.loss is not None and logits is not None:
        how += "; its logits feed the metrics"
        if shifts_labels(model) and isinstance(target, torch.Tensor) and target.dim() == 2 and logits.dim() == 3 \
                and logits.shape[:2] == target.shape:
            logits, scored = logits[:, :-1], target[:, 1:]  # the logits at t predict labels[t + 1]
            how += " (the logits at t against labels[t + 1]: the model shifts its labels)"
    if decisions is not None and "batch_contract" not in decisions:
        _check_own_loss(model, o, loss)
        _record(decisions, _call_text(inputs, param), how, lists=list_inputs(inputs), parts=o.parts)
    return StepOutput(loss, logits, scored, batch_size(batch), o.parts, own_loss=o.loss is not None,
                      binary=None if o.loss is not None else _binary(loss_fn))


def _check_own_loss(model: Callable, o: ModelOutput, loss: torch.Tensor) -> None:
    """A loss read from the model's output that autograd cannot train on (a metric, a detached value) is named with
    the fix on the first step, not left to backward's "does not require grad"."""
    if o.loss is None or loss.requires_grad or not torch.is_grad_enabled():
        return
    params = getattr(model, "parameters", None)
    if params is None or not any(p.requires_grad for p in params()):
        return  # nothing to train: fit says so before any step
    fix = "pass loss_fn=torch.nn.CrossEntropyLoss() (or your loss) to score its logits, the 0-dim tensor then not " \
        "added; " if o.logits is not None and o.form.startswith("a tuple") else ""
    raise ValueError(f"the model returned {o.form}, read as its loss, but that loss does not require grad (it was "
                     "computed without the weights, or detached), so training cannot follow it: "
                     f"{fix}return a loss computed from the weights; or pass step_fn(model, batch) that returns the "
                     "loss")


def _logits_step(model: Callable, batch, loss_fn: Callable, decisions: dict | None) -> StepOutput | None:
    """The common case in fewer steps, once the contract is read (what the general path computes for it): an
    `(x, y)` batch of tensors, a model that does not take the target and returns logits. None: another batch,
    for the general path; a model that returned another form is read by the general path from its output."""
    if type(batch) not in (list, tuple) or len(batch) != 2:
        return None
    x, target = batch
    if type(x) is not torch.Tensor or type(target) is not torch.Tensor or not x.dim() or \
            takes_target(model, 1) is not None:
        return None
    out = model(x)
    if type(out) is not torch.Tensor or not out.dim():
        return forward_loss(model, batch, loss_fn=loss_fn, decisions=decisions, out=out)
    return StepOutput(loss_fn(out, target), out, target, x.shape[0], binary=_binary(loss_fn))


def shifts_labels(model: Callable) -> bool:
    """A Hugging Face causal LM (`...ForCausalLM`, `...LMHeadModel`): it shifts `labels` by one inside its
    loss, so its accuracy compares the logits at t with labels[t + 1]."""
    inner = unwrap_model(model)
    name = type(inner).__name__
    return hasattr(inner, "config") and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))


def _call_text(inputs, param: str | None) -> str:
    if isinstance(inputs, dict):
        return "model(**batch)"
    args = ", ".join(["x"] * len(inputs)) if len(inputs) == 1 else ", ".join(f"x{i}" for i in range(len(inputs)))
    return f"model({args}, {param})" if param else f"model({args})"


def _no_compile_trial(controller) -> None:
    """compile="auto" on list inputs: not applicable (each image size and list length is a new graph)."""
    controller.apply(CompileDecision(False, "not applicable: the inputs are lists of variable-size tensors; a "
                                            "compiled graph would be traced again for each size and length"))


def _record(decisions: dict | None, call: str, why: str, *, lists: bool = False,
            parts: dict[str, torch.Tensor] | None = None) -> None:
    """decisions["batch_contract"] (once): the call and where the loss came from."""
    if decisions is None or "batch_contract" in decisions:
        return
    if lists:
        why += "; the inputs are lists of tensors (variable-size images), batched inside the model"
        layout = decisions.get("channels_last")
        if isinstance(layout, Decision) and layout.value is True:
            decisions.refine("channels_last", Decision(True, f"{layout.reason}; not applicable to the inputs (lists "
                                                             "of images, batched inside the model): the weights only",
                                                       layout.measured))
    measured = {k: float(v.detach().float()) for k, v in parts.items()} if parts else None  # once: one sync
    decisions["batch_contract"] = Decision(call if call == "step_fn" else f"called as {call}", why, measured)
