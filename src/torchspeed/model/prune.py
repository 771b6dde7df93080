"""Structured pruning: remove whole channels, so the layers that remain are narrower dense layers (T38).

Unstructured sparsity (zeroed weights) leaves a dense kernel the same size and buys nothing on a CPU
or without sparse kernels; removing channels makes every convolution and matrix multiply smaller.
`prune_channels` does it through Torch-Pruning's dependency graph (the `slim` extra), which prunes
coupled layers together: the convolutions on both sides of a residual sum, the BatchNorm after a
convolution, the input features of the next layer.

- **Importance**: "magnitude" (the L2 norm of each channel group's weights: no data needed) or
  "taylor" (|weight x gradient| summed over the group, the gradients of a few real batches: what
  removing the channel costs the loss, to first order).
- **Layers kept whole**: the classifier (the last `nn.Linear`, else the last convolution: its
  outputs are the classes) and the caller's `ignored_layers` (modules or their names).
- **Channels rounded to multiples of 8** (`round_to`): the widths the vector units and Tensor
  Cores tile by (T24); an odd width can be slower than the wider one.

MACs are not time: a prune is chosen by measuring the step (`torchspeed.slim` does). Cost: one
symbolic trace of the model and, for "taylor", a forward and backward per batch.

A pruned model's layers no longer match its class's constructor: `narrowed_state_dict` saves the
widths with the weights, and `load_narrowed_state_dict` narrows a freshly built model to them
before loading, so a checkpoint loads with `torch.load(..., weights_only=True)`.

Example:
    >>> small = prune_channels(model, torch.randn(1, 3, 32, 32), ratio=0.5)
    >>> torch.save(narrowed_state_dict(small), "small.pt")
    >>> load_narrowed_state_dict(build_model(), torch.load("small.pt", weights_only=True))
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from torchspeed._extras import require
from torchspeed.train.loop.batch import forward_loss
from torchspeed.train.loop.step import backward
from torchspeed.train.transfer import to_device

__all__ = ["IMPORTANCES", "prune_channels", "find_classifier", "check_ratio", "check_example_inputs",
           "narrowed_state_dict", "load_narrowed_state_dict", "channel_widths", "is_channels_last"]

IMPORTANCES = ("magnitude", "taylor")
ROUND_TO = 8
# The attributes that say a layer's width (kept with a narrowed state_dict, set back before loading it).
_WIDTHS = ("in_channels", "out_channels", "in_features", "out_features", "num_features", "normalized_shape",
           "groups", "embedding_dim", "num_channels")


def check_ratio(ratio: float) -> float:
    """`ratio` as a float, or a ValueError naming the fix when it is not a share of the channels in (0, 1)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) < 1.0:
        raise ValueError(f"ratio={ratio!r}: the share of each layer's channels to remove must be above 0 and "
                         "below 1 (ratio=0.5 halves every layer's width); for no pruning do not call slim")
    return float(ratio)


def check_example_inputs(model: nn.Module, example_inputs) -> torch.Tensor:
    """One forward of `example_inputs` in eval mode, without gradients: the output, or a ValueError that says
    which shape the model takes (the first layer's input width) and how to pass it."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
            out = model(*args)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        shape = tuple(example_inputs.shape) if isinstance(example_inputs, torch.Tensor) else type(example_inputs)
        first = next((m for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))),
                     None)
        want = (f" (its first layer, {type(first).__name__}, takes "
                f"{getattr(first, 'in_channels', getattr(first, 'in_features', '?'))} input channels/features)"
                if first is not None else "")
        raise ValueError(f"example_inputs of shape {shape} do not run through the model{want}: "
                         f"{str(e).splitlines()[0]}. Pass a batch of inputs as your training loop feeds the model "
                         "(e.g. the inputs of one batch of your loader: example_inputs=next(iter(loader))[0])") from e
    finally:
        model.train(was)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the model returns {type(out).__name__}, not a tensor of logits: slim prunes models "
                         "whose forward returns one tensor (wrap the model so that it does)")
    return out


def find_classifier(model: nn.Module) -> nn.Module | None:
    """The layer whose outputs are the model's outputs: the last `nn.Linear`, else the last convolution."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1]
    convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    return convs[-1] if convs else None


def _resolve_ignored(model: nn.Module, ignored: Iterable[nn.Module | str]) -> list[nn.Module]:
    out = []
    for layer in ignored:
        if isinstance(layer, str):
            try:
                layer = model.get_submodule(layer)
            except AttributeError:
                names = [n for n, _ in model.named_modules() if n][:8]
                raise ValueError(f"ignored_layers names {layer!r}, which the model does not have; "
                                 f"use module names as model.named_modules() gives them (e.g. {names})") from None
        if not any(layer is m for m in model.modules()):
            raise ValueError(f"ignored_layers holds a {type(layer).__name__} that is not part of the model: "
                             "pass the model's own modules (or their names)")
        out.append(layer)
    return out


