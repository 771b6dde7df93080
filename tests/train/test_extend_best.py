"""A finished run extended with more epochs (a new schedule segment), the best epoch's weights restored at
the end of fit, and the optimizer defaults (weight decay per optimizer, momentum and betas)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.optim import create_optimizer
from torchspeed.train.optim_info import WEIGHT_DECAY
from torchspeed.train.loop.trainer import Trainer


def _loader(n=48, batch=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))


FAST = dict(compile=False, precision="fp32", progress=False, device="cpu", trial=False,  # bit-exact comparisons
            schedule="onecycle")  # one-cycle segments, the LR given as their peak


def test_a_run_without_a_schedule_is_extended_not_crashed(tmp_path):
    """1 epoch of 3 steps has no one-cycle (too short); 3 epochs has one: was KeyError 'initial_lr'."""
    ck = str(tmp_path / "ck")
    first = torchspeed.fit(_model(), _loader(), epochs=1, lr=0.05, checkpoint_dir=ck, **FAST)
    assert first.steps == 3
    model = _model()
    res = torchspeed.fit(model, _loader(), epochs=3, lr=0.05, checkpoint_dir=ck, resume="auto", **FAST)
    assert [r["epoch"] for r in res.history] == [1, 2, 3] and res.steps == 9
    assert "6 added steps" in str(res.decisions["extended"])
    lrs = [r["lr"] for r in res.history]
    assert lrs[-1] < 0.05 / 4  # the new one-cycle segment annealed (the first run had a constant LR)


def test_extension_uses_this_runs_peak_lr(tmp_path):
    ck = str(tmp_path / "ck")
    torchspeed.fit(_model(), _loader(), epochs=2, lr=0.05, checkpoint_dir=ck, **FAST)
    trainer = Trainer(_model(), lr=0.2, device="cpu", config=torchspeed.TrainConfig(
        epochs=4, checkpoint_dir=ck, resume="auto", compile=False, precision="fp32", progress=False))
    seen = []
    real = trainer.train_step
    trainer.train_step = lambda b: (seen.append(trainer.optimizer.param_groups[0]["lr"]), real(b))[1]
    trainer.fit(_loader())
    assert max(seen) == pytest.approx(0.2)  # the segment warms up to the new peak


@pytest.mark.parametrize("checkpoints", [False, True])
def test_restore_best_loads_the_best_epoch(tmp_path, monkeypatch, checkpoints):
    accs = iter([0.5, 0.9, 0.6])
    monkeypatch.setattr(Trainer, "evaluate", lambda self, loader: {"val_loss": 1.0, "val_acc": next(accs)})
    after = []
    real_end = Trainer._end_epoch

    def record(self, row):
        after.append({k: v.clone() for k, v in self.module.state_dict().items()})
        real_end(self, row)

    monkeypatch.setattr(Trainer, "_end_epoch", record)
    model = _model()
    kw = {"checkpoint_dir": str(tmp_path / "ck")} if checkpoints else {}
    res = torchspeed.fit(model, _loader(), epochs=3, lr=0.05, val_loader=_loader(), **kw, **FAST)
    assert str(res.decisions["restored_best"]).startswith("epoch 2 of 3 (val_acc 0.9")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in after[1].items())
    assert not all(torch.equal(state[k], v) for k, v in after[2].items())


def test_restore_best_off_keeps_the_last_epoch(monkeypatch):
    accs = iter([0.5, 0.9, 0.6])
    monkeypatch.setattr(Trainer, "evaluate", lambda self, loader: {"val_loss": 1.0, "val_acc": next(accs)})
    res = torchspeed.fit(_model(), _loader(), epochs=3, lr=0.05, val_loader=_loader(), restore_best=False, **FAST)
    assert "restored_best" not in res.decisions


def test_weight_decay_defaults_per_optimizer_and_no_decay_on_biases():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    for name in ("sgd", "adamw"):
        opt = create_optimizer(name, model, lr=0.1, weight_decay=None)
        decay = {g["weight_decay"]: len(g["params"]) for g in opt.param_groups}
        assert decay == {WEIGHT_DECAY[name]: 2, 0.0: 4}  # two weight matrices; 2 biases + BN weight and bias
    assert WEIGHT_DECAY["adamw"] > WEIGHT_DECAY["sgd"]


def test_momentum_and_betas_reach_the_optimizer():
    res = Trainer(_model(), optimizer="sgd", momentum=0.8, device="cpu")
    assert res.optimizer.param_groups[0]["momentum"] == 0.8
    res = Trainer(_model(), optimizer="adamw", betas=(0.8, 0.95), device="cpu")
    assert res.optimizer.param_groups[0]["betas"] == (0.8, 0.95)


@pytest.mark.parametrize("name, key, value", [("sgd", "momentum", 0.8), ("sgd", "momentum", 0.9),
                                              ("adamw", "betas", 0.8)])
def test_one_cycle_keeps_the_momentum_asked_for(name, key, value):
    from torchspeed.train.schedule import create_scheduler

    opt = create_optimizer(name, _model(), lr=0.1, **({"momentum": value} if key == "momentum"
                                                       else {"betas": (value, 0.999)}))
    sched = create_scheduler("onecycle", opt, total_steps=20)
    seen = []
    for _ in range(20):
        g = opt.param_groups[0]
        seen.append(g["momentum"] if key == "momentum" else g["betas"][0])
        opt.step()
        sched.step()
    assert max(seen) == pytest.approx(value + 0.05) and min(seen) == pytest.approx(value - 0.05, abs=1e-3)


def test_a_best_epoch_from_before_a_resume_comes_back_from_best_pt(tmp_path, monkeypatch):
    accs = iter([0.5, 0.9, 0.6, 0.1])
    monkeypatch.setattr(Trainer, "evaluate", lambda self, loader: {"val_loss": 1.0, "val_acc": next(accs)})
    after = []
    real_end = Trainer._end_epoch
    monkeypatch.setattr(Trainer, "_end_epoch", lambda self, row: (
        after.append({k: v.clone() for k, v in self.module.state_dict().items()}), real_end(self, row)))
    ck = str(tmp_path / "ck")
    torchspeed.fit(_model(), _loader(), epochs=3, lr=0.05, val_loader=_loader(), checkpoint_dir=ck,
                   restore_best=False, **FAST)
    model = _model()
    res = torchspeed.fit(model, _loader(), epochs=4, lr=0.05, val_loader=_loader(), checkpoint_dir=ck,
                         resume="auto", **FAST)
    assert str(res.decisions["restored_best"]).startswith("epoch 2 of 4")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in after[1].items())


def test_a_second_fit_of_one_trainer_gets_its_own_schedule_segment():
    """Staged training on one Trainer: the second `fit` trains its epochs on from the first's last step with a new
    one-cycle segment (its LR rises again and anneals) instead of stepping the first call's schedule past its
    end (torch: "Tried to step 4 times. The specified number of total steps is 3")."""
    from torchspeed.train.loop.callbacks import Callback
    from torchspeed.train.config import TrainConfig

    class LRs(Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, trainer):
            self.seen.append(trainer.optimizer.param_groups[0]["lr"])

    lrs = LRs()
    cfg = TrainConfig(**{k: v for k, v in FAST.items() if k != "device"})
    trainer = Trainer(_model(), lr=0.05, device="cpu", config=cfg, callbacks=[lrs])
    first = trainer.fit(_loader(), epochs=2)  # 6 steps
    second = trainer.fit(_loader(), epochs=3)  # 9 more
    assert first.steps == 6 and second.steps == 15 and trainer.total_steps == 15
    assert "a second fit of this Trainer" in second.decisions["extended"].reason
    again = lrs.seen[6:]
    assert max(again) > 4 * lrs.seen[5] and again[-1] < max(again) / 4  # it rose again, then annealed
