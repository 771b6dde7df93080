"""Optional dependencies: one helper that imports one, or fails with the one line that says what to install.

The core install is torch, numpy and rich: enough for `fit`, the doctor and `env`. Every
other package belongs to a feature and to the extra that installs it (pyproject.toml):

| extra | packages | features |
|---|---|---|
| `data` | torchvision, Pillow, simplejpeg, OpenCV, scikit-image | `torchspeed.data`, `torchspeed train --data`, image folders in `tune` |
| `plot` | matplotlib | `find_lr(plot=...)`, the bench's PNG |
| `bench` | scikit-learn, torchvision, matplotlib | `torchspeed bench` (the digits workload, the torchvision ResNets, the PNG) |
| `timm` | timm | the LAMB/LARS optimizers, timm model names |
| `tensorboard` | tensorboard | `torchspeed.train.loggers.TensorBoardLogger` |
| `slim` | torch-pruning | `torchspeed.slim` (structured pruning) |
| `einops` | einops | the doctor's einops finding's measured fix; models built with `einops.layers` |
| `all` | all of the above | |

Example:
    >>> cv2 = require("cv2", "data")      # the module, or MissingExtraError:
    ... # cv2 (OpenCV) is not installed; it comes with torchspeed's `data` extra: pip install 'torchspeed[data]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require", "MissingExtraError", "EXTRAS"]

# The extra that installs each optional top-level module (kept in step with pyproject.toml by a test).
EXTRAS = {"torchvision": "data", "PIL": "data", "simplejpeg": "data", "cv2": "data", "skimage": "data",
          "matplotlib": "plot", "sklearn": "bench", "timm": "timm", "tensorboard": "tensorboard",
          "schedulefree": "schedulefree", "torch_pruning": "slim", "einops": "einops"}
_PACKAGES = {"PIL": "Pillow", "cv2": "OpenCV", "skimage": "scikit-image", "sklearn": "scikit-learn",
             "torch_pruning": "torch-pruning"}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the `pip install` that adds it."""


def require(module: str, extra: str | None = None, *, feature: str | None = None) -> ModuleType:
    """Import `module` (e.g. "cv2", "timm.optim"); if its package is missing, raise `MissingExtraError`.

    `extra` defaults to the one in `EXTRAS` for the module's top-level package; `feature`
    names what needed it ("find_lr(plot=...)"). Errors inside an installed package propagate.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise  # the package is there but one of its own dependencies is broken
        extra = extra or EXTRAS.get(top, "all")
        package = f"{top} ({_PACKAGES[top]})" if top in _PACKAGES else top
        need = f"{feature} needs {package}, which is not installed" if feature else f"{package} is not installed"
        raise MissingExtraError(f"{need}; it comes with torchspeed's `{extra}` extra: "
                                f"pip install 'torchspeed[{extra}]'", name=top) from None
