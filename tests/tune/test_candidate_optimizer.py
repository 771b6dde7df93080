"""Every tuner's and trial's candidate optimizer is built in one place (train/optim_candidate.py) from the user's
row: a spy on it sees the momentum and betas `fit` was given, in the tuners (`batch_size="auto"`, `lr="auto"`)
and in the recipe's trials (the LR range test and its one-cycle trial, the optimizer trial against
Schedule-Free, the batch part)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train import optim_candidate
from torchspeed.tune.optimizer_trial import compare_optimizers

MOMENTUM, BETAS = 0.7, (0.8, 0.95)


@pytest.fixture
def built(monkeypatch):
    """(name, momentum, betas) of each candidate optimizer built from a name."""
    seen = []
    real = optim_candidate.create_optimizer

    def spy(name, model, **kw):
        seen.append((name, kw.get("momentum"), kw.get("betas")))
        return real(name, model, **kw)
    monkeypatch.setattr(optim_candidate, "create_optimizer", spy)
    return seen


def _loader(n=512, batch=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def test_the_tuners_and_the_recipes_trials_build_candidates_with_the_users_momentum_and_betas(built, monkeypatch):
    from torchspeed.plan import budget
    monkeypatch.setattr(budget, "TUNING_SHARE", 20.0)  # a budget that affords every measured part
    torchspeed.fit(_model(), _loader(), epochs=1, optimizer="sgd", lr="auto", momentum=MOMENTUM, betas=BETAS,
                   progress=False, compile=False, precision="fp32")
    torchspeed.fit(_model(), _loader(), epochs=2, optimizer="adamw", recipe="auto", momentum=MOMENTUM, betas=BETAS,
                   progress=False, compile=False, precision="fp32")
    assert len(built) >= 3 and {n for n, _, _ in built} >= {"sgd", "adamw"}
    assert all(m == MOMENTUM and b == BETAS for _, m, b in built), built


def test_the_optimizer_trial_builds_each_candidate_with_the_users_options(built):
    compare_optimizers(_model(), _loader(), ("sgd", "adamw"), lr=0.01, steps=3, eval_batches=1,
                       optimizer_options={"momentum": MOMENTUM, "betas": BETAS})
    assert [n for n, _, _ in built] == ["sgd", "adamw"]
    assert all(m == MOMENTUM and b == BETAS for _, m, b in built)
