"""An eighth set of hand-written forms: a BYOL-style momentum target network the step updates in place before
its forward (the mean teacher of semi-supervised training has the same shape), experts kept in an
`nn.ParameterList`, the LR set by the step from its own iteration counter (nanoGPT's `get_lr(it)` written into
the optimizer's param groups), and an L2 penalty the step adds over the parameters. `zoo_hand.cases()` lists them
with the others.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo_hand_forms7 import mlp64
from zoo_cases import Case, adamw, kept_on_model, scripts_optimizer, sgd, stateless, vectors, xy_logits


class BYOL(nn.Module):
    """An online encoder and predictor, and a target encoder: a copy the step moves towards the online one."""

    def __init__(self):
        super().__init__()
        self.online = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 16))
        self.predictor = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, x):
        return self.predictor(self.online(x))


def byol_loss(model, x1, x2):
    p = F.normalize(model(x1), dim=-1)
    with torch.no_grad():
        t = F.normalize(model.target(x2), dim=-1)
    return (2 - 2 * (p * t).sum(-1)).mean()


def byol_step(model, batch):
    """The momentum update first (tau 0.99, in place), then the loss on two noisy views."""
    with torch.no_grad():
        for po, pt in zip(model.online.parameters(), model.target.parameters()):
            pt.mul_(0.99).add_(po, alpha=0.01)
    x, _ = batch
    return byol_loss(model, x + 0.1 * torch.randn_like(x), x + 0.1 * torch.randn_like(x))


def byol_probe(model, batch):
    """The loss against the target network as it ends: the momentum updates counted."""
    x, _ = batch
    return byol_loss(model, x, x)


class Experts(nn.Module):
    """Four expert matrices in an nn.ParameterList, mixed by a softmax gate."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 4)
        self.experts = nn.ParameterList(nn.Parameter(torch.randn(32, 64) * 0.1) for _ in range(4))
        self.out = nn.Linear(64, 10)

    def forward(self, x):
        w = F.softmax(self.gate(x), dim=-1)
        h = torch.stack([x @ e for e in self.experts], 1)  # (B, 4, 64)
        return self.out(F.relu((w.unsqueeze(-1) * h).sum(1)))


def lr_in_step():
    """nanoGPT's loop: the LR of iteration `it` (linear warm-up, cosine decay) written into the optimizer's groups
    by the step itself, which finds the script's optimizer on the model (`kept_on_model`)."""
    state = {"it": 0}

    def get_lr(it, warmup=10, decay=200, peak=1e-3, floor=1e-4):
        if it < warmup:
            return peak * (it + 1) / (warmup + 1)
        ratio = min(1.0, (it - warmup) / (decay - warmup))
        return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)

    def step_fn(model, batch):
        opt = scripts_optimizer(model)  # none under recipe="auto", which sets its own LR
        for group in opt.param_groups if opt is not None else ():
            group["lr"] = get_lr(state["it"])
        state["it"] += 1
        return xy_logits(model, batch)
    return step_fn


def l2_step(model, batch):
    """Cross-entropy plus an L2 penalty the script writes over every weight matrix."""
    penalty = sum(p.pow(2).sum() for p in model.parameters() if p.dim() > 1)
    return xy_logits(model, batch) + 1e-4 * penalty


def cases() -> list[Case]:
    return [
        Case("hand/byol_momentum_target", "hand", BYOL, vectors(), step_fn=stateless(byol_step),
             optimizer=adamw(1e-3), probe=byol_probe,
             note="a target network the step moves towards the online one in place (tau 0.99), BYOL / mean teacher"),
        Case("hand/parameter_list_experts", "hand", Experts, vectors(), xy_logits, sgd(0.05, momentum=0.9),
             note="expert matrices in an nn.ParameterList, a softmax gate"),
        Case("hand/lr_set_in_step", "hand", mlp64, vectors(), step_fn=lr_in_step, optimizer=kept_on_model(adamw(1e-3)),
             probe=xy_logits, note="nanoGPT's get_lr(it) written into the param groups by the step"),
        Case("hand/l2_penalty_in_step", "hand", mlp64, vectors(), step_fn=stateless(l2_step), optimizer=sgd(0.05),
             probe=xy_logits, note="an L2 penalty over the weights added by the step"),
    ]
