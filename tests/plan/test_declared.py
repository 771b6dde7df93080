"""Declared refinement (plan/stages.py `Stage.writes`, `Stage.refines`): every decision key has one stage that decides
it, and only the stages that declare it refine it; `run_event` holds each stage to its declaration (the suite runs
with TORCHSPEED_STAGE_CHECK=raise, tests/conftest.py). A recipe part registered here, with no other edit, is
planned, recorded, rendered and run. No clock is read: the measured parts' results are injected."""

import logging
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
import torchspeed.plan.stages as stages_mod
from torchspeed.plan import budget, make_plan, planner
from torchspeed.plan.stages import (EVENTS, STAGES, Stage, UndeclaredDecision, render_stages, stages, undeclared,
                                    unregister_stage)
from torchspeed.train.loop.callbacks import Callback
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decision

FAST = dict(progress=False, compile=False, malloc=False)
# key -> (the stages that decide it, why more than one may): never both in one plan
SHARED_WRITERS = {
    "batch_size": ({"tune_batch", "batch"}, "the recipe's batch part is off when fit is given batch_size="),
    "lr": ({"tune_lr", "lr"}, "the tuners decide it only when fit is given batch_size= with its own LR (the LR scaled "
                              "to the batch); the recipe's LR part is then off unless recipe_parts names it, and then "
                              "the scaled LR is the part's prior, decided as lr_scaled"),
    "optimizer": ({"optimizer", "optimizer_record"}, "the recipe's optimizer part chooses one; where it did not, the "
                                                     "record of the optimizer the Trainer built from the plan"),
}


def _loader(n=256, batch=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() + 2 * (x[:, 1].mean((1, 2)) > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))


def test_each_decision_key_has_one_writer_and_only_declared_refiners_after_it():
    writers: dict[str, set] = defaultdict(set)
    for s in planner.BUILT_IN:
        assert not set(s.writes) & set(s.refines), f"{s.name} declares a key both written and refined"
        for key in s.writes:
            writers[key].add(s.name)
    assert {k: w for k, w in writers.items() if len(w) > 1} == {k: w for k, (w, _) in SHARED_WRITERS.items()}
    assert {k for s in planner.BUILT_IN for k in s.refines} <= set(writers)
    order = [s.name for event in EVENTS for s in stages(event)]
    for s in planner.BUILT_IN:  # a refiner runs after every stage that may decide the key it refines
        for key in s.refines:
            assert all(order.index(w) < order.index(s.name) for w in writers.get(key, ())), (s.name, key)
    # each tuner and each recipe part is a stage of its own, and the loader is rebuilt last
    before = [s.name for s in stages("before")]
    assert before.index("tuners") < before.index("tune_batch") < before.index("tune_lr") < before.index("tune_loader") \
        < before.index("run_length") < before.index("recipe_setup")
    assert before.index("recipe_setup") < before.index("optimizer") < before.index("lr") < before.index("batch") \
        < before.index("recipe") < before.index("loader") == len(before) - 1
    assert {"label_smoothing", "bn_stats", "ema", "tta_budget"} <= set(before) and "tta" in STAGES


def test_the_check_names_a_key_decided_or_refined_undeclared():
    probe = Stage("probe", "before", lambda ctx: None, writes=("a",), refines=("b",))
    a, b, c = Decision(1, "x"), Decision(2, "y"), Decision(3, "z")
    assert undeclared(probe, {"b": b}, {"a": a, "b": c}) == {}  # decided a, refined b: as declared
    assert undeclared(probe, {}, {"b": b}) == {}  # a refiner may decide a value no stage decided (a given LR scaled)
    assert undeclared(probe, {"a": a, "c": c}, {"a": b, "c": c, "d": a}) == {"a": "refined", "d": "decided"}


def test_a_stage_that_decides_or_refines_a_key_it_did_not_declare_fails(tiny_cnn, registered, monkeypatch, caplog):
    cfg = TrainConfig(epochs=1, trial=False, **FAST)

    def sneaky(ctx):
        ctx.decisions["probe_key"] = Decision(1, "undeclared")

    registered(Stage("probe", "before", sneaky, needs=("run_length",)))
    with pytest.raises(UndeclaredDecision, match=r"the stage 'probe' decided 'probe_key' without declaring it"):
        make_plan(tiny_cnn(), _loader(), cfg, lr=0.05)
    monkeypatch.delenv("TORCHSPEED_STAGE_CHECK")  # outside the suite: a warning, and the run goes on
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        assert make_plan(tiny_cnn(), _loader(), cfg, lr=0.05).decisions["probe_key"].value == 1
    assert "the stage 'probe' decided 'probe_key' without declaring it" in caplog.text
    monkeypatch.setenv("TORCHSPEED_STAGE_CHECK", "raise")
    unregister_stage("probe")
    registered(Stage("probe", "before", lambda ctx: ctx.decisions.refine("schedule", Decision("cosine", "mine")),
                     needs=("run_length",), writes=("schedule_note",)))
    with pytest.raises(UndeclaredDecision, match=r"refined 'schedule'"):
        make_plan(tiny_cnn(), _loader(), cfg, lr=0.05, schedule_given=False)
    unregister_stage("probe")
    registered(Stage("probe", "before", lambda ctx: ctx.decisions.refine("schedule", Decision("cosine", "mine")),
                     needs=("run_length",), refines=("schedule",)))
    plan = make_plan(tiny_cnn(), _loader(), cfg, lr=0.05, schedule_given=False)  # declared: refined
    assert plan.decisions["schedule"].value == "cosine" and plan.decisions["schedule"].refines["value"] == "constant"


