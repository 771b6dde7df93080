import math
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchspeed.tune.optimizer_trial import compare_optimizers, pick_optimizer


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4] @ torch.randn(4, 4, generator=g)).argmax(1)
    return TensorDataset(x, y)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(),
                         nn.Dropout(0.1), nn.Linear(64, 4))


def test_pick_prefers_the_baseline_unless_clearly_better():
    assert pick_optimizer({"adamw": 2.00, "muon": 1.99})[0] == "adamw"       # 0.5%: within the margin
    assert pick_optimizer({"adamw": 2.00, "muon": 1.90})[0] == "muon"        # 5%
    assert pick_optimizer({"adamw": 1.90, "muon": 2.00})[0] == "adamw"
    assert pick_optimizer({"adamw": float("nan"), "muon": 2.0})[0] == "muon"
    assert pick_optimizer({"adamw": 2.0, "muon": float("inf")})[0] == "adamw"
    with pytest.raises(RuntimeError, match="lower the learning rate"):
        pick_optimizer({"adamw": float("inf"), "muon": float("nan")})


def test_trial_restores_the_model_bit_for_bit_and_picks_the_lower_loss():
    model = _mlp()
    model.eval()  # a mode the trial must put back
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    trial = compare_optimizers(model, _data(), ("adamw", "muon"), lr={"adamw": 3e-3, "muon": 3e-3}, steps=15,
                               batch_size=32, eval_batches=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight)) and model[2].bias.grad is None
    assert not model.training and not any(m.training for m in model.modules())
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    assert np.array_equal(np.random.get_state()[1], rng[2])
    losses = {r["name"]: r["loss"] for r in trial.table}
    assert trial.best == pick_optimizer(losses)[0] and trial.steps == 15 and trial.reason
    # the same trial again gives the same numbers (same state, batches and seed)
    again = compare_optimizers(model, _data(), ("adamw", "muon"), lr=3e-3, steps=15, batch_size=32, eval_batches=2)
    assert [r["loss"] for r in again.table] == [r["loss"] for r in trial.table]


def test_trial_picks_the_candidate_that_learns(monkeypatch):
    # an LR of 0 cannot learn: the other candidate wins by far more than the margin, either way round (the judgement
    # on time is tested on its own below, with injected step times: here every step costs the same)
    import torchspeed.tune.optimizer_trial as ot

    real = ot._judge_by_time
    monkeypatch.setattr(ot, "_judge_by_time", lambda rows, *a, **k: real(
        [r | {"step_s": [0.1] * len(r.get("step_s") or [])} for r in rows], *a, **k))
    trial = compare_optimizers(_mlp(), _data(), ("adamw", "muon"), lr={"adamw": 0.0, "muon": 1e-2}, steps=20,
                               batch_size=32, eval_batches=2)
    assert trial.best == "muon" and "lower loss" in trial.reason
    trial = compare_optimizers(_mlp(), _data(), ("adamw", "muon"), lr={"adamw": 1e-2, "muon": 0.0}, steps=20,
                               batch_size=32, eval_batches=2)
    assert trial.best == "adamw"
    assert "adamw" in str(trial) and "muon" in str(trial)


def test_muon_on_a_conv_net_loses_with_the_reason():
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2))
    data = TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 2, (64,)))
    trial = compare_optimizers(conv, data, lr=1e-2, steps=3, batch_size=16, eval_batches=1)
    assert trial.best == "adamw"
    assert "no hidden 2-D weight matrices" in trial.table[1]["error"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="one per name"):
        compare_optimizers(_mlp(), _data(), lr={"adamw": 1e-3}, steps=2)
    with pytest.raises(ValueError, match="positive"):
        compare_optimizers(_mlp(), _data(), lr=1e-3, steps=0)


def test_a_per_step_winner_with_slower_steps_must_win_on_time():
    """Muon reaches AdamW's final training loss in half the steps: it wins at 1.5x AdamW's step time and loses at 3x."""
    from torchspeed.tune.optimizer_trial import _judge_by_time, seconds_to_loss

    base = [2.0 - 0.05 * i for i in range(20)]   # AdamW ends near 1.1
    fast = [2.0 - 0.1 * i for i in range(20)]    # Muon gets there by step 10
    assert seconds_to_loss(fast, [1.0] * 20, 1.2, window=1) == 9.0
    assert seconds_to_loss(base, [1.0] * 20, -1.0) == float("inf")

    def rows(muon_step):
        return [{"name": "adamw", "curve": base, "step_s": [0.10] * 20},
                {"name": "muon", "curve": fast, "step_s": [muon_step] * 20}]
    best, why = _judge_by_time(rows(0.15), "adamw", "muon", "lower loss", margin=0.02)
    assert best == "muon" and "judged on time" in why
    best, why = _judge_by_time(rows(0.30), "adamw", "muon", "lower loss", margin=0.02)
    assert best == "adamw" and "sooner in time" in why


def test_time_is_judged_on_the_held_back_loss_where_the_trial_scored_it_on_the_way():
    """A Schedule-Free challenger's training loss (at its gradient point, not its average) never reaches the
    baseline's, though its averaged weights beat the baseline's final held-back loss half-way: it wins on time at
    the same step time and loses at 3x; without the held-back reads the training curves decide, as before."""
    from torchspeed.tune.optimizer_trial import _judge_by_time

    base = {"name": "sgd", "curve": [1.0] * 20, "step_s": [0.1] * 20, "loss": 0.5}
    def challenger(step_s):
        return {"name": "schedulefree", "curve": [2.0] * 20, "step_s": [step_s] * 20, "loss": 0.2,
                "held_curve": [(5 * step_s, 0.9), (10 * step_s, 0.45), (15 * step_s, 0.3), (20 * step_s, 0.2)]}
    best, why = _judge_by_time([dict(base), challenger(0.1)], "sgd", "schedulefree", "lower loss", margin=0.02)
    assert best == "schedulefree" and "held-back loss in 1.00 s against 2.00 s" in why
    best, why = _judge_by_time([dict(base), challenger(0.3)], "sgd", "schedulefree", "lower loss", margin=0.02)
    assert best == "sgd" and "sooner in time" in why
    no_reads = {k: v for k, v in challenger(0.1).items() if k != "held_curve"}
    best, why = _judge_by_time([dict(base), no_reads], "sgd", "schedulefree", "lower loss", margin=0.02)
    assert best == "sgd" and "training loss" in why


def test_schedule_free_runs_in_the_trial_with_its_warm_up_and_is_scored_at_its_averaged_weights(monkeypatch):
    """No schedule wraps it, it is in train mode while stepping and in eval mode (averaged weights) when scored."""
    pytest.importorskip("schedulefree")

    modes = []
    import torchspeed.train.eval_view as eval_view  # where the trial's recalibration (recalibrate_averaged) runs

    real = eval_view.recalibrate_bn

    def spy(model, batches, **kw):
        modes.append("recalibrated")
        return real(model, batches, **kw)

    monkeypatch.setattr(eval_view, "recalibrate_bn", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (256,), generator=g)
    data = torch.utils.data.TensorDataset(torch.randn(256, 3, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float(), y)
    trial = compare_optimizers(model, data, ("sgd", "schedulefree"), lr={"sgd": 0.05, "schedulefree": 0.0025},
                               steps=12, batch_size=16, schedule="onecycle")
    rows = {r["name"]: r for r in trial.table}
    assert rows["schedulefree"]["error"] is None and math.isfinite(rows["schedulefree"]["loss"])
    # Schedule-Free alone is scored with statistics for its averaged weights: at 3 checkpoints on the way, and the end
    assert modes == ["recalibrated"] * 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
