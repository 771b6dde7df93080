"""The recipe's batch part (tune/batch_choice.py): predicted time to a target from the noise scale and samples/s."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.tune.batch import BatchSizeResult, BatchTrial
from torchspeed.train.schedule import scale_lr_for_batch
from torchspeed.tune.batch_choice import (BATCH_MIN_STEPS, choose_batch_size, choose_run_batch, pick_batch_size,
                                         predicted_time)


def test_predicted_time_follows_the_empirical_model_of_large_batch_training():
    # samples needed grow as 1 + B/B_noise; at B = B_noise a run needs twice the minimum samples
    assert predicted_time(100, 100.0, 1.0) == pytest.approx(2.0)
    assert predicted_time(50, 100.0, 1.0, world_size=2) == pytest.approx(2.0)  # the global batch counts


@pytest.mark.parametrize("noise, rates, chosen", [
    # a GPU-like device: samples/s still grow with the batch, and the noise scale is large: go bigger
    (1000.0, {32: 100.0, 64: 190.0, 128: 360.0, 256: 400.0}, 128),
    # a CPU-like device: samples/s flat past 32, noise scale small: a smaller batch is predicted sooner, but the
    # early noise scale is a lower bound, so only larger batches are taken: the batch stays
    (20.0, {32: 100.0, 64: 105.0, 128: 108.0}, 64),
    # within the margin: the loader's own batch stays
    (173.0, {32: 1283.0, 64: 1428.0, 128: 1511.0}, 64),
    # not measurable: stays
    (float("inf"), {32: 100.0, 64: 200.0}, 64),
])
def test_pick_batch_size_takes_the_least_predicted_time(noise, rates, chosen):
    best, rel = pick_batch_size(64, noise, rates)
    assert best == chosen
    if rel:
        assert rel[64] == pytest.approx(1.0) and rel[best] == min(rel.values()) or best == 64


def test_a_smaller_batch_is_taken_only_when_asked():
    best, rel = pick_batch_size(64, 20.0, {32: 100.0, 64: 105.0, 128: 108.0}, smaller=True)
    assert best == 32 and rel[32] < 0.9


def test_pick_batch_size_keeps_the_batch_when_its_rate_is_unknown():
    assert pick_batch_size(64, 50.0, {32: 100.0, 128: 100.0}) == (64, {})


def test_the_lr_follows_the_batch_linearly_for_sgd_and_by_the_square_root_for_adam():
    assert scale_lr_for_batch(0.1, 128, 64, "sgd") == pytest.approx(0.2)
    assert scale_lr_for_batch(1e-3, 256, 64, "adamw") == pytest.approx(2e-3)
    assert scale_lr_for_batch(1e-3, 16, 64, "muon") == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="positive"):
        scale_lr_for_batch(0.1, 0, 64, "sgd")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def _loader(n=1024, bs=16):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 12, generator=g) + y.view(-1, 1).float()
    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=True, generator=torch.Generator().manual_seed(0))


def _inject_rates(monkeypatch, rates: dict[int, float], asked: list):
    import torchspeed.tune.batch as batch_mod

    def fake(model, dataset, *, min_batch=1, max_batch, **kw):  # injected samples/s: no timing in a test
        asked.append((min_batch, max_batch))
        table = tuple(BatchTrial(b, True, r) for b, r in sorted(rates.items()) if min_batch <= b <= max_batch)
        return BatchSizeResult(largest=max_batch, fastest=min_batch, largest_raw=max_batch, limited_by="max_batch",
                               table=table, device="cpu", memory_budget=None, margin=0.1)

    monkeypatch.setattr(batch_mod, "find_batch_size", fake)


def test_choose_batch_size_measures_half_to_four_times_the_batch_and_picks(monkeypatch):
    asked: list = []
    _inject_rates(monkeypatch, {8: 100.0, 16: 190.0, 32: 360.0, 64: 370.0}, asked)
    new, dec = choose_batch_size(_net(), _loader(), total_steps=BATCH_MIN_STEPS, noise_scale=1000.0)
    assert asked == [(16, 64)]  # 16 .. 4 x 16, and an epoch of 1024 samples keeps >= 16 steps
    assert new == 32 and dec.value == 32 and "sooner to a target" in dec.reason
    assert dec.measured["noise_scale"] == 1000.0 and set(dec.measured["predicted_time"]) == {16, 32, 64}


def test_choose_batch_size_keeps_the_batch_of_short_runs_and_of_loaders_it_cannot_rebuild(monkeypatch):
    asked: list = []
    _inject_rates(monkeypatch, {8: 100.0, 16: 190.0, 32: 360.0}, asked)
    new, dec = choose_batch_size(_net(), _loader(), total_steps=BATCH_MIN_STEPS - 1, noise_scale=1000.0)
    assert new is None and dec.value == 16 and "would not pay back" in dec.reason
    new, dec = choose_batch_size(_net(), _loader(), total_steps=None, noise_scale=1000.0)
    assert new is None and "length is unknown" in dec.reason
    batches = list(_loader())
    new, dec = choose_batch_size(_net(), batches, total_steps=10_000, noise_scale=1000.0)
    assert new is None and "not a torch DataLoader" in dec.reason
    assert asked == []  # nothing measured for either


def test_choose_batch_size_measures_the_noise_scale_when_none_is_given(monkeypatch):
    asked: list = []
    _inject_rates(monkeypatch, {8: 100.0, 16: 105.0, 32: 108.0, 64: 110.0}, asked)
    new, dec = choose_batch_size(_net(), _loader(), total_steps=10_000)
    ns = dec.measured["noise_scale"]
    assert ns > 0 and "initial weights" in dec.measured["noise_measured"]
    assert (new or 16) == pick_batch_size(16, ns, {8: 100.0, 16: 105.0, 32: 108.0, 64: 110.0})[0]


def test_fit_rebuilds_the_loader_at_the_recipes_batch_and_scales_the_lr(monkeypatch):
    """The recipe's batch part in fit: the run trains at the chosen batch (fewer steps per epoch), LR x2."""
    from torchspeed import fit

    asked: list = []
    _inject_rates(monkeypatch, {8: 100.0, 16: 190.0, 32: 360.0, 64: 370.0}, asked)
    import torchspeed.plan.recipe_batch as bc  # the recipe's batch part calls the chooser from here

    real = bc.choose_run_batch
    monkeypatch.setattr(bc, "choose_run_batch", lambda *a, **kw: real(*a, **(kw | {"noise_scale": 1000.0,
                                                                                      "min_steps": 1})))
    res = fit(_net(), _loader(), epochs=1, lr=0.05, recipe="auto", recipe_parts=("batch",), progress=False,
              compile=False, trial=False, precision="fp32")
    assert res.decisions["batch_size"].value == 32
    assert res.steps == 1024 // 32  # an epoch at batch 32, not 64 steps at 16
    assert res.decisions["lr"].value == pytest.approx(0.1) and "linear rule" in res.decisions["lr"].reason
    given = fit(_net(), _loader(), epochs=1, lr=0.05, batch_size=16, recipe="auto", recipe_parts=("batch",),
                progress=False, compile=False, trial=False, precision="fp32")
    assert given.steps == 1024 // 16 and "batch_size" not in given.decisions  # the given batch stands, unmeasured


