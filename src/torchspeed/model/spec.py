"""A model by spec (the CLI's `--model`, `load_model`): a built-in name, or your own model as
`package.module:factory` or `path/to/file.py:factory`.

No technique of its own (docs/techniques.md): it only decides which model the techniques act on.

The factory is called with `num_classes=N` when it takes that argument, else with no
argument, and must return an `nn.Module`. A module name is imported with the current
folder first on the import path (as `python -m` does), so `--model mymod:make_net` finds
`./mymod.py`. A file path is imported as a module of its own. Every mistake (no such
module or file, no such function, a factory that fails or returns something else) is a
`ValueError` naming the spec and the fix, for the CLI's one-line error.

Example:
    >>> build_model("mymod:make_net", num_classes=4)
    >>> build_model("models/net.py:Net", num_classes=4)
    >>> build_model("resnet18", num_classes=4)        # torchvision / timm / simple_cnn
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import zlib
from pathlib import Path

from torch import nn

from torchspeed._extras import require

__all__ = ["is_custom", "split_spec", "build_model", "portable_spec", "create_classifier", "simple_cnn"]


def is_custom(spec: str) -> bool:
    """True for `module:factory` or `file.py:factory` (a built-in name has no colon)."""
    return ":" in spec


def split_spec(spec: str) -> tuple[str, str]:
    where, _, fn = spec.rpartition(":")
    if not where or not fn.isidentifier():
        raise ValueError(f"model {spec!r}: expected package.module:function or path/to/file.py:function")
    return where, fn


def portable_spec(spec: str) -> str:
    """The spec with a file path made absolute, so a saved run rebuilds from any folder."""
    if not is_custom(spec):
        return spec
    where, fn = split_spec(spec)
    return f"{os.path.abspath(where)}:{fn}" if where.endswith(".py") else spec


def _import(where: str, spec: str):
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"model {spec!r}: no such file {where}; pass an existing .py file")
        name = f"_torchspeed_user_{zlib.crc32(str(path.resolve()).encode()):08x}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise ValueError(f"model {spec!r}: importing {where} failed ({type(e).__name__}: {e})") from None
        return module
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ValueError(f"model {spec!r}: no module named {e.name!r}; run from the folder that holds "
                         f"{where.replace('.', '/')}.py, or pass path/to/file.py:function") from None
    except Exception as e:
        raise ValueError(f"model {spec!r}: importing {where} failed ({type(e).__name__}: {e})") from None
    finally:
        if added:
            sys.path.remove(cwd)


def build_model(spec: str, *, num_classes: int) -> nn.Module:
    """The model `spec` names, with `num_classes` outputs (see the module docstring)."""
    if not is_custom(spec):
        return create_classifier(spec, num_classes=num_classes)
    where, fn = split_spec(spec)
    module = _import(where, spec)
    factory = getattr(module, fn, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"model {spec!r}: {where} has no function {fn!r}"
                         + (f"; it defines {', '.join(names[:8])}" if names else ""))
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes = "num_classes" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    try:
        model = factory(num_classes=num_classes) if takes else factory()
    except Exception as e:
        raise ValueError(f"model {spec!r}: {fn}({'num_classes=' + str(num_classes) if takes else ''}) raised "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {spec!r}: {fn} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def simple_cnn(num_classes: int, *, width: int = 32) -> nn.Module:
    """A small 4-block CNN (about 30k parameters at width 32): quick to train on a CPU."""
    def block(i: int, o: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                             nn.MaxPool2d(2))

    w = width
    return nn.Sequential(block(3, w // 2), block(w // 2, w), block(w, w), block(w, 2 * w),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, num_classes))


def create_classifier(name: str, *, num_classes: int) -> nn.Module:
    """`name` from torchvision (`torchvision.models.list_models()`), timm (`timm.list_models()`) or "simple_cnn".

    Always randomly initialised (nothing is downloaded).

    Example:
        >>> create_classifier("resnet18", num_classes=10)      # torchvision
        >>> create_classifier("convnext_atto", num_classes=10)  # timm
    """
    if name == "simple_cnn":
        return simple_cnn(num_classes)
    torchvision = require("torchvision", "data", feature=f"model {name!r}")
    if name in torchvision.models.list_models():
        return torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    timm = require("timm", "timm", feature=f"model {name!r} (not a torchvision name)")
    if timm.is_model(name):
        return timm.create_model(name, pretrained=False, num_classes=num_classes)
    import difflib

    names = list(dict.fromkeys(torchvision.models.list_models() + timm.list_models() + ["simple_cnn"]))
    close = difflib.get_close_matches(name, names, n=3)  # one of each: timm and torchvision share names
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ValueError(f"unknown model {name!r}: not a torchvision or timm model name{hint}")
