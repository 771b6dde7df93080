"""The plan's stages (plan/stages.py) and write-once decisions (train/decision.Decisions): a stage registered anywhere
runs at its event with no other edit, a second writer to a decision raises, a stage that fails is named and the run
goes on, and docs/architecture.md shows the registered order."""

import logging
import pathlib

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchspeed
from torchspeed.train.trial.autoswitch import SwitchStage
from torchspeed.plan.stages import STAGES, RunContext, Stage, register_stage, render_stages, stages
from torchspeed.train.config import TrainConfig
from torchspeed.train.decision import Decision, DecisionConflict, Decisions

FAST = dict(progress=False, compile=False, malloc=False, trial=False, precision="fp32", channels_last=False)
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def _loader(n=64, batch=16):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(1))


def test_a_stage_registered_in_a_test_runs_at_its_event_with_no_other_edit(tiny_cnn, registered):
    seen = []

    def before(ctx: RunContext):
        seen.append(("before", ctx.run_steps, ctx.caps is not None))
        ctx.decisions["probe_before"] = Decision(ctx.run_steps, "read from the context")

    def in_run(ctx: RunContext):
        seen.append(("after_switches", ctx.trainer.step, ctx.trainer.switcher.live))
        ctx.trainer.decisions["probe_in_run"] = Decision(ctx.trainer.step, "at the first step end")

    def after(ctx: RunContext):
        seen.append(("after", ctx.result.steps))

    registered(Stage("probe_before", "before", before, needs=("run_length",), writes=("probe_before",)))
    registered(Stage("probe_in_run", "after_switches", in_run, writes=("probe_in_run",)))
    registered(Stage("probe_after", "after", after))
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=2, lr=0.05, **FAST)
    assert seen == [("before", 8, True), ("after_switches", 1, None), ("after", 8)]
    assert res.decisions["probe_before"].value == 8 and res.decisions["probe_in_run"].value == 1
    assert [s.name for s in stages("before")][-2:] == ["probe_before", "loader"]  # the loader's rebuild stays last


def test_stages_run_after_what_they_need_and_a_bad_registration_is_refused(registered):
    order = lambda: [s.name for s in stages("before")]  # noqa: E731
    registered(Stage("needs_recipe", "before", lambda ctx: None, needs=("recipe",)))
    registered(Stage("early", "before", lambda ctx: None, needs=("distributed",)))
    names = order()
    assert names.index("needs_recipe") > names.index("recipe") and names.index("early") > names.index("distributed")
    with pytest.raises(ValueError, match="already registered"):
        register_stage(Stage("recipe", "before", lambda ctx: None))
    with pytest.raises(ValueError, match="not one of"):
        Stage("x", "during", lambda ctx: None)
    registered(Stage("loop_a", "after", lambda ctx: None, needs=("loop_b",)))
    registered(Stage("loop_b", "after", lambda ctx: None, needs=("loop_a",)))
    with pytest.raises(ValueError, match="cycle"):
        stages("after")


def test_a_stage_that_raises_is_named_and_the_run_goes_on_with_its_prior(tiny_cnn, registered, caplog):
    def boom(ctx):
        ctx.lr, ctx.run_steps = 99.0, 1  # changed, then failed: the context goes back to what it held before
        ctx.callbacks.append("half-made")
        raise RuntimeError("probe exploded")

    registered(Stage("probe", "before", boom, needs=("run_length",)))
    plan = torchspeed.plan.make_plan(tiny_cnn(), _loader(), TrainConfig(epochs=1, **FAST), lr=0.05)
    assert plan.lr == 0.05 and plan.run_steps == 4 and "half-made" not in plan.callbacks
    registered(Stage("probe_in_run", "after_switches", lambda ctx: 1 / 0))
    with caplog.at_level(logging.WARNING, logger="torchspeed"):
        res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, lr=0.05, **FAST)
    assert res.steps == 4  # the run trained to its end
    assert "the stage 'probe' failed (RuntimeError: probe exploded)" in res.decisions["probe"].reason
    assert "stage 'probe_in_run' failed (ZeroDivisionError" in res.decisions["probe_in_run"].reason
    assert "stage 'probe' failed" in caplog.text and "goes on with its prior" in caplog.text


