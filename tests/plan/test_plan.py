"""The plan (plan/planner.py, plan/budget.py, plan/inrun.py): one plan, its cost counted, its measurements on the
run's own steps. Injected capabilities and step times only: nothing here depends on this CPU or the clock."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.trial.autoswitch import SwitchStage
from torchspeed.plan import TuningBudget, make_plan
from torchspeed.plan.parts import PARTS
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decision

FAST = dict(progress=False, compile=False)
# The recipe with the user's optimizer kept (the LR part then runs); Schedule-Free's own tests below
KEEP_OPT = dict(recipe_parts=tuple(p for p in PARTS if p != "schedulefree"))


def _loader(n=256, batch=16, size=8, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()  # learnable
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def measure_here(monkeypatch):
    """A tuning budget that affords the range test in a short run (the rule is 5% of the run)."""
    from torchspeed.plan import budget

    monkeypatch.setattr(budget, "TUNING_SHARE", 20.0)


def test_budget_allows_what_fits_and_says_why_not():
    b = TuningBudget(run_steps=4000)
    assert b.limit == 200 and b.allows(172) and not b.allows(201)
    b.spend(172)
    assert not b.allows(100) and "over 5% of this 4000-step run" in b.refusal(100)
    assert not TuningBudget(None).allows(1) and "unknown" in TuningBudget(None).refusal(5)


def test_every_value_in_decisions_is_a_decision(tiny_cnn):
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", lr="auto", val_loader=_loader(64), **FAST)
    assert res.decisions and all(isinstance(v, Decision) for v in res.decisions.values()), \
        {k: type(v).__name__ for k, v in res.decisions.items() if not isinstance(v, Decision)}
    for key in ("device", "switch_plan", "switch_trial", "precision", "lr", "tuning", "label_smoothing", "tta"):
        assert key in res.decisions, key


def test_a_short_run_decides_the_lr_from_its_prior_and_says_so(tiny_cnn):
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", lr=0.05, **KEEP_OPT, **FAST)  # 16 steps
    lr = res.decisions["lr"]
    assert lr.value == 0.05 and lr.reason.startswith("prior") and "over 5% of this 16-step run" in lr.reason
    assert res.decisions["tuning"].measured["steps_off_run"] == 0


def test_the_tuners_run_at_the_precision_the_switch_trial_chose(tiny_cnn, monkeypatch, measure_here):
    """The rule says bf16 on this (injected) bf16 CPU; the trial measures fp32 faster: the range test runs in fp32."""
    from torchspeed.train.loop.trainer import Trainer
    from torchspeed.tune import lr_peak as lr_mod

    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    seconds = {"fp32": 0.5, "fp32+channels_last": 0.6, "bf16": 1.0, "bf16+channels_last": 1.0}
    monkeypatch.setattr(SwitchStage, "measure_fn",
                        staticmethod(lambda s, sec: seconds[s.label().replace("+fused", "").replace("+foreach", "")]))
    monkeypatch.setattr(SwitchStage, "_numerics_losses", lambda self, batch: {})
    seen, trials = [], []
    real = lr_mod.find_lr
    monkeypatch.setattr(lr_mod, "find_lr", lambda *a, **k: seen.append(k["precision"]) or real(*a, **k))
    real_prepare = SwitchStage.prepare
    monkeypatch.setattr(SwitchStage, "prepare", lambda self, *a, **k: (real_prepare(self, *a, **k), trials.append(
        self.live is not None))[0])
    res = torchspeed.fit(tiny_cnn(), _loader(n=16 * 40), epochs=1, recipe="auto", lr=0.05, fused_optimizer=False,
                         **KEEP_OPT, **FAST)
    assert res.decisions["precision"].value == "fp32" and res.decisions["switch_trial"].value == "before the run"
    assert trials == [True, False]  # one trial per run: the copy's, before the plan's trials; the run takes it
    assert seen == ["fp32"]
    lr = res.decisions["lr"]
    assert "after the switch trial, in fp32" in lr.reason and lr.measured["range_test_steps"] > 0
    assert res.steps == 40  # the measurement trained nothing off the run; the run kept its length


def test_the_recipe_leaves_the_loader_order_and_global_rng_as_they_were(tiny_cnn, measure_here):
    """With the recipe measuring (range test, LR trial) the run sees the same batches and ends with the same RNG."""
    from torchspeed.train.loop.trainer import Trainer

    seen = {}
    real = Trainer.step_batch
    for recipe in (None, "auto"):
        order = []
        Trainer.step_batch = lambda self, b, order=order: order.append(b[1].tolist()) or real(self, b)
        try:
            loader = _loader(n=16 * 12)
            torch.manual_seed(3)
            torchspeed.fit(tiny_cnn(), loader, epochs=2, recipe=recipe, lr=0.05, trial=False, **FAST,
                           **(KEEP_OPT if recipe else {}))
            seen[recipe] = (order, torch.get_rng_state(), loader.generator.get_state())
        finally:
            Trainer.step_batch = real
    assert seen[None][0] == seen["auto"][0]
    assert torch.equal(seen[None][1], seen["auto"][1]) and torch.equal(seen[None][2], seen["auto"][2])


def test_a_second_fit_reads_the_measured_recipe_from_the_cache(tiny_cnn, tmp_path, monkeypatch, measure_here):
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    kw = dict(epochs=1, recipe="auto", lr=0.05, **KEEP_OPT, **FAST)
    r1 = torchspeed.fit(tiny_cnn(), _loader(n=16 * 30), **kw)
    assert r1.decisions["lr"].measured["range_test_steps"] > 0
    r2 = torchspeed.fit(tiny_cnn(), _loader(n=16 * 30), **kw)
    assert r2.decisions["lr"].reason.startswith("cached") and r2.decisions["lr"].value == pytest.approx(
        r1.decisions["lr"].value)
    assert r2.decisions["switch_trial"].value == "cached" and r2.decisions["switch_trial"].measured["steps"] == 0
    assert r2.decisions["tuning"].measured["steps_off_run"] == 0 and "in_run_steps" not in \
        r2.decisions["tuning"].measured


def test_make_plan_resolves_in_order_and_returns_what_the_trainer_applies(tiny_cnn):
    plan = make_plan(tiny_cnn(), _loader(), TrainConfig(epochs=2, progress=False), recipe="auto", lr="auto",
                     recipe_parts=KEEP_OPT["recipe_parts"])
    assert plan.run_steps == 32 and plan.lr == pytest.approx(0.1)  # lr="auto" with a recipe: its stated prior
    keys = list(plan.decisions)
    assert keys.index("device") < keys.index("switch_plan") < keys.index("lr") < keys.index("tuning")
    assert plan.config.label_smoothing == 0.1 and any(type(c).__name__ == "FinalBatchNormStats" for c in plan.callbacks)
    text = plan.summary()
    assert "32-step run" in text and "lr: 0.1 - prior" in text


def test_a_short_cold_run_takes_schedule_free_as_its_prior_and_trains_with_it(tiny_cnn, tmp_path, monkeypatch):
    """No budget for an optimizer trial in 16 steps: Schedule-Free AdamW, its LR scaled to this narrow model's width,
    replaces SGD, its LR search, the schedule and the BatchNorm tail; the run trains with it and its averaged weights
    are evaluated."""
    pytest.importorskip("schedulefree")
    from torchspeed.train.optim import SCHEDULE_FREE_LR, is_schedule_free, schedule_free_lr
    from torchspeed.train.loop.trainer import Trainer

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    used = []
    real = Trainer.setup_schedule
    monkeypatch.setattr(Trainer, "setup_schedule", lambda self, *a: used.append(self.optimizer) or real(self, *a))
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", val_loader=_loader(64),
                         precision="fp32", **FAST)  # no LR given; the same numerics on every CPU kind
    opt = res.decisions["optimizer"]
    assert opt.value == "schedulefree" and opt.reason.startswith("prior: Schedule-Free") and "over 5%" in opt.reason
    sf_lr = schedule_free_lr(tiny_cnn())[0]
    assert sf_lr > SCHEDULE_FREE_LR and "fan-in" in res.decisions["lr"].reason
    assert res.decisions["lr"].value == sf_lr and res.decisions["bn_stats"].value is False
    ls = res.decisions["label_smoothing"]  # the prior is taken whole: nothing unmeasured on top
    assert ls.value == 0.0 and "taken whole" in ls.reason
    assert used and is_schedule_free(used[0]) and used[0].param_groups[0]["lr"] == sf_lr
    assert res.decisions["schedule"].value is None and res.decisions["tuning"].measured["steps_off_run"] == 0
    assert res.history[-1]["val_acc"] > 0.25  # it learns (the averaged weights, BatchNorm recalibrated for them)
    from dataclasses import replace
    plan = make_plan(tiny_cnn(), _loader(), replace(TrainConfig(), epochs=1, precision="fp32", **FAST),
                     recipe="auto", schedule_given=False)  # what fit prints before the run: the schedule it runs
    line = next(s for s in plan.summary().splitlines() if s.strip().startswith("schedule:"))
    assert "no LR schedule" in line and "one-cycle" not in line
    model = tiny_cnn()
    sgd = torchspeed.fit(model, _loader(), epochs=1, recipe="auto", lr=0.05,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.05), **FAST)  # an object is the user's: kept
    assert "optimizer" not in sgd.decisions or sgd.decisions["optimizer"].value != "schedulefree"


def test_lr_rescale_keeps_the_schedule_shape():
    from torchspeed.train.schedule import create_scheduler, rescale_lr

    for name in ("onecycle", "cosine", "cyclic"):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        ref_p = torch.nn.Parameter(torch.zeros(2))
        ref = torch.optim.SGD([ref_p], lr=0.3, momentum=0.9)
        s, r = (create_scheduler(name, o, total_steps=40, min_lr=lr / 10) for o, lr in ((opt, 0.1), (ref, 0.3)))
        for _ in range(5):
            opt.step(), s.step(), ref.step(), r.step()
        rescale_lr(opt, s, 3.0)
        for _ in range(30):
            opt.step(), s.step(), ref.step(), r.step()
            assert opt.param_groups[0]["lr"] == pytest.approx(ref.param_groups[0]["lr"], rel=1e-6), name


def test_a_run_that_gives_its_lr_keeps_its_loop_as_the_recipes_prior(tiny_cnn, tmp_path, monkeypatch):
    """auto never loses to the loop it was given for lack of a measurement: with lr given and no budget for a trial,
    the optimizer, LR, constant schedule and loss are the user's; recipe_parts puts label smoothing back."""
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", optimizer="adamw", lr=0.01,
                         precision="fp32", **FAST)
    d = res.decisions
    assert d["recipe_prior"].value == "your loop" and d["schedule"].value == "constant"
    assert d["optimizer"].value.startswith("AdamW") and "label_smoothing" not in d and "lr" not in d
    assert [r["lr"] for r in res.history] == [0.01]
    asked = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", optimizer="adamw", lr=0.01,
                           recipe_parts=("label_smoothing",), precision="fp32", **FAST)
    assert asked.decisions["label_smoothing"].value > 0 and "recipe_prior" not in asked.decisions


