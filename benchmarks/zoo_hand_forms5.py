"""A fifth set of hand-written forms: mixup's soft targets (class probabilities) through the default loss, a batch
that is a dataclass of the script's own (a `collate_fn` builds it), progressive unfreezing (the backbone's
`requires_grad` turned on mid-run, its parameters in the optimizer from the start), and a frozen BatchNorm (eval
mode kept on a submodule while the rest trains), and SAM (sharpness-aware minimisation: an optimizer of the script's
own whose `step(closure)` climbs to a nearby point and steps on the gradient the closure computes there).
`zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zoo_cases import Case, adam, images, sgd, stateless, vectors, xy_logits
from zoo_hand_forms3 import mlp

UNFREEZE_AT = 20  # the step at which the progressive-unfreezing case trains its backbone too


def mixup_batch(g: torch.Generator):
    """Inputs mixed pairwise (lambda 0.7) with their one-hot targets mixed alike: (x, probabilities (B, 10))."""
    x, y = vectors()(g)
    perm = torch.randperm(32, generator=g)
    probs = F.one_hot(y, 10).float()
    return 0.7 * x + 0.3 * x[perm], 0.7 * probs + 0.3 * probs[perm]


@dataclass
class Batch:
    """The script's own batch type (its collate_fn returns one)."""

    features: torch.Tensor
    labels: torch.Tensor
    ids: list


def dataclass_batch(g: torch.Generator):
    return Batch(*vectors()(g), list(range(32)))


def dataclass_plain(model, batch):
    return F.cross_entropy(model(batch.features), batch.labels)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.features(x))


def frozen_start():
    m = Backbone()
    m.features.requires_grad_(False)
    return m


def unfreeze_step():
    """Trains the head alone, then from step UNFREEZE_AT the backbone too (its weights were in the optimizer)."""
    seen = {"steps": 0}

    def step_fn(model, batch):
        seen["steps"] += 1
        if seen["steps"] == UNFREEZE_AT:
            model.features.requires_grad_(True)
        x, y = batch
        return F.cross_entropy(model(x), y)
    return step_fn


def unfreeze_probe(model, batch):
    return xy_logits(model, batch)


class FrozenBN(nn.Module):
    """A conv net whose BatchNorm the script keeps in eval mode (statistics frozen) while the rest trains."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Linear(16, 10)

    def train(self, mode: bool = True):
        super().train(mode)
        self.bn.eval()  # frozen statistics, as detection backbones keep them
        return self

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def soft_ce(model, batch):
    x, p = batch
    return F.cross_entropy(model(x), p)


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as its reference implementation writes it (davda54/sam): `step(closure)` moves
    each weight by rho along its normalised gradient, has the closure compute the gradient there, moves back and
    steps the base optimizer on that gradient. It asserts it is given the closure."""

    def __init__(self, params, base_optimizer, rho: float = 0.05, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        norm = torch.norm(torch.stack([p.grad.norm(2) for g in self.param_groups for p in g["params"]
                                       if p.grad is not None]), 2)
        for group in self.param_groups:
            scale = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                e_w = p.grad * scale
                p.add_(e_w)
                self.state[p]["e_w"] = e_w
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        closure = torch.enable_grad()(closure)
        self.first_step()
        closure()
        self.second_step()


def sam(m: nn.Module):
    return SAM(m.parameters(), torch.optim.SGD, rho=0.05, lr=0.05, momentum=0.9)


def cases() -> list[Case]:
    return [
        Case("hand/mixup_soft_targets", "hand", mlp, mixup_batch, soft_ce, sgd(0.05, momentum=0.9),
             note="mixup: targets are class probabilities (B, C), the default cross-entropy"),
        Case("hand/dataclass_batch", "hand", mlp, dataclass_batch, step_fn=stateless(dataclass_plain),
             optimizer=adam(1e-3), probe=dataclass_plain, note="the script's own dataclass as the batch"),
        Case("hand/progressive_unfreeze", "hand", frozen_start, vectors(), step_fn=unfreeze_step, optimizer=adam(1e-3),
             probe=unfreeze_probe, note=f"the backbone frozen, then trained from step {UNFREEZE_AT}"),
        Case("hand/frozen_batchnorm", "hand", FrozenBN, images(16, 16), xy_logits, sgd(0.05, momentum=0.9),
             note="BatchNorm kept in eval mode by the model's train() while the rest trains"),
        Case("hand/sam_optimizer", "hand", mlp, vectors(), xy_logits, sam,
             note="SAM: the script's own optimizer, step(closure) on the gradient at a nearby point"),
    ]
