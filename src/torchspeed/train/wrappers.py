"""The user's module inside the wrappers training puts around it (T25 compile, T31 DDP).

DistributedDataParallel and DataParallel keep it as `.module`, torch.compile's
`OptimizedModule` as `._orig_mod`, torchspeed's `CompileController` as `.wrapped_module`;
their state dicts prefix every key with "module." or "_orig_mod.". This is the one place
that knows those names: evaluation, checkpoints, the batch contract and the tuners ask here.

Example:
    >>> torch.save(unwrap_model(trainer.model).state_dict(), "model.pt")  # no "module." prefixes
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["unwrap_model", "strip_wrapper_prefixes", "is_compiled"]

_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel / DataParallel, torch.compile


def unwrap_model(model):
    """The plain module inside DDP / DataParallel / torch.compile / CompileController wrappers."""
    for _ in range(8):  # wrappers nest a few deep at most
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(getattr(model, "wrapped_module", None), nn.Module):  # torchspeed's CompileController
            model = model.wrapped_module
        else:
            break
    return model


def is_compiled(model) -> bool:
    """True for a torch.compile'd module (an `OptimizedModule`)."""
    return isinstance(getattr(model, "_orig_mod", None), nn.Module)


def strip_wrapper_prefixes(state_dict: Mapping) -> dict:
    """`state_dict` with the wrappers' key prefixes removed, only where every key carries one
    (a submodule may itself be named "module")."""
    out = dict(state_dict)
    changed = True
    while changed and out:
        changed = False
        for p in _PREFIXES:
            if all(k.startswith(p) for k in out):
                out = {k[len(p):]: v for k, v in out.items()}
                changed = True
    return out