def test_a_stage_that_checks_the_users_input_raises(tiny_cnn):
    with pytest.raises(ValueError, match="batch_size"):
        torchspeed.fit(tiny_cnn(), _loader(), epochs=1, batch_size=-3, **FAST)


def test_a_second_writer_to_a_decision_raises_and_a_refinement_keeps_what_it_refines():
    d = Decisions()
    d["lr"] = Decision(0.1, "prior")
    with pytest.raises(DecisionConflict, match=r"decisions\['lr'\] is already decided"):
        d["lr"] = Decision(0.2, "a second writer")
    with pytest.raises(DecisionConflict):
        d.update({"lr": Decision(0.3, "through update")})
    with pytest.raises(TypeError, match="must be a Decision"):
        d["batch"] = 64
    new = d.refine("lr", Decision(0.4, "measured in the run"))
    assert d["lr"] is new and new.value == 0.4 and new.refines == {"value": 0.1, "reason": "prior"}
    assert isinstance(d.copy(), Decisions) and d.copy()["lr"] is new


def test_fit_returns_write_once_decisions_by_construction(tiny_cnn):
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, lr=0.05, **FAST)
    assert isinstance(res.decisions, Decisions)
    with pytest.raises(DecisionConflict):
        res.decisions["precision"] = Decision("bf16", "written twice")


def test_the_trainer_applies_the_plans_decisions_and_refines_them_only_by_name(tiny_cnn):
    """The Trainer records into the plan's decisions (one object: what the stages in the run write, it shows); a
    key decided before and decided again is refined, never silently overwritten."""
    from torchspeed.train.loop.trainer import Trainer

    plan = torchspeed.plan.make_plan(tiny_cnn(), _loader(), TrainConfig(epochs=1, **FAST), lr=0.05)
    trainer = Trainer(tiny_cnn(), lr=plan.lr, config=plan.config, decisions=plan.decisions)
    assert trainer.decisions is plan.decisions and {"device", "switch_plan", "tuning", "precision"} <= set(plan.decisions)
    res = trainer.fit(_loader(), epochs=1)
    assert res.decisions["precision"].refines == {"value": "fp32", "reason": "asked for"}  # the rule, then settled


def test_the_architecture_page_shows_the_registered_stage_order():
    text = DOCS.read_text()
    start, end = "<!-- stages -->", "<!-- /stages -->"
    assert start in text and end in text, "docs/architecture.md: the stage table between its markers"
    shown = text[text.index(start) + len(start):text.index(end)].strip()
    assert shown == render_stages(), "regenerate with: python -c 'import torchspeed.plan.planner as p, " \
                                     "torchspeed.plan.stages as s; print(s.render_stages())'"
    assert set(STAGES) >= {"distributed", "capabilities", "schedule", "tuners", "run_length", "recipe_setup",
                           "label_smoothing", "bn_stats", "ema", "optimizer", "lr", "batch", "tta_budget", "recipe",
                           "loader", "lr_in_run", "tta"}


