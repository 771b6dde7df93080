"""A scheduler of the user's own (`schedule=<a function of the optimizer>`): what a ported script's StepLR,
CosineAnnealingLR or ReduceLROnPlateau did, done by `fit` on the optimizer it trains with."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.schedule import EpochScheduler, create_scheduler

FAST = dict(compile=False, progress=False, precision="fp32", trial=False)


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=16)


def test_your_step_lr_is_stepped_after_each_epoch_on_the_optimizer_fit_trains_with():
    res = torchspeed.fit(nn.Linear(8, 3), _data(), epochs=3, optimizer="sgd", lr=0.4,
                         schedule=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), **FAST)
    assert [round(r["lr"], 4) for r in res.history] == [0.4, 0.2, 0.1]  # the LR each epoch trained at
    assert res.decisions["schedule"].value.startswith("yours") and "StepLR" in res.decisions["schedule"].reason
    assert "after each epoch" in res.decisions["schedule"].reason


def test_schedule_interval_step_steps_it_after_each_optimizer_step():
    seen = []

    class Spy(Callback):
        def on_step_end(self, trainer):
            seen.append(trainer.optimizer.param_groups[0]["lr"])

    res = torchspeed.fit(nn.Linear(8, 3), _data(), epochs=1, optimizer="sgd", lr=1.0, schedule_interval="step",
                         schedule=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1)),
                         callbacks=[Spy()], **FAST)
    assert res.steps == 4 and seen == pytest.approx([1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert "after each optimizer step" in res.decisions["schedule"].reason


def test_reduce_on_plateau_steps_on_the_validation_loss_and_accuracy_in_max_mode():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    s = create_scheduler(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0), opt,
                         total_steps=10)
    assert isinstance(s, EpochScheduler)
    s.step()  # the trainer's per-step call waits for the epoch's end
    for loss in (1.0, 1.0, 1.0):
        s.epoch_end({"val_loss": loss, "train_loss": 0.1})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)  # two epochs without improvement, patience 0
    s.epoch_end({"val_loss": None, "val_skipped": True})  # eval_every left this epoch out: no step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    acc = create_scheduler(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, mode="max", patience=0), opt,
                           total_steps=10)
    acc.epoch_end({"val_acc": 0.5, "val_loss": 9.0})
    acc.epoch_end({"val_acc": 0.9, "val_loss": 9.0})  # the loss did not improve, the accuracy did: no cut
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    assert acc.state_dict()["best"] == 0.9


def test_a_schedule_function_that_does_not_build_a_scheduler_on_its_optimizer_is_refused():
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="lambda opt.*bound to another optimizer"):
        torchspeed.fit(nn.Linear(8, 3), _data(), epochs=1, optimizer="sgd", lr=0.1,
                       schedule=lambda opt: torch.optim.lr_scheduler.StepLR(other, 1), **FAST)
    model = nn.Linear(8, 3)
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"a StepLR object built on another optimizer.*optimizer=.*lambda opt: StepLR"):
        torchspeed.fit(model, _data(), epochs=1, optimizer="sgd", lr=0.1,  # fit builds its own from the name
                       schedule=torch.optim.lr_scheduler.StepLR(mine, 1), **FAST)
    with pytest.raises(ValueError, match="schedule_interval must be 'epoch' or 'step'"):
        torchspeed.fit(nn.Linear(8, 3), _data(), epochs=1, schedule_interval="batch", **FAST)
    with pytest.raises(TypeError, match=r"got the class StepLR, which needs more than the optimizer.*'step_size'.*"
                                        r"schedule=lambda opt: StepLR\(opt, ...\)"):
        torchspeed.fit(nn.Linear(8, 3), _data(), epochs=1, schedule=torch.optim.lr_scheduler.StepLR, **FAST)
    res = torchspeed.fit(nn.Linear(8, 3), _data(), epochs=2, optimizer="sgd", lr=0.1,  # a class its defaults build
                         schedule=torch.optim.lr_scheduler.ReduceLROnPlateau, **FAST)
    assert res.steps > 0


def test_a_scheduler_object_built_on_the_optimizer_passed_is_taken_as_a_ported_script_built_it():
    """`optimizer=opt, schedule=StepLR(opt, ...)`: the script's two objects, stepped after each epoch."""
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    res = torchspeed.fit(model, _data(), epochs=3, optimizer=opt, schedule=sched, **FAST)
    assert [round(r["lr"], 4) for r in res.history] == [0.4, 0.2, 0.1]
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.05)  # the object itself stepped
    assert "StepLR" in res.decisions["schedule"].value and "after each epoch" in res.decisions["schedule"].reason


def test_your_schedulers_state_is_checkpointed_and_a_resumed_run_goes_on_from_it(tmp_path):
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
    torch.manual_seed(0)
    full = torchspeed.fit(nn.Linear(8, 3), _data(), epochs=3, optimizer="sgd", lr=0.4, schedule=sched, **FAST)
    torch.manual_seed(0)
    torchspeed.fit(nn.Linear(8, 3), _data(), epochs=3, max_steps=8, optimizer="sgd", lr=0.4, schedule=sched,
                   checkpoint_dir=str(tmp_path), **FAST)  # stopped after 2 of 3 epochs
    resumed = torchspeed.fit(nn.Linear(8, 3), _data(), epochs=3, optimizer="sgd", lr=0.4, schedule=sched,
                             checkpoint_dir=str(tmp_path), resume="auto", **FAST)
    assert [round(r["lr"], 4) for r in resumed.history][-1] == round(full.history[-1]["lr"], 4) == 0.1
