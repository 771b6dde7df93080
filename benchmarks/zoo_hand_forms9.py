"""A ninth set of hand-written forms: bf16 autocast written in the step around forward and loss (the script's own
mixed precision, as its loop had it), a REINFORCE policy-gradient step that samples actions from
`torch.distributions.Categorical`, and a step that calls the optimizer's `zero_grad()` itself (a habit carried
over from the loop). `zoo_hand.cases()` lists them with the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo_hand_forms7 import mlp64
from zoo_cases import Case, adam, kept_on_model, scripts_optimizer, sgd, stateless, vectors, xy_logits


def autocast_step(model, batch):
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.cross_entropy(model(x), y)


def reinforce_step(model, batch):
    """One-step bandit: the action sampled from the policy, the reward 1 where it is the context's best arm,
    REINFORCE with the batch's mean reward as the baseline, an entropy bonus."""
    x, best = batch
    dist = torch.distributions.Categorical(logits=model(x))
    action = dist.sample()
    reward = (action == best).float()
    return -(dist.log_prob(action) * (reward - reward.mean())).mean() - 0.01 * dist.entropy().mean()


def zero_grad_step():
    """The step zeroes the optimizer's gradients first, as its loop did before each forward (the script's
    optimizer found on the model, `kept_on_model`; none under recipe="auto")."""
    def step_fn(model, batch):
        opt = scripts_optimizer(model)
        if opt is not None:
            opt.zero_grad()
        return xy_logits(model, batch)
    return step_fn


def cases() -> list[Case]:
    return [
        Case("hand/autocast_in_step", "hand", mlp64, vectors(), step_fn=stateless(autocast_step), optimizer=adam(1e-3),
             probe=xy_logits, note="bf16 autocast around forward and loss, written in the step"),
        Case("hand/reinforce_policy", "hand", mlp64, vectors(), step_fn=stateless(reinforce_step), optimizer=adam(1e-3),
             probe=xy_logits, note="REINFORCE: actions sampled from torch.distributions.Categorical"),
        Case("hand/zero_grad_in_step", "hand", mlp64, vectors(), step_fn=zero_grad_step,
             optimizer=kept_on_model(sgd(0.05, momentum=0.9)),
             probe=xy_logits, note="optimizer.zero_grad() called by the step before its forward"),
    ]
