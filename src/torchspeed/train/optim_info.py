"""One row per optimizer: the facts every rule reads about it, by name (T17, T18, T42).

timm's `OptimInfo` habit: an `OptimInfo` row holds what `torchspeed.train.optim.create_optimizer(name)` builds
(the class, or a factory over the model) and what the rules ask of it: the weight-decay default
(`default_weight_decay`), how its LR follows the batch (`lr_rule`: "linear" for SGD and LARS, "sqrt" for the Adam
family, T17), whether torch has a fused kernel for it (the fused switch, T18), whether it takes momentum or betas,
whether it needs no LR schedule (Schedule-Free), its own default LR and the extra it needs; `kernel_reason` says
why a built optimizer has its kernel (fused, or torch's own on a run given its LR). `OPTIMIZERS` (the
names) and `WEIGHT_DECAY` (name -> default) are live views of the registry.

The rows of torchspeed's optimizers are registered at the end of `torchspeed.train.optim` (importing
`torchspeed.train` loads them); `register_optimizer` adds another, which `create_optimizer`, `lr_rule` and
`default_weight_decay` then know with no other edit.

Example:
    >>> register_optimizer(OptimInfo("adagrad", torch.optim.Adagrad, lr_rule="linear"))
    >>> optimizer_info("adamw").lr_rule
    'sqrt'
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from torchspeed._extras import require

__all__ = ["OptimInfo", "OPTIM_INFO", "LR_RULES", "register_optimizer", "optimizer_info", "default_lr", "info_for",
           "kernel_reason", "optimizer_available", "OPTIMIZERS", "WEIGHT_DECAY", "default_weight_decay"]

LR_RULES = ("linear", "sqrt")


@dataclass(frozen=True)
class OptimInfo:
    """One optimizer's facts: what `create_optimizer(name)` builds and what every rule reads about it.

    `cls` is the class, or "module:Class" for an extra's class (imported when built, `extra` named if missing);
    `build`, when set, is a factory over the whole model (`build(model, fused=, **kwargs)`) instead of
    `cls(param_groups, **kwargs)`. The kwargs are lr and weight_decay, plus momentum (`momentum`), nesterov
    (`nesterov`) and betas (`betas`) where the row takes them.
    """

    name: str
    cls: type | str
    weight_decay: float = 0.0        # the default for weight_decay=None
    lr_rule: str = "linear"          # how its LR follows the batch (T17): "linear" (SGD, LARS) or "sqrt" (Adam family)
    fusable: bool = False            # torch has a fused kernel for it: fused="auto" asks for it (T18)
    fused_shards: bool = True        # the fused kernel takes FSDP2's DTensor shards
    momentum: bool = False           # takes `momentum`
    nesterov: bool = False           # takes `nesterov`
    betas: bool = False              # takes `betas`
    schedule_free: bool = False      # needs no LR schedule (Schedule-Free: train()/eval() around evaluation)
    default_lr: float | None = None  # its own default LR: a run that names it and no LR trains at it (None: 0.1)
    extra: str | None = None         # the extra it needs (pip install 'torchspeed[extra]'); None: torch alone
    build: Callable[..., torch.optim.Optimizer] | None = None

    def __post_init__(self):
        if self.lr_rule not in LR_RULES:
            raise ValueError(f"OptimInfo {self.name!r}: lr_rule must be one of {LR_RULES}, got {self.lr_rule!r}")
        if isinstance(self.cls, str) and (":" not in self.cls or not self.extra):
            raise ValueError(f"OptimInfo {self.name!r}: a class by name is 'module:Class' with the extra that "
                             f"installs it, got cls={self.cls!r}, extra={self.extra!r}")

    def resolve(self) -> type:
        """The optimizer class (imports an extra's module; a missing one raises `MissingExtraError` naming it)."""
        if not isinstance(self.cls, str):
            return self.cls
        module, _, attr = self.cls.partition(":")
        return getattr(require(module, self.extra, feature=f"optimizer={self.name!r}"), attr)

    def kwargs(self, *, lr: float, weight_decay: float, momentum: float, nesterov: bool, betas) -> dict:
        """The keyword arguments this optimizer takes, from create_optimizer's."""
        kw: dict = {"lr": lr, "weight_decay": weight_decay}
        if self.momentum:
            kw["momentum"] = momentum
        if self.nesterov:
            kw["nesterov"] = nesterov and momentum > 0
        if self.betas:
            kw["betas"] = betas
        return kw


OPTIM_INFO: dict[str, OptimInfo] = {}  # name -> row; torchspeed's rows: the end of train/optim.py


def register_optimizer(info: OptimInfo) -> OptimInfo:
    """Add (or replace) a row: `create_optimizer(info.name)`, `lr_rule` and `default_weight_decay` then know it."""
    OPTIM_INFO[info.name.lower()] = info
    return info


def optimizer_info(name: str) -> OptimInfo:
    """The row for optimizer `name` (any case); an unknown name raises ValueError listing the known ones."""
    info = OPTIM_INFO.get(name.lower()) if isinstance(name, str) else None
    if info is None:
        raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIM_INFO)}; or pass a torch.optim.Optimizer")
    return info