def test_a_recipe_part_that_raises_is_named_and_the_run_goes_on_with_its_prior(tiny_cnn, tmp_path, monkeypatch, caplog):
    """A stage that fails is never the end of a run: the optimizer trial raising leaves the given optimizer, says which
    part failed and why, and the run trains to its end."""
    import logging

    import torchspeed.tune.optimizer_trial as trial
    from torchspeed.train.loop.callbacks import Callback

    pytest.importorskip("schedulefree")

    def boom(*a, **k):
        raise RuntimeError("the trial's kernel is missing")

    class StopSoon(Callback):  # the plan sizes its budget for 4,000 steps; the test trains 3
        def on_step_end(self, trainer):
            if trainer.step >= 3:
                trainer.request_stop("enough for the test")

    monkeypatch.setattr("torchspeed.plan.recipe_optimizer.compare_optimizers", boom)
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1000, max_steps=4000, recipe="auto", optimizer="adamw",
                             recipe_parts=("schedulefree",), callbacks=[StopSoon()], precision="fp32",
                             channels_last=False, **FAST)  # nothing for a switch trial to spend the budget on: its
    # race's steps depend on the machine's timing, and they count in the budget the optimizer part is priced in
    assert res.steps == 3 and "recipe part 'optimizer' failed" in caplog.text
    d = res.decisions["optimizer"]
    assert d.value == "adamw" and "'optimizer' failed (RuntimeError: the trial's kernel is missing)" in d.reason
    assert "the run goes on with its prior" in d.reason