def _importance(tp, kind: str):
    if kind == "magnitude":
        return tp.importance.MagnitudeImportance(p=2)
    if kind == "taylor":
        return tp.importance.TaylorImportance()
    raise ValueError(f"importance={kind!r}: use one of {IMPORTANCES}")


def _accumulate_gradients(model: nn.Module, batches: Sequence, loss_fn: Callable | None) -> None:
    """Gradients of the loss over `batches` on the model's weights (Taylor importance reads them)."""
    if not batches:
        raise ValueError("importance='taylor' needs a few real batches to take gradients on: pass batches=[...] "
                         "(e.g. the first 4 batches of your training loader), or importance='magnitude'")
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    for batch in batches:
        backward(forward_loss(model, to_device(batch, device, non_blocking=False), loss_fn=loss_fn).loss,
                 accum_steps=len(batches))


def prune_channels(model: nn.Module, example_inputs, *, ratio: float, importance: str = "magnitude",
                   batches: Sequence | None = None, loss_fn: Callable | None = None,
                   ignored_layers: Iterable[nn.Module | str] = (), round_to: int | None = ROUND_TO,
                   inplace: bool = False) -> nn.Module:
    """`model` with `ratio` of every prunable layer's channels removed (a copy unless `inplace`).

    The classifier and `ignored_layers` keep their widths; the widths that remain are multiples of
    `round_to`. "taylor" importance takes gradients on `batches` ((inputs..., target) tuples; `loss_fn`
    as in `fit`, default cross-entropy).
    """
    tp = require("torch_pruning", "slim", feature="structured pruning (torchspeed.slim)")
    ratio = check_ratio(ratio)
    kind = _importance(tp, importance)
    check_example_inputs(model, example_inputs)
    target = model if inplace else copy.deepcopy(model)
    ignored = _resolve_ignored(model, ignored_layers)
    if not inplace:  # the same modules in the copy, found by name
        names = {id(m): n for n, m in model.named_modules()}
        ignored = [target.get_submodule(names[id(m)]) for m in ignored]
    head = find_classifier(target)
    keep = ignored + ([head] if head is not None and not any(head is m for m in ignored) else [])
    pruner = tp.pruner.BasePruner(target, example_inputs, importance=kind, pruning_ratio=ratio,
                                  ignored_layers=keep, round_to=round_to)
    was = target.training
    if importance == "taylor":
        target.train()
        _accumulate_gradients(target, list(batches or ()), loss_fn)
    pruner.step()
    target.zero_grad(set_to_none=True)
    target.train(was)
    if is_channels_last(model):  # the pruned weights are new NCHW tensors: keep the original's layout (T23)
        target.to(memory_format=torch.channels_last)
    return target


def is_channels_last(model: nn.Module) -> bool:
    """Whether the model's first 2D convolution holds its weight channels_last (fit may have made it so)."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return conv is not None and conv.weight.dim() == 4 and conv.weight.shape[1] > 1 and \
        conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()


def channel_widths(model: nn.Module) -> dict[str, int]:
    """Each convolution's and linear layer's output width, by module name."""
    return {n: int(getattr(m, "out_channels", getattr(m, "out_features", 0))) for n, m in model.named_modules()
            if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear))}


def narrowed_state_dict(model: nn.Module) -> dict:
    """`{"state_dict", "widths"}`: the weights and every layer's width attributes (plain ints and tuples), so
    `load_narrowed_state_dict` can narrow a freshly built model to them; loads with `weights_only=True`."""
    widths = {}
    for name, m in model.named_modules():
        attrs = {a: getattr(m, a) for a in _WIDTHS if isinstance(getattr(m, a, None), (int, tuple))}
        if attrs:
            widths[name] = attrs
    return {"state_dict": model.state_dict(), "widths": widths}


def load_narrowed_state_dict(model: nn.Module, saved: dict) -> nn.Module:
    """Narrow `model` (as its constructor builds it) to the saved widths, then load the saved weights."""
    if not isinstance(saved, dict) or not {"state_dict", "widths"} <= set(saved):
        raise ValueError("this is not a narrowed state_dict: save a pruned model with narrowed_state_dict(model) "
                         "(a plain model.state_dict() has no widths to narrow a fresh model to)")
    state, modules = saved["state_dict"], dict(model.named_modules())
    for name, attrs in saved["widths"].items():
        if name not in modules:
            raise ValueError(f"the saved model has a layer {name!r} that this model lacks: build the same "
                             "architecture the pruned model came from, then load")
        module = modules[name]
        for a, v in attrs.items():
            setattr(module, a, tuple(v) if isinstance(v, list) else v)
        for key, tensors in (("_parameters", module._parameters), ("_buffers", module._buffers)):
            for t_name, t in list(tensors.items()):
                full = f"{name}.{t_name}" if name else t_name
                if t is None or full not in state or state[full].shape == t.shape:
                    continue
                fresh = torch.empty(state[full].shape, dtype=t.dtype, device=t.device)
                tensors[t_name] = nn.Parameter(fresh, requires_grad=t.requires_grad) if key == "_parameters" \
                    else fresh
    model.load_state_dict(state)
    return model
