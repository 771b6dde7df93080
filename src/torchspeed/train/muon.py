"""Muon with AdamW as one optimizer (T42): `MuonAdamW` steps torch's `torch.optim.Muon` (its Newton-Schulz
iterations batched over the matrices: `muon_batched.BatchedMuon`) over the hidden weight matrices and AdamW over
everything else (embeddings, the output head, biases, norms, conv kernels), with one set
of param groups and one state, so schedulers, clipping, GradScaler and checkpoints use it like any other.

optim.py says which parameters are hidden matrices (`hidden_matrices`) and builds it by name
(`create_optimizer("muon", model, ...)`).
"""

from __future__ import annotations

import torch

from torchspeed.train.muon_batched import BatchedMuon
from torchspeed.train.optim_kernel import _fused_or_foreach

__all__ = ["MUON_MOMENTUM", "MuonAdamW"]

MUON_MOMENTUM = 0.95  # torch's and Keller Jordan's default


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon over the hidden matrices and AdamW over the rest, as one optimizer (T42).

    `param_groups` are Muon's groups followed by AdamW's (the same dict objects), and both inner
    optimizers share this optimizer's `state`, so the base class's `state_dict`,
    `load_state_dict` and `zero_grad`, a scheduler writing `group["lr"]`, clipping and a
    GradScaler (`unscale_`, `step`) all see every parameter. Every group has a "momentum": Muon's
    momentum, or AdamW's beta1, which `step` copies into the group's "betas" first, so a scheduler
    that cycles momentum (one-cycle, cyclic) drives both parts. `muon` and `adamw` are the inner
    optimizers.

    Example:
        >>> hidden, other = hidden_matrices(model)
        >>> opt = MuonAdamW([p for _, p in hidden], param_groups_of(other), lr=1e-3, weight_decay=0.05)
    """

    def __init__(self, muon_params, adamw_groups, *, lr: float, weight_decay: float = 0.05,
                 momentum: float = MUON_MOMENTUM, betas: tuple[float, float] = (0.9, 0.999),
                 adjust_lr_fn: str = "match_rms_adamw", fused: bool | str = "auto"):
        muon_params = list(muon_params)
        if not muon_params:
            raise ValueError("Muon got no parameters: the model has no hidden 2-D weight matrices (only "
                             "embeddings, the output head, biases, norms or conv kernels); use optimizer='adamw'")
        self.muon = BatchedMuon(muon_params, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                     nesterov=True, adjust_lr_fn=adjust_lr_fn)
        adamw_groups = [g for g in adamw_groups if g["params"]]
        self.adamw = (_fused_or_foreach(torch.optim.AdamW, adamw_groups,
                                        {"lr": lr, "weight_decay": weight_decay, "betas": betas}, fused)
                      if adamw_groups else None)
        groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])
        for g in self.adamw.param_groups if self.adamw else []:
            g["momentum"] = g["betas"][0]  # one key for both parts: what schedulers cycle
        self._n_muon = len(self.muon.param_groups)
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        self._link()
        self._built = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise ValueError("MuonAdamW cannot take a new param group (neither Muon nor AdamW would step it): "
                             "build a new optimizer over the whole model with create_optimizer('muon', model, ...)")
        super().add_param_group(param_group)

    def _link(self) -> None:
        """Point the inner optimizers at this optimizer's groups and state (after a load replaced them)."""
        self.muon.param_groups = self.param_groups[: self._n_muon]
        self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = self.param_groups[self._n_muon:]
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.adamw is not None:
            for g in self.adamw.param_groups:
                if g["momentum"] != g["betas"][0]:
                    g["betas"] = (g["momentum"], *g["betas"][1:])
            self.adamw.step()
        self.muon.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "muon" in self.__dict__:
            self._link()

    def describe(self) -> str:
        n_muon = sum(len(g["params"]) for g in self.muon.param_groups)
        if self.adamw is None:
            return f"Muon ({n_muon} hidden matrices)"
        n_adamw = sum(len(g["params"]) for g in self.adamw.param_groups)
        d = self.adamw.defaults
        kind = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"
        return f"Muon ({n_muon} hidden matrices) + AdamW ({kind}, {n_adamw} other tensors)"
