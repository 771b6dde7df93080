import math

import pytest
import torch

from torchspeed.train.optim import create_optimizer
from torchspeed.train.schedule import create_scheduler, scale_lr, warmup_cosine_factor


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))


def _lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_scale_lr_linear_rule():
    assert scale_lr(0.1, 512, 256) == pytest.approx(0.2)
    assert scale_lr(0.1, 256, 256, world_size=4) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        scale_lr(0.1, 0, 256)


def test_onecycle_rises_to_max_then_falls():
    opt = torch.optim.SGD(_model().parameters(), lr=1.0, momentum=0.9)
    lrs = _lrs(create_scheduler("onecycle", opt, total_steps=100, max_lr=1.0), opt, 100)
    peak = max(range(100), key=lambda i: lrs[i])
    assert 15 <= peak <= 35 and lrs[peak] == pytest.approx(1.0, rel=1e-3)
    assert lrs[0] < 0.1 and lrs[-1] < 1e-3


def test_warmup_cosine_shape():
    opt = torch.optim.SGD(_model().parameters(), lr=0.5)
    lrs = _lrs(create_scheduler("cosine", opt, total_steps=100, max_lr=0.5, warmup_steps=10), opt, 100)
    assert lrs[0] == pytest.approx(0.05) and lrs[9] == pytest.approx(0.5)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[55] == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi * 45 / 90)), rel=1e-6)
    assert warmup_cosine_factor(100, total_steps=100, warmup_steps=10) == pytest.approx(0.0)


def test_cyclic_oscillates():
    opt = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    lrs = _lrs(create_scheduler("cyclic", opt, total_steps=40, max_lr=0.1, min_lr=0.01, cycle_steps=10), opt, 40)
    assert max(lrs) == pytest.approx(0.1) and min(lrs) == pytest.approx(0.01)
    ups = sum(1 for a, b in zip(lrs, lrs[1:]) if b > a)
    downs = sum(1 for a, b in zip(lrs, lrs[1:]) if b < a)
    assert ups > 5 and downs > 5


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb", "lars"])
def test_every_optimizer_by_name_reduces_loss(name):
    model = _model()
    opt = create_optimizer(name, model, lr=0.05 if name != "lars" else 0.5, weight_decay=1e-4)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    first = None
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first


def test_sgd_is_fused_nesterov_and_norms_get_no_weight_decay():
    opt = create_optimizer("sgd", _model(), lr=0.1, weight_decay=5e-4)
    assert opt.defaults["fused"] is True and opt.defaults["nesterov"] is True
    decays = sorted(g["weight_decay"] for g in opt.param_groups)
    assert decays == [0.0, 5e-4]
    no_decay = next(g for g in opt.param_groups if g["weight_decay"] == 0)
    assert all(p.dim() <= 1 for p in no_decay["params"])
    assert create_optimizer("sgd", _model(), lr=0.1, fused=False).defaults["fused"] in (None, False)


def test_unknown_names_give_clear_errors():
    with pytest.raises(ValueError, match="not one of"):
        create_optimizer("adagradx", _model(), lr=0.1)
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not one of"):
        create_scheduler("linear-ish", opt, total_steps=10)


@pytest.mark.parametrize("total", [1, 2, 3, 4, 5, 7])
def test_onecycle_survives_very_short_runs(total):
    opt = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    sched = create_scheduler("onecycle", opt, total_steps=total, max_lr=0.1)
    if total < 4:  # too short for OneCycleLR's two phases: no schedule, the LR is kept
        assert sched is None and opt.param_groups[0]["lr"] == 0.1
        return
    lrs = _lrs(sched, opt, total)
    assert all(lr > 0 for lr in lrs) and max(lrs) == pytest.approx(0.1, rel=0.3) and lrs[-1] < max(lrs)