class _StopSoon(Callback):
    def on_step_end(self, trainer):
        if trainer.step >= 2:
            trainer.request_stop("enough for the test")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(192, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 4))


def test_real_recipe_runs_keep_every_stage_to_its_declaration(tiny_cnn, monkeypatch, tmp_path):
    """fit with recipe="auto" on several models and runs, every part measured (its result injected) or refused, each
    stage's writes seen: what a stage decided is in its `writes` (its refinements in its `refines`; else the run
    raised), and every key a recipe stage declares it decides, it decides in one of these runs."""
    pytest.importorskip("schedulefree")
    import torchspeed.plan.recipe_batch as recipe_batch
    import torchspeed.plan.recipe_lr as recipe_lr
    import torchspeed.plan.recipe_optimizer as recipe_optimizer
    import torchspeed.tune.optimizer_trial as trial_mod
    from torchspeed.bench.text import GPT

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    seen: dict[str, set] = defaultdict(set)
    real_check = stages_mod._check

    def spy(stage, before, ctx):
        seen[stage.name] |= {k for k, d in ctx.decisions.items() if before.get(k) is not d}
        real_check(stage, before, ctx)

    monkeypatch.setattr(stages_mod, "_check", spy)
    monkeypatch.setattr(recipe_lr, "choose_peak_lr", lambda model, data, **kw: SimpleNamespace(
        lr=0.2, how="injected", evidence="no clock", steps=20, measured={"noise_scale": 500.0}))
    best = {"sgd": "schedulefree", "adamw": "muon"}
    monkeypatch.setattr(recipe_optimizer, "compare_optimizers", lambda model, data, names, **kw: trial_mod.OptimizerTrial(
        best[names[0]], (), f"injected: {best[names[0]]} reached the loss sooner", 10))
    monkeypatch.setattr(recipe_batch, "choose_run_batch", lambda *a, **kw: (32, Decision(32, "injected")))
    monkeypatch.setattr(recipe_batch, "step_seconds", lambda *a, **kw: 0.001)
    long = dict(epochs=10_000, max_steps=40_000, callbacks=[_StopSoon()], precision="fp32", trial=False, **FAST)
    torchspeed.fit(tiny_cnn(), _loader(), recipe="auto", optimizer="sgd", **long)  # Schedule-Free wins, batch x2
    torchspeed.fit(_mlp(), _loader(), recipe="auto", optimizer="adamw", **long)  # Muon wins
    monkeypatch.setattr(budget, "TUNING_SHARE", 20.0)
    torchspeed.fit(tiny_cnn(), _loader(), epochs=2, recipe="auto", recipe_parts=("lr", "label_smoothing", "bn_stats",
                   "ema", "tta", "batch"), val_loader=_loader(64), precision="fp32", **FAST)  # the LR in the run
    monkeypatch.setattr(budget, "TUNING_SHARE", 0.05)
    torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", optimizer="adamw", lr=0.01, **FAST)  # your loop
    torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", lr=0.05, batch_size=32, trial=False, **FAST)
    gpt = GPT(block_size=16, n_layer=1, n_head=2, n_embd=32)
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    torchspeed.fit(gpt, [(tokens[:, :-1], tokens[:, 1:])] * 4, epochs=1, recipe="auto", **FAST)  # a language model
    regression = nn.Sequential(nn.Flatten(), nn.Linear(192, 1))
    batches = [(x, x.mean((1, 2, 3)).unsqueeze(1)) for x, _ in _loader(64)]
    torchspeed.fit(regression, batches, loss_fn=nn.MSELoss(), epochs=1, recipe="auto", **FAST)  # its own loss
    for s in planner.BUILT_IN:
        assert seen[s.name] <= set(s.writes) | set(s.refines), s.name  # (the check raised first)
    recipe_stages = ("recipe_setup", "label_smoothing", "bn_stats", "ema", "optimizer", "lr", "batch", "tta_budget",
                     "recipe", "lr_in_run", "tta")
    for name in recipe_stages:
        assert set(STAGES[name].writes) <= seen[name], (name, seen[name])
    assert {"lr", "ema"} <= seen["batch"] and "schedule" in seen["recipe"] and "lr" in seen["lr_in_run"]