def test_the_plans_trials_measure_at_the_precision_the_switch_trial_chose(tiny_cnn, monkeypatch, tmp_path):
    """The rule says bf16 on this (injected) bf16 CPU; the injected switch trial measures fp32 faster. The optimizer
    trial and the batch timing (before training) and the LR range test (in the run) all run in fp32."""
    import torchspeed.tune.optimizer_trial as trial_mod
    from torchspeed.plan import budget, recipe_batch, recipe_optimizer
    from torchspeed.tune import lr_peak
    from torchspeed.train.loop.callbacks import Callback
    from torchspeed.train.loop.trainer import Trainer

    monkeypatch.setenv("TORCHSPEED_CPU_PROFILE", "avx512_bf16")
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(budget, "TUNING_SHARE", 20.0)  # every part affordable
    seconds = {"fp32": 0.5, "fp32+channels_last": 0.6, "bf16": 1.0, "bf16+channels_last": 1.0}
    monkeypatch.setattr(SwitchStage, "measure_fn",
                        staticmethod(lambda s, sec: seconds[s.label().replace("+fused", "").replace("+foreach", "")]))
    monkeypatch.setattr(SwitchStage, "_numerics_losses", lambda self, batch: {})
    seen: dict[str, list] = {"optimizer trial": [], "batch timing": [], "LR range test": []}

    def optimizer_trial(model, data, names, **kw):
        seen["optimizer trial"].append(kw["precision"])
        return trial_mod.OptimizerTrial(best="sgd", table=(), reason="injected: SGD stays", steps=50)

    def batch_timing(*a, **kw):
        seen["batch timing"].append(kw["precision"])
        return None, Decision(None, "injected: the loader's batch stays")

    real_find_lr = lr_peak.find_lr
    monkeypatch.setattr(recipe_optimizer, "schedule_free_available", lambda: True)
    monkeypatch.setattr(recipe_optimizer, "compare_optimizers", optimizer_trial)
    monkeypatch.setattr(recipe_batch, "choose_run_batch", batch_timing)
    monkeypatch.setattr(lr_peak, "find_lr", lambda *a, **k: seen["LR range test"].append(k["precision"])
                        or real_find_lr(*a, **k))

    class StopAfterTheLR(Callback):
        def on_step_end(self, trainer):
            if seen["LR range test"] and trainer.step >= 2:
                trainer.request_stop("the test saw every measurement")

    from torchspeed.train.trial.shadow import ShadowTurns
    prepared, timed_apart = [], []  # the switch stages in the order they are armed; the stages that time turns apart
    real_prepare, real_turn = SwitchStage.prepare, ShadowTurns.step
    monkeypatch.setattr(SwitchStage, "prepare",
                        lambda self, *a, **k: prepared.append(self) or real_prepare(self, *a, **k))
    monkeypatch.setattr(ShadowTurns, "step", lambda self, *a: timed_apart.append(self.stage) or real_turn(self, *a))

    res = torchspeed.fit(tiny_cnn(), _loader(n=16 * 40), epochs=1000, max_steps=4000, recipe="auto",
                         fused_optimizer=False, compile=False, progress=False, malloc=False,
                         recipe_parts=("lr", "schedulefree", "batch"), callbacks=[StopAfterTheLR()])
    assert seen == {"optimizer trial": ["fp32"], "batch timing": ["fp32"], "LR range test": ["fp32"]}
    assert res.decisions["switch_plan"].value.startswith("before the plan's trials: fp32")
    assert res.decisions["precision"].value == "fp32"
    assert res.decisions["tuning"].measured["steps_off_run"] >= res.decisions["switch_plan"].measured["steps"] > 0
    # the trial on the copy (armed first) trains its bf16 candidates' own steps: none timed apart there
    assert len(prepared) >= 2 and prepared[0] not in timed_apart


def test_with_nothing_measured_before_training_the_switch_trial_stays_on_the_runs_steps(tiny_cnn):
    """A short run's recipe measures nothing: no steps off the run for the switch trial either."""
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", progress=False, compile=False, malloc=False)
    assert res.decisions["switch_plan"].value == "on the run's first steps"
    assert res.decisions["tuning"].measured["steps_off_run"] == 0