def test_the_in_run_lr_measurement_that_raises_leaves_the_prior_lr(tiny_cnn, tmp_path, monkeypatch):
    import torchspeed.plan.inrun as inrun
    from torchspeed.train.loop.callbacks import Callback

    def boom(*a, **k):
        raise ValueError("range test diverged at once")

    class StopSoon(Callback):
        def on_step_end(self, trainer):
            if trainer.step >= 4:
                trainer.request_stop("enough for the test")

    monkeypatch.setattr(inrun, "choose_lr_part", boom)
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1000, max_steps=8000, recipe="auto", recipe_parts=("lr",),
                         callbacks=[StopSoon()], precision="fp32", channels_last=False, fused_optimizer=True,
                         **{k: v for k, v in FAST.items()
                                                                                    if k != "trial"})
    d = res.decisions["lr"]
    assert res.steps == 4 and d.value == 0.1 and "'lr' failed (ValueError: range test diverged at once)" in d.reason


def test_every_part_measures_together_on_a_long_run_where_schedule_free_wins(tiny_cnn, tmp_path, monkeypatch):
    """The parts run together on a run long enough for each to measure: the optimizer trial picks Schedule-Free (an
    injected trial), then the batch part times Schedule-Free steps (it was built in eval mode there before), and the
    run trains to its end."""
    pytest.importorskip("schedulefree")
    import torchspeed.tune.optimizer_trial as trial_mod
    from torchspeed.train.loop.callbacks import Callback

    stepped = []
    real_call = __import__("torchspeed.tune._common", fromlist=["TrainStep"]).TrainStep.__call__

    def spy(self, batch):
        stepped.append(type(self.optimizer).__name__)
        return real_call(self, batch)

    monkeypatch.setattr("torchspeed.tune._common.TrainStep.__call__", spy)
    monkeypatch.setattr("torchspeed.plan.recipe_optimizer.compare_optimizers", lambda *a, **k: trial_mod.OptimizerTrial(
        best="schedulefree", table=(), reason="injected: Schedule-Free reached the loss sooner", steps=50))

    class StopSoon(Callback):
        def on_step_end(self, trainer):
            if trainer.step >= 3:
                trainer.request_stop("enough for the test")

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=10_000, max_steps=20_000, recipe="auto", optimizer="sgd",
                         callbacks=[StopSoon()], precision="fp32", **FAST)
    d = res.decisions
    assert d["optimizer"].value.startswith("AdamWScheduleFree") or d["optimizer"].value == "schedulefree"
    assert "batch_size" in d and "AdamWScheduleFree" in stepped  # the batch part stepped Schedule-Free
    assert res.steps == 3