def test_the_lr_trial_reports_the_noise_scale_where_its_run_ended():
    from torchspeed.tune.lr import find_lr
    from torchspeed.tune.lr_peak import refine_onecycle_peak

    model, loader = _net(), _loader()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    res = find_lr(model, loader, optimizer=opt, num_steps=30, progress=False, precision="fp32", fallback=False)
    peak, how, extra = refine_onecycle_peak(model, loader, res, optimizer="sgd", name="sgd", steps=8,
                                            precision="fp32", noise_batches=4)
    assert "trial" in extra and extra["noise_scale"] > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_larger_batch_reconsiders_the_ema_for_the_shorter_run(monkeypatch):
    """The EMA's span follows the run length in steps, which the batch part changes (x2 batch: half the steps)."""
    import torchspeed.plan.recipe_batch as rp  # the recipe's batch part calls the chooser from here
    from torchspeed.plan.parts import Recipe, choose_ema
    from torchspeed.train.decision import Decision

    monkeypatch.setattr(rp, "choose_run_batch", lambda *a, **kw: (128, Decision(128, "injected")))
    for total, on in ((8000, True), (2400, False)):
        rec = Recipe(lr=0.1, parts=("ema", "batch"))
        rec.decisions["ema"] = choose_ema(rec, total)
        assert rec.ema_decay is not None  # both runs are long enough at the loader's batch
        rp.choose_batch(_net(), _loader(bs=64), rec, optimizer="sgd", name="sgd", weight_decay=None,
                        optimizer_options=None, precision="fp32", loss_fn=None, step_fn=None, total_steps=total,
                        noise_scale=1000.0, progress=False)
        assert rec.batch_size == 128 and f"{total // 2} steps at batch 128" in rec.decisions["ema"].reason
        assert (rec.ema_decay is not None) is on
        if on:
            assert rec.ema_decay == pytest.approx(round(1 - 20 / (total // 2), 6))


@pytest.mark.parametrize("run_steps, measured", [(4000, False), (20_000, True)])
def test_the_batch_part_is_priced_with_its_timing_floor_in_the_runs_steps(monkeypatch, run_steps, measured,
                                                                         recipe_of):
    """Steps of 7 ms (a character GRU's): the batch timing's floor (0.9 s) is 129 of them, so the part costs 279
    steps, over the 200 a 5% budget of a 4,000-step run allows (priced in steps alone, 60, it was measured on a
    1,250-step run and took half of it); a 20,000-step run affords it."""
    import torchspeed.plan.recipe_batch as rp
    from torchspeed.train.decision import Decision

    monkeypatch.setattr(rp, "step_seconds", lambda *a, **k: 0.007)  # injected: no clock in a test
    calls = []
    monkeypatch.setattr(rp, "choose_run_batch", lambda *a, **kw: calls.append(1) or (None, Decision(16, "injected")))
    assert rp.batch_cost(0.007) == 150 + 129 and rp.batch_cost(None) == 150
    rec = recipe_of(_net(), _loader(), optimizer="sgd", lr=0.05, steps=run_steps, parts=("batch",), share=0.05,
                    precision="fp32")
    assert bool(calls) is measured
    if not measured:
        reason = rec.decisions["batch_size"].reason
        assert reason.startswith("prior: the loader's batch") and "~279 steps off the run" in reason


def test_a_run_too_short_for_the_batch_part_at_its_least_price_times_nothing(monkeypatch, recipe_of):
    import torchspeed.plan.recipe_batch as rp

    timed = []
    monkeypatch.setattr(rp, "step_seconds", lambda *a, **k: timed.append(1) or 0.007)
    rec = recipe_of(_net(), _loader(), optimizer="sgd", lr=0.05, steps=320, parts=("batch",), share=0.05,
                    precision="fp32")
    assert not timed and "~150 steps off the run" in rec.decisions["batch_size"].reason


def test_one_batch_chooser_time_to_target_on_a_long_run_else_the_fastest_or_the_loaders(monkeypatch):
    """`batch_size="auto"` and the recipe's batch part choose through one function: on a run long enough to pay the
    measurement back, the least predicted time to a target; on a shorter one, the fastest measured (asked to tune)
    or the loader's batch (the recipe)."""
    asked: list = []
    _inject_rates(monkeypatch, {16: 100.0, 32: 190.0, 64: 360.0}, asked)
    opt = torch.optim.SGD(_net().parameters(), lr=1e-3)
    new, dec = choose_run_batch(_net(), _loader(), total_steps=10_000, optimizer=opt, short="fastest",
                                noise_scale=1000.0, precision="fp32")
    assert new == 64 and "sooner to a target" in dec.reason  # time to target: 1-4x the loader's batch measured
    new, dec = choose_run_batch(_net(), _loader(), total_steps=BATCH_MIN_STEPS - 1, optimizer=opt, short="fastest",
                                precision="fp32")
    assert "fastest measured" in dec.reason and asked[-1] == (1, 64)  # up to 1/16 of the 1,024 samples
    n = len(asked)
    new, dec = choose_run_batch(_net(), _loader(), total_steps=BATCH_MIN_STEPS - 1, optimizer=opt, short="keep",
                                noise_scale=1000.0)
    assert new is None and dec.reason.startswith("kept: a run of") and len(asked) == n  # nothing measured


def test_batch_size_auto_is_chosen_at_the_runs_length(monkeypatch):
    """The plan's `tune_batch` stage gives the chooser the run's length at the loader's batch."""
    import torchspeed.tune.auto as auto
    from torchspeed.plan import make_plan
    from torchspeed.train.config import TrainConfig
    from torchspeed.train.decision import Decision

    seen = []
    monkeypatch.setattr(auto, "choose_run_batch", lambda *a, total_steps, short, **kw: seen.append(
        (total_steps, short)) or (32, Decision(32, "injected")))
    plan = make_plan(_net(), _loader(), TrainConfig(epochs=20, progress=False, trial=False, precision="fp32"),
                     batch_size="auto", lr=0.05, device="cpu")
    assert seen == [(20 * 1024 // 16, "fastest")] and plan.loader.batch_size == 32
