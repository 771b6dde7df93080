"""The measured training recipe (plan/recipe.py and its parts, fit(recipe="auto")): what it chooses, and on what data.
Each test reads the recipe the plan chose (`recipe_of`: make_plan(..., recipe="auto"))."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.plan.parts import EMA_MIN_STEPS, PARTS, Recipe
from torchspeed.plan.recipe import is_classifier

KEEP_OPT = tuple(p for p in PARTS if p != "schedulefree")  # the user's optimizer kept: the LR part measures


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


def _loader(n=128, bs=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 3, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float()  # learnable: brightness is the class
    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(seed))


def test_a_short_bn_classifier_gets_smoothing_bn_statistics_and_a_measured_lr_and_is_left_as_it_was(recipe_of):
    model = _bn_net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rec = recipe_of(model, _loader(), steps=40, lr_steps=30, precision="fp32", parts=KEEP_OPT)
    assert rec.label_smoothing == 0.1 and rec.bn_stats and rec.ema_decay is None
    assert rec.lr > 0 and rec.min_lr == pytest.approx(rec.lr / 10) and rec.lr != 0.1
    assert rec.tuning_steps >= 30 and rec.tuning_s > 0
    assert rec.decisions["lr"].measured["range_test_steps"] >= 10 and "range test" in rec.decisions["lr"].reason
    assert "under 2000" in rec.decisions["ema"].reason
    for k, v in model.state_dict().items():  # the range test restored every weight and buffer bit for bit
        assert torch.equal(v, before[k]), k
    assert [type(c).__name__ for c in rec.callbacks()] == ["FinalBatchNormStats"]
    assert rec.config() == {"label_smoothing": 0.1, "min_lr": rec.min_lr}
    back = Recipe.from_dict(rec.to_dict())
    assert (back.lr, back.label_smoothing, back.bn_stats, back.parts) == (rec.lr, 0.1, True, KEEP_OPT)


def test_parts_left_out_stay_as_today_and_unknown_parts_are_refused(recipe_of):
    rec = recipe_of(_bn_net(), _loader(), lr=0.05, parts=("bn_stats",))
    assert rec.lr == 0.05 and rec.min_lr is None and rec.label_smoothing == 0.0 and rec.bn_stats
    assert rec.tuning_steps == 0 and "lr" not in rec.decisions
    with pytest.raises(ValueError, match="unknown recipe part"):
        recipe_of(_bn_net(), _loader(), parts=("lr", "mixup"))


def test_no_smoothing_for_a_users_own_loss_or_a_regression_and_no_bn_part_without_batchnorm(recipe_of):
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(192, 4))
    rec = recipe_of(mlp, _loader(), loss_fn=nn.CrossEntropyLoss(), parts=("label_smoothing", "bn_stats"))
    assert rec.label_smoothing == 0.0 and not rec.bn_stats
    batch = next(iter(_loader()))
    assert is_classifier(mlp, batch) and not is_classifier(mlp, batch, loss_fn=nn.MSELoss())
    assert not is_classifier(nn.Sequential(nn.Flatten(), nn.Linear(192, 1)), (batch[0], batch[1].float()))
    seen = []
    mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    assert is_classifier(mlp, batch) and seen == [2] < [len(batch[0])]  # the shapes, read off 2 samples


def test_a_long_run_gets_an_ema_spanning_about_a_twentieth_of_it(recipe_of):
    rec = recipe_of(_bn_net(), _loader(), steps=10_000, parts=("ema",))
    assert rec.ema_decay == pytest.approx(1 - 20 / 10_000)
    assert [type(c).__name__ for c in rec.callbacks()] == ["EMA"]
    short = recipe_of(_bn_net(), _loader(), steps=EMA_MIN_STEPS - 1, parts=("ema",))
    assert short.ema_decay is None


def _fit_with(val_loader):
    from torchspeed import fit
    from torchspeed.plan import budget

    import os
    import tempfile

    budget.TUNING_SHARE, share = 20.0, budget.TUNING_SHARE  # a budget that affords measuring in a 16-step run
    cache, os.environ["TORCHSPEED_CACHE_DIR"] = os.environ.get("TORCHSPEED_CACHE_DIR"), tempfile.mkdtemp()  # measure

    model = _bn_net()
    try:
        return fit(model, _loader(), epochs=2, val_loader=val_loader, recipe="auto", progress=False, compile=False,
                   trial=False, precision="fp32", recipe_parts=KEEP_OPT)  # the LR part measures (no clock in it)
    finally:
        budget.TUNING_SHARE = share
        if cache is not None:
            os.environ["TORCHSPEED_CACHE_DIR"] = cache


def test_fit_recipe_auto_chooses_on_training_data_only():
    """Replacing the validation set changes none of the recipe's choices."""
    g = torch.Generator().manual_seed(5)
    val_a = DataLoader(TensorDataset(torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 4, (32,), generator=g)),
                       batch_size=16)
    val_b = DataLoader(TensorDataset(torch.randn(48, 3, 8, 8, generator=g) * 5, torch.zeros(48, dtype=torch.long)),
                       batch_size=8)
    a, b = _fit_with(val_a), _fit_with(val_b)
    for key in ("lr", "label_smoothing", "ema", "tta"):
        assert a.decisions[key].value == b.decisions[key].value, key
    assert a.decisions["lr"].measured == b.decisions["lr"].measured
    assert a.config["label_smoothing"] == 0.1 and a.config["min_lr"] == pytest.approx(a.decisions["lr"].value / 10)
    assert "BatchNorm statistics averaged over the last 4 of 16 steps" in str(a.decisions["bn_stats"])
    assert a.history[-1]["val_acc"] != b.history[-1]["val_acc"]  # the validation sets did differ