def test_under_fit_the_plan_decides_the_backends_and_the_rules_and_the_trainer_only_applies_them(tiny_cnn,
                                                                                                    monkeypatch):
    """fit = the plan + the Trainer: the backend switches (cudnn.benchmark and TF32, threads, malloc) and the rules'
    precision and layout are decided once, by the plan's "backends" and "rules" stages, before any stage measures;
    the Trainer reads them. A Trainer built without a plan still decides them itself, with the same functions."""
    import torchspeed.train.loop.trainer as trainer_mod
    from torchspeed.train.loop.trainer import Trainer

    before = [s.name for s in stages("before")]
    assert before.index("backends") < before.index("switches") < before.index("tuners")
    assert before.index("rules") < before.index("switches")

    def refuse(*a, **k):
        raise AssertionError("the Trainer decided what the plan had decided")

    monkeypatch.setattr(trainer_mod, "decide_backends", refuse)
    monkeypatch.setattr(trainer_mod, "rule_choice", refuse)
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, lr=0.05, progress=False, compile=False, trial=False)
    d = res.decisions
    assert d["threads"].value >= 1 and d["precision"].reason.startswith("rule:") and "channels_last" in d
    with pytest.raises(AssertionError, match="the Trainer decided"):
        Trainer(tiny_cnn(), lr=0.05, config=TrainConfig(**FAST))  # on its own, it decides (here: refused)


def test_the_switch_trial_is_the_plans_first_steps_stage_and_the_trainer_steps_what_it_arms(tiny_cnn, registered,
                                                                                            monkeypatch, tmp_path):
    """fit's Trainer arms no trial itself: the plan's "first_steps" stages run at the start of its run, with the
    trainer, the loader it trains on and the steps left, and arm the switch and compile trials; the Trainer steps
    the switch trial while it is live. Without the plan's `switch_trial` stage, fit's run has no switch trial; a
    Trainer on its own arms both with the same functions."""
    import torchspeed.plan.planner as planner
    from torchspeed.train.loop.trainer import Trainer

    assert [s.name for s in stages("first_steps")] == ["optimizer_record", "switch_trial", "compile_trial"]
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))  # a measured trial, not an earlier test's cache
    seen, stepped = [], []
    registered(Stage("probe_first", "first_steps", lambda ctx: seen.append(
        (ctx.trainer.step, ctx.steps_left, type(ctx.run_loader).__name__, ctx.trainer.stepper is not None)),
        needs=("switch_trial",)))
    real = SwitchStage.step
    monkeypatch.setattr(SwitchStage, "step", lambda self, *a: stepped.append(1) or real(self, *a))
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=2, lr=0.05, progress=False, compile=False, malloc=False,
                         precision="auto", trial=True)
    assert seen == [(0, 8, "SlicedLoader", True)]  # the trial armed before the probe; the loader sliced
    assert stepped and res.decisions["switch_trial"].value == "measured"
    # the plan's stage is what arms it: without it, fit's run has no switch trial
    monkeypatch.setitem(STAGES, "switch_trial", Stage("switch_trial", "first_steps", lambda ctx: None))
    stepped.clear()
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=2, lr=0.05, progress=False, compile=False, malloc=False,
                         precision="auto", trial=True)
    assert not stepped and "switch_trial" not in res.decisions
    # a Trainer on its own arms them itself, with the same functions as the plan's stages
    trainer = Trainer(tiny_cnn(), lr=0.05, config=TrainConfig(**FAST))
    assert trainer.first_steps == (planner.arm_switch_trial, planner.arm_compile_trial)


def test_the_trainer_steps_what_a_first_steps_stage_arms_and_knows_no_trial(tiny_cnn, registered):
    """The switch trial is stepped through the Trainer's armed `stepper` (a "first_steps" stage arms it, the trial
    disarms it when it settles): any stage can arm one, and the Trainer's `step_batch` steps it in place of the
    plain step, batch by batch, until it is disarmed."""
    stepped = []

    def arm(ctx):
        trainer = ctx.trainer

        def stepper(batch, train_step):
            stepped.append(trainer.step)
            train_step(batch)
            if len(stepped) == 3:
                trainer.stepper = None  # hands the run back to the plain step

        trainer.stepper = stepper

    registered(Stage("probe_stepper", "first_steps", arm, needs=("compile_trial",)))
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=2, lr=0.05, **FAST)
    assert stepped == [0, 1, 2] and res.steps == 8  # the armed stepper trained the first 3; the plain step the rest