def test_recipe_auto_keeps_an_optimizer_that_takes_sparse_gradients(tmp_path, monkeypatch):
    """A recommender's sparse embeddings: Schedule-Free's, Muon's and AdamW's steps refuse sparse gradients
    (aten::addcmul_ on SparseCPU), so the optimizer part tries no candidate and the run trains with SGD."""
    from torch import nn

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))

    class MF(nn.Module):
        def __init__(self):
            super().__init__()
            self.u, self.i = nn.Embedding(100, 8, sparse=True), nn.Embedding(80, 8, sparse=True)

        def forward(self, u, i):
            return (self.u(u) * self.i(i)).sum(1)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 100, (16,), generator=g), torch.randint(0, 80, (16,), generator=g),
                torch.randn(16, generator=g)) for _ in range(8)]
    res = torchspeed.fit(MF(), batches, loss_fn=nn.MSELoss(), recipe="auto", epochs=2, **FAST)
    assert res.steps == 16 and res.decisions["optimizer"].value == "sgd"
    assert "sparse gradients" in res.decisions["optimizer"].reason


def test_recipe_auto_keeps_sgd_for_a_model_whose_weights_are_float16(tmp_path, monkeypatch):
    """`model.half()` with no float32 master weights: an Adam-family step divides by sqrt(v) + eps, whose 1e-8 is 0
    in float16; Schedule-Free's prior made every loss NaN and the guard stopped the run. The part tries no candidate
    and the run trains with SGD, as a plain fp16 loop does."""
    from torch import nn

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).half()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 32, generator=g).half(), torch.randint(0, 10, (32,), generator=g)) for _ in range(40)]
    res = torchspeed.fit(model, batches, recipe="auto", **FAST)
    assert res.steps == 40 and str(res.decisions["optimizer"].value).lower().startswith("sgd") and res.skipped_steps == 0
    assert "float16" in res.decisions["optimizer"].reason
