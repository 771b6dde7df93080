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


def test_wsd_warms_up_holds_the_peak_then_cools_the_last_fifth_to_zero_by_one_minus_sqrt():
    opt = torch.optim.SGD(_model().parameters(), lr=0.5)
    lrs = _lrs(create_scheduler("wsd", opt, total_steps=100, max_lr=0.5, warmup_steps=10), opt, 100)
    assert lrs[0] == pytest.approx(0.05) and lrs[9] == pytest.approx(0.5)
    assert all(lr == pytest.approx(0.5) for lr in lrs[10:80])  # held at the peak until the cooldown
    assert lrs[80] == pytest.approx(0.5 * (1 - math.sqrt(1 / 20)))  # the 20-step cooldown's first step
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:]))
    assert lrs[99] == pytest.approx(0.0, abs=1e-12)


def test_linear_decay_runs_straight_from_the_peak_to_zero_at_the_last_step():
    opt = torch.optim.SGD(_model().parameters(), lr=0.5)
    lrs = _lrs(create_scheduler("linear", opt, total_steps=100, max_lr=0.5, warmup_steps=10), opt, 100)
    assert lrs[9] == pytest.approx(0.5)
    steps = [a - b for a, b in zip(lrs[10:], lrs[11:])]
    assert all(d == pytest.approx(0.5 / 90) for d in steps)  # a straight line
    assert lrs[99] == pytest.approx(0.0, abs=1e-12)


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


def test_weight_decay_groups_are_timms_without_timm():
    """`param_groups` is torchspeed's own (SGD/AdamW need no timm): the same groups, same order, as timm's."""
    from timm.optim import param_groups_weight_decay

    from torchspeed.bench.workloads import resnet20
    from torchspeed.train.optim import param_groups

    for model in (_model(), resnet20(), torch.nn.TransformerEncoderLayer(16, 2, 32)):
        ours, theirs = param_groups(model, 0.1), param_groups_weight_decay(model, weight_decay=0.1)
        assert [g["weight_decay"] for g in ours] == [g["weight_decay"] for g in theirs]
        assert [[id(p) for p in g["params"]] for g in ours] == [[id(p) for p in g["params"]] for g in theirs]


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


def test_schedule_free_adamw_trains_without_a_schedule_and_evaluates_its_averaged_weights(monkeypatch):
    """optimizer="schedulefree": no LR schedule, its own warm-up, the averaged weights (with BatchNorm statistics of
    their own) evaluated and saved, the training weights trained; it learns a learnable task."""
    pytest.importorskip("schedulefree")
    from torch.utils.data import DataLoader, TensorDataset

    import torchspeed
    from torchspeed.train.optim import is_schedule_free

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    modes = []
    import schedulefree
    real_eval = schedulefree.AdamWScheduleFree.eval
    monkeypatch.setattr(schedulefree.AdamWScheduleFree, "eval", lambda self: modes.append("eval") or real_eval(self))
    res = torchspeed.fit(model, loader, epochs=4, optimizer="schedulefree", lr=0.01, val_loader=loader,
                         progress=False, compile=False, trial=False)
    assert res.decisions["schedule"].value is None and "warm-up" in res.decisions["schedule"].reason
    accs = [r["val_acc"] for r in res.history]
    improved = sum(a > max(accs[:i], default=-1.0) for i, a in enumerate(accs))  # restore_best's copies
    # once per epoch's evaluation and per improvement (the best epoch's copy is of the averaged weights), then
    # back to training; once more at the end, where the model keeps the averaged weights (the best epoch's here)
    assert modes.count("eval") == 4 + improved + 1
    assert res.history[-1]["val_acc"] > 0.6 and res.history[-1]["train_loss"] < res.history[0]["train_loss"]  # chance: 0.25
    assert res.decisions["optimizer"].value.startswith("AdamWScheduleFree") or "ScheduleFree" in str(
        res.decisions["optimizer"])


def test_schedule_free_batchnorm_is_recalibrated_on_the_newest_batches_in_the_runs_precision(monkeypatch):
    """The averaged weights' BatchNorm statistics come from the newest training batches that hold
    SCHEDULE_FREE_BN_SAMPLES samples (not all kept), in the autocast the run trains in; a loop that trains through
    `run_steps` (the bench's) keeps them as fit's epoch loop does."""
    pytest.importorskip("schedulefree")
    import torchspeed.train.eval_view as eval_view
    from torchspeed.train.config import TrainConfig
    from torchspeed.train.eval_view import eval_weights, newest_samples
    from torchspeed.train.optim import SCHEDULE_FREE_BN_SAMPLES
    from torchspeed.train.loop.trainer import Trainer

    batches = [(torch.full((n, 3, 4, 4), float(i)), torch.zeros(n, dtype=torch.long)) for i, n in
               enumerate((100, 100, 100, 100))]
    assert [int(b[0][0, 0, 0, 0]) for b in newest_samples(batches, 250)] == [1, 2, 3]  # 300 >= 250, oldest first
    assert len(newest_samples(batches, 10_000)) == 4 and len(newest_samples(batches, 1)) == 1

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(64, 2))
    t = Trainer(model, optimizer="schedulefree", lr=0.01, config=TrainConfig(progress=False, compile=False,
                                                                             trial=False, precision="bf16"))
    seen = []
    monkeypatch.setattr(eval_view, "recalibrate_bn", lambda m, bs, **k: seen.append(
        (sum(b[0].shape[0] for b in bs), torch.is_autocast_enabled("cpu"))))
    data = iter([(torch.randn(64, 3, 4, 4), torch.randint(0, 2, (64,))) for _ in range(8)])
    t.run_steps(t.batches(data), 8)
    with eval_weights(t):
        pass
    assert seen == [(SCHEDULE_FREE_BN_SAMPLES, True)]  # 4 of the 8 kept batches of 64, under bf16 autocast
