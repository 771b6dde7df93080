"""Under `fit` the Trainer applies the plan's decisions and makes none: every `Decision` of a fit run is written by
a stage of the plan (plan/), the switch or compile trial (train/trial/), or the part that records what happened
(the batch contract, the stop, the schedule's shape), never from the Trainer's own modules
(train/loop/trainer.py, train/loop/setup.py). A Trainer used on its own, with no plan, still decides for itself:
the spy sees those writes, so it would see them under fit too. No clock is read."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decisions
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.loop.trainer import Trainer

FAST = dict(progress=False, compile=False, malloc=False)
TRAINER_FILES = ("train/loop/trainer.py", "train/loop/setup.py")
WRITES = ("__setitem__", "refine", "setdefault", "update")


def _loader(n=96, batch=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 2))


class _StopSoon(Callback):
    def on_step_end(self, trainer):
        if trainer.step >= 3:
            trainer.request_stop("enough for the test")


@pytest.fixture
def writers(monkeypatch):
    """(file of the first caller outside train/decision.py, method, keys) for every write to any `Decisions`."""
    seen: list[tuple[str, str, tuple]] = []
    for name in WRITES:
        orig = getattr(Decisions, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            f = sys._getframe(1)
            while f is not None and Path(f.f_code.co_filename).as_posix().endswith("train/decision.py"):
                f = f.f_back
            keys = (a[0],) if a and isinstance(a[0], str) else tuple(dict(*a, **k))  # () : a copy, no write
            where = Path(f.f_code.co_filename).as_posix() if f is not None else "?"
            seen.append((where, _name, keys, f and f.f_lineno))
            return _orig(self, *a, **k)

        monkeypatch.setattr(Decisions, name, spy)
    return seen


def _from_trainer(seen) -> list:
    return [(file.rsplit("/src/torchspeed/", 1)[-1], how, keys, line) for file, how, keys, line in seen
            if keys and file.endswith(TRAINER_FILES)]


@pytest.mark.parametrize("case", ["default", "schedulefree", "own_schedule", "own_optimizer", "precision_auto"])
def test_under_fit_no_decision_is_written_from_the_trainer(writers, case, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    model = _cnn()
    kw = dict(epochs=2, callbacks=[_StopSoon()], val_loader=_loader(32), precision="fp32", trial=False, **FAST)
    if case == "schedulefree":
        pytest.importorskip("schedulefree")
        kw["optimizer"] = "schedulefree"
    elif case == "own_schedule":
        kw["schedule"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    elif case == "own_optimizer":
        kw["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    elif case == "precision_auto":
        kw.update(precision="auto", trial=True)
    result = torchspeed.fit(model, _loader(), **kw)
    assert result.decisions["stopped"].value == "enough for the test"  # the stop was recorded, from elsewhere
    assert {"optimizer", "precision", "channels_last", "schedule"} <= set(result.decisions)
    assert writers, "the spy saw no write at all"
    assert _from_trainer(writers) == []


def test_a_trainer_on_its_own_decides_and_the_spy_sees_it(writers):
    """The control: with no plan, the Trainer decides its backends, precision and optimizer record itself."""
    t = Trainer(_cnn(), config=TrainConfig(epochs=1, precision="fp32", trial=False, **FAST), optimizer="sgd", lr=0.05)
    t.fit(_loader())
    written = {k for _, _, keys, _ in _from_trainer(writers) for k in keys}
    assert {"precision", "optimizer"} <= written


def test_the_world_size_lr_scaling_is_the_plans_stage():
    """T17 under DDP: the plan's `lr_world_size` stage scales the run's LR (a named optimizer) or the given
    optimizer's groups, once, and records it; the Trainer given the plan's decisions scales nothing again."""
    from types import SimpleNamespace

    from torchspeed.plan.planner import BUILT_IN
    from torchspeed.plan.stages import RunContext
    from torchspeed.train.decision import Decision

    stage = next(s for s in BUILT_IN if s.name == "lr_world_size")
    cfg = TrainConfig(scale_lr_world_size=True)
    ctx = RunContext(model=_cnn(), loader=None, cfg=cfg, optimizer="sgd", lr=0.1, dist=None)
    assert not stage.wanted(ctx)  # one process: nothing to scale
    ctx.dist = SimpleNamespace(world_size=4)
    assert stage.wanted(ctx) and not stage.wanted(RunContext(model=None, loader=None, cfg=TrainConfig(),
                                                             dist=ctx.dist))  # off unless asked for
    ctx.decisions["lr"] = Decision(0.1, "prior")
    stage.run(ctx)
    assert ctx.lr == pytest.approx(0.4) and ctx.decisions["lr"].value == pytest.approx(0.4)
    assert ctx.decisions["lr"].refines["value"] == 0.1
    model = _cnn()
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.05}, {"params": model[4].parameters()}], lr=0.1)
    ctx = RunContext(model=model, loader=None, cfg=cfg, optimizer=opt, lr=0.1, dist=SimpleNamespace(world_size=2))
    stage.run(ctx)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2]) and ctx.decisions["lr"].value == 0.1


def test_the_parallel_wrap_is_the_plans_stage_and_the_trainer_applies_it(monkeypatch):
    """Under a process group the plan's `parallel` stage decides DDP or FSDP2; `wrap_parallel` applies that decision
    (and decides itself only for a Trainer with no plan)."""
    from types import SimpleNamespace

    import torchspeed.train.parallel.distributed as distributed
    import torchspeed.train.parallel.fsdp as fsdp
    from torchspeed.plan.planner import BUILT_IN
    from torchspeed.plan.stages import RunContext
    from torchspeed.train.decision import Decision

    stage = next(s for s in BUILT_IN if s.name == "parallel")
    ctx = RunContext(model=_cnn(), loader=None, cfg=TrainConfig(), dist=None)
    assert not stage.wanted(ctx)
    ctx.dist, ctx.dev = SimpleNamespace(world_size=2), torch.device("cpu")
    stage.run(ctx)
    assert ctx.decisions["parallel"].value == "ddp"  # a small model: replicated
    ctx = RunContext(model=_cnn(), loader=None, cfg=TrainConfig(parallel="fsdp2"), dist=ctx.dist)
    ctx.dev = torch.device("cpu")
    stage.run(ctx)
    assert ctx.decisions["parallel"] == Decision("fsdp2", "asked for")
    wrapped = []
    monkeypatch.setattr(distributed, "wrap_for_training", lambda m, **kw: wrapped.append(kw) or (m, m, "DDP"))
    monkeypatch.setattr(fsdp, "choose_parallel", lambda *a, **k: pytest.fail("the plan decided: nothing to choose"))
    info = SimpleNamespace(device=torch.device("cpu"), world_size=2, backend="gloo")
    decisions = Decisions({"parallel": Decision("ddp", "the plan's")})
    fsdp.wrap_parallel(_cnn(), TrainConfig(parallel="fsdp2"), info, precision="fp32", decisions=decisions)
    assert wrapped and decisions["parallel"].reason == "the plan's" and decisions["distributed"].value == "DDP"


def test_the_printed_plan_holds_the_optimizer_the_trainer_built(capsys):
    """The plan is printed at the run's start, after the "first_steps" stages: its optimizer line (recorded there
    where no stage chose the optimizer) is in it, once."""
    torchspeed.fit(_cnn(), _loader(), epochs=1, precision="fp32", trial=False, compile=False, malloc=False,
                   progress=True)
    err = capsys.readouterr().err
    assert err.count("torchspeed plan for a") == 1 and "  optimizer: SGD" in err