def test_fit_refuses_unknown_recipes():
    from torchspeed import fit

    with pytest.raises(ValueError, match="recipe='auto'"):
        fit(_bn_net(), _loader(), recipe="fast", progress=False)
    with pytest.raises(ValueError, match="recipe_parts needs"):
        fit(_bn_net(), _loader(), recipe_parts=("lr",), progress=False)


def test_muon_is_tried_for_adamw_on_a_matrix_heavy_model_and_not_on_a_conv_net(monkeypatch, recipe_of):
    import torchspeed.tune.optimizer_trial as trial_mod
    from torchspeed.tune.optimizer_trial import OptimizerTrial

    mlp = nn.Sequential(nn.Flatten(), nn.Linear(192, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                        nn.Linear(128, 4))
    asked = []

    def fake(model, data, names, **kw):  # injected trial result: Muon learns faster here
        asked.append(names)
        return OptimizerTrial("muon", ({"name": "adamw", "loss": 1.0}, {"name": "muon", "loss": 0.8}),
                              "muon's held-back loss is 20% lower", 10)

    monkeypatch.setattr("torchspeed.plan.recipe_optimizer.compare_optimizers", fake)
    rec = recipe_of(mlp, _loader(), optimizer="adamw", lr=1e-3, parts=("muon",))
    assert asked == [("adamw", "muon")] and rec.optimizer == "muon" and rec.tuning_steps == 20
    assert rec.decisions["optimizer"].value == "muon" and "T42" in rec.decisions["optimizer"].reason
    conv = recipe_of(_bn_net(), _loader(), optimizer="adamw", lr=1e-3, parts=("muon",))
    assert conv.optimizer is None and "not tried" in conv.decisions["optimizer"].reason and len(asked) == 1
    sgd = recipe_of(mlp, _loader(), optimizer="sgd", parts=("muon",))
    assert sgd.optimizer is None and len(asked) == 1  # Muon replaces AdamW only


def test_a_language_model_gets_no_label_smoothing(recipe_of):
    from torchspeed.bench.text import GPT

    torch.manual_seed(0)
    gpt = GPT(block_size=16, n_layer=1, n_head=2, n_embd=32)
    tokens = torch.randint(0, 64, (4, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    assert not is_classifier(gpt, batch)
    rec = recipe_of(gpt, [batch] * 4, parts=("label_smoothing",))
    assert rec.label_smoothing == 0.0 and "left alone" in rec.decisions["label_smoothing"].reason


def _fake_trial(monkeypatch, best):
    import torchspeed.tune.optimizer_trial as trial_mod
    from torchspeed.tune.optimizer_trial import OptimizerTrial

    asked = []

    def fake(model, data, names, *, lr, **kw):  # an injected trial result: no clock here
        asked.append((names, dict(lr)))
        return OptimizerTrial(best, tuple({"name": n, "loss": 0.5 if n == best else 1.0} for n in names),
                              f"{best} reached the baseline's loss sooner", 10)

    monkeypatch.setattr("torchspeed.plan.recipe_optimizer.compare_optimizers", fake)
    return asked


@pytest.mark.parametrize("best", ["schedulefree", "sgd"])
def test_schedule_free_is_measured_against_the_given_optimizer_when_the_budget_allows(monkeypatch, best, recipe_of):
    pytest.importorskip("schedulefree")
    from torchspeed.tune import lr_peak as lr_mod
    from torchspeed.train.optim import SCHEDULE_FREE_LR, schedule_free_lr

    sf_lr = schedule_free_lr(_bn_net())[0]  # the candidate's LR for this (narrow) model's width
    assert sf_lr > SCHEDULE_FREE_LR
    asked = _fake_trial(monkeypatch, best)
    ranges = []
    real = lr_mod.find_lr
    monkeypatch.setattr(lr_mod, "find_lr", lambda *a, **k: ranges.append(1) or real(*a, **k))
    rec = recipe_of(_bn_net(), _loader(), lr=0.05, steps=40, lr_steps=20, lr_trial_steps=0,
                    parts=("lr", "bn_stats", "schedulefree"), precision="fp32")
    assert asked == [(("sgd", "schedulefree"), {"sgd": 0.05, "schedulefree": sf_lr})]
    assert rec.decisions["optimizer"].value == best and rec.decisions["optimizer"].measured["table"]
    if best == "schedulefree":  # it replaces the LR search, the floor and the BatchNorm tail
        assert rec.optimizer == "schedulefree" and rec.lr == sf_lr and rec.min_lr is None
        assert not rec.bn_stats and rec.callbacks() == [] and not ranges
        assert rec.tuning_steps == 20  # the trial's 10 steps x 2 candidates, and no range test
    else:
        assert rec.optimizer is None and rec.bn_stats and ranges and rec.lr != sf_lr


def test_schedule_free_is_the_prior_when_the_budget_refuses_and_the_cache_the_next_time(monkeypatch, tmp_path,
                                                                                       recipe_of):
    pytest.importorskip("schedulefree")
    from torchspeed.train.decision import TrialCache

    asked = _fake_trial(monkeypatch, "sgd")
    cache = TrialCache(tmp_path / "c.json")
    kw = dict(steps=40, parts=("lr", "schedulefree"), precision="fp32", cache=cache, lr_steps=20,
              lr_trial_steps=0)  # no LR given: Schedule-Free is the prior
    rec = recipe_of(_bn_net(), _loader(), share=0.05, **kw)  # 2 steps of budget: no trial
    assert not asked and rec.optimizer == "schedulefree" and rec.tuning_steps == 0
    assert rec.decisions["optimizer"].reason.startswith("prior: Schedule-Free AdamW")
    measured = recipe_of(_bn_net(), _loader(), share=None, **kw)  # no limit: measured (sgd wins), cached
    assert asked and measured.optimizer is None
    again = recipe_of(_bn_net(), _loader(), share=0.05, **kw)
    assert len(asked) == 1 and again.optimizer is None and again.decisions["optimizer"].reason.startswith("cached")


def test_without_the_package_or_for_another_optimizer_schedule_free_is_not_a_candidate(monkeypatch, recipe_of):
    import torchspeed.plan.recipe_optimizer as optim  # where the recipe looks the package up

    asked = _fake_trial(monkeypatch, "schedulefree")
    monkeypatch.setattr(optim, "schedule_free_available", lambda: False)
    rec = recipe_of(_bn_net(), _loader(), lr=0.05, parts=("schedulefree",))
    assert rec.optimizer is None and not asked and "pip install 'torchspeed[schedulefree]'" in \
        rec.decisions["optimizer"].reason
    monkeypatch.setattr(optim, "schedule_free_available", lambda: True)
    lamb = recipe_of(_bn_net(), _loader(), optimizer="lamb", lr=0.05, parts=("schedulefree",))
    assert lamb.optimizer is None and not asked  # a deliberate choice (LAMB, LARS, Muon, an object) is kept