def test_a_part_registered_in_a_test_is_planned_recorded_rendered_and_runs_with_no_other_edit(tiny_cnn, registered):
    """A recipe part: a function of the context that reads what the set-up and earlier parts resolved, writes its
    Decision, and (here) changes the loader's batch, which the plan's last "before" stage rebuilds once."""
    ran = []

    def double_batch(ctx):
        ran.append((ctx.run_steps, ctx.shared.classifier, ctx.rec.label_smoothing))
        batch = ctx.planned_loader().batch_size * 2
        ctx.loader_changes = ctx.loader_changes | {"batch_size": batch}
        ctx.decisions["double_batch"] = Decision(batch, f"twice the loader's batch, for a {ctx.run_steps}-step run")

    registered(Stage("double_batch", "before", double_batch, needs=("label_smoothing",), writes=("double_batch",),
                     cost="0 steps", what="a part registered by a test", when=lambda ctx: ctx.rec is not None))
    assert "| before | `double_batch` | label_smoothing | `double_batch` | - | 0 steps | a part registered by a test |" \
        in render_stages()
    names = [s.name for s in stages("before")]
    assert names.index("label_smoothing") < names.index("double_batch") < names.index("loader") == len(names) - 1
    plan = make_plan(tiny_cnn(), _loader(), TrainConfig(epochs=1, trial=False, **FAST), lr=0.05, recipe="auto")
    assert ran == [(16, True, 0.0)]  # (the run gave its LR: label smoothing is left out)
    assert plan.decisions["double_batch"].value == 32 and plan.loader.batch_size == 32 and plan.run_steps == 8
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, lr=0.05, recipe="auto", trial=False, **FAST)
    assert res.decisions["double_batch"].value == 32 and res.steps == 8  # trained at the part's batch
    assert make_plan(tiny_cnn(), _loader(), TrainConfig(epochs=1, trial=False, **FAST), lr=0.05).loader.batch_size \
        == 16 and len(ran) == 2  # no recipe: the part does not run


def test_the_loader_is_built_once_last_from_the_given_one_with_every_stages_settings(tiny_cnn, registered,
                                                                                     monkeypatch):
    """The tuners' batch and a later stage's setting: the run's loader is built by the last "before" stage, from the
    given loader, with both (not rebuilt from a rebuilt one); the stages in between read the tuners' batch. With the
    tuners' batch alone, the run trains on the loader those stages read: one DataLoader built."""
    built = []
    real = stages_mod.rebuild_loader
    monkeypatch.setattr(stages_mod, "rebuild_loader", lambda *a, **k: built.append((a[0], k)) or real(*a, **k))
    given, cfg = _loader(n=240), TrainConfig(epochs=1, trial=False, **FAST)
    plan = make_plan(tiny_cnn(), given, cfg, lr=0.05, batch_size=32)
    assert built == [(given, {"batch_size": 32})] and plan.loader.batch_size == 32 and plan.run_steps == 8
    seen = []

    def whole_batches(ctx):
        seen.append((ctx.planned_loader().batch_size, ctx.run_steps))
        ctx.loader_changes = ctx.loader_changes | {"drop_last": True}

    registered(Stage("whole_batches", "before", whole_batches, needs=("run_length",)))
    built.clear()
    plan = make_plan(tiny_cnn(), given, cfg, lr=0.05, batch_size=32)
    assert seen == [(32, 8)] and [k for _, k in built] == [{"batch_size": 32}, {"batch_size": 32, "drop_last": True}]
    assert all(src is given for src, _ in built) and plan.loader.drop_last and plan.run_steps == 7  # 240 // 32


def test_a_given_lr_scaled_to_batch_size_is_the_prior_of_the_recipes_lr_part(tiny_cnn, monkeypatch):
    """batch_size= with the run's own LR, and recipe_parts naming "lr": the tuners scale the LR to the batch and the
    recipe's LR part decides it from there (both once wrote "lr", and the plan stopped with a DecisionConflict)."""
    from torchspeed.plan import recipe_lr

    seen = {}

    def choose(model, data, **kw):
        seen["batch"] = data.batch_size
        return SimpleNamespace(lr=0.2, how="injected", evidence="no clock", steps=20, measured={})

    monkeypatch.setattr(recipe_lr, "choose_peak_lr", choose)
    monkeypatch.setattr(budget, "TUNING_SHARE", 20.0)
    res = torchspeed.fit(tiny_cnn(), _loader(batch=16), epochs=1, lr=0.05, batch_size=32, recipe="auto",
                         recipe_parts=("lr",), optimizer="sgd", trial=False, precision="fp32", **FAST)
    d = res.decisions
    assert d["lr_scaled"].value == pytest.approx(0.1) and "scaled to batch 32 from 16" in d["lr_scaled"].reason
    assert "peak_lr" not in d  # the LR part's decision is the peak
    assert seen["batch"] == 32 and d["lr"].value == 0.2 and "injected" in d["lr"].reason