def default_lr(optimizer: object) -> float:
    """The LR a run trains at when it gives none: the named optimizer's own default (`OptimInfo.default_lr`), else 0.1
    (SGD's; an optimizer object carries its own LR, and this is only a fallback for it)."""
    info = OPTIM_INFO.get(optimizer.lower()) if isinstance(optimizer, str) else None
    return info.default_lr if info is not None and info.default_lr is not None else 0.1


def info_for(optimizer: torch.optim.Optimizer | None) -> OptimInfo | None:
    """The row whose class `optimizer` is exactly (a subclass may own its step), or None."""
    for info in OPTIM_INFO.values():
        loaded = not isinstance(info.cls, str) or info.cls.partition(":")[0] in sys.modules  # never import for this
        if loaded and type(optimizer) is info.resolve():
            return info
    return None


def optimizer_available(name: str) -> bool:
    """Whether optimizer `name`'s extra (if any) is installed."""
    info = optimizer_info(name)
    if not isinstance(info.cls, str):
        return True
    return importlib.util.find_spec(info.cls.partition(":")[0].split(".")[0]) is not None


class _Names(Sequence):
    """The registry's names, live (OPTIMIZERS)."""

    def __getitem__(self, i):
        return tuple(OPTIM_INFO)[i]

    def __len__(self) -> int:
        return len(OPTIM_INFO)

    def __repr__(self) -> str:
        return repr(tuple(OPTIM_INFO))


class _Column(Mapping):
    """One column of the registry by name, live (WEIGHT_DECAY)."""

    def __init__(self, field: str):
        self._field = field

    def __getitem__(self, name: str):
        return getattr(OPTIM_INFO[name], self._field)

    def __iter__(self):
        return iter(OPTIM_INFO)

    def __len__(self) -> int:
        return len(OPTIM_INFO)

    def __repr__(self) -> str:
        return repr(dict(self))


OPTIMIZERS = _Names()
WEIGHT_DECAY = _Column("weight_decay")


def default_weight_decay(name: str) -> float:
    """The weight decay `create_optimizer(name, weight_decay=None)` uses (its row's; 0 for an unknown name)."""
    info = OPTIM_INFO.get(name.lower())
    return info.weight_decay if info else 0.0


def kernel_reason(fused: bool | str) -> str:
    """Why the optimizer has its kernel, for `fused_optimizer=fused` (the plan sets "default" on a run given its LR)."""
    if fused == "default":
        return ("rule: you set the LR, so the update is your loop's: torch's own kernel, bit for bit (the fused kernel "
                "rounds otherwise, which moves a run's accuracy per seed); fused_optimizer=True takes it")
    return "rule: fused kernel where torch has one (not for sparse gradients)" if fused == "auto" else "asked for"
