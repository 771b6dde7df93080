"""The optimizer prior by run length and model kind (plan/recipe_horizon.py): the table is the committed
measurement's, it is read by kind and length, and a short run takes the prior it names and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import torchspeed
from torchspeed.plan import recipe_horizon
from torchspeed.plan.recipe_horizon import PRIOR, horizon_prior, model_kind, table_from

ROOT = Path(__file__).resolve().parents[2]
HORIZON_JSON = sorted((ROOT / "benchmarks" / "results" / "cpu-avx512-bf16").glob("horizon*.json"))


def test_the_kind_is_read_from_the_modules():
    assert model_kind(nn.Sequential(nn.Linear(4, 8), nn.TransformerEncoderLayer(8, 2, 16))) == "attention"
    assert model_kind(nn.Sequential(nn.Embedding(10, 8), nn.GRU(8, 8))) == "recurrent"
    assert model_kind(nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten(), nn.LazyLinear(3))) == "conv"
    assert model_kind(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))) == "mlp"


def _result(kind: str, winners: dict[int, str]) -> dict:
    return {"workloads": {f"w_{kind}_{len(winners)}": {"kind": kind, "lengths": {
        str(steps): {"summary": {"winner": w}} for steps, w in winners.items()}}}}


def test_the_table_takes_the_winner_of_most_runs_per_kind_and_length():
    results = [_result("conv", {20: "sgd", 50: "sgd", 100: "sf", 2000: "adamw"}),
               _result("conv", {30: "sf", 200: "sf", 300: "adamw"}),
               _result("mlp", {40: "adamw", 60: "sf"})]
    table = table_from(results)
    assert table["conv"] == ((64, "sgd", 2, 3), (256, "schedulefree", 2, 2), (1024, "adamw", 1, 1),
                             (None, "adamw", 1, 1))
    assert table["mlp"] == ((64, "schedulefree", 1, 2),)  # a tie: the incumbent prior stays
    assert "attention" not in table


def _measured(metric: str, lengths: dict[int, dict[str, float]]) -> dict:
    """One workload's results: per length each candidate's mean metric (an accuracy's held-out loss alike for
    all), the best winning."""
    higher = metric == "val_acc"
    out = {}
    for steps, ms in lengths.items():
        summary = {c: {"metric": m, "val_loss": 0.5 if higher else m} for c, m in ms.items()}
        summary["winner"] = (max if higher else min)(ms, key=ms.get)
        out[str(steps)] = {"summary": summary}
    return {"workloads": {"w": {"kind": "conv", "metric": metric, "lengths": out}}}


def test_a_winner_that_lost_to_schedule_free_on_a_shorter_run_of_the_workload_does_not_take_the_pair():
    """AdamW + WSD ends the 200- and 400-step runs best but was behind Schedule-Free at 50 steps: a run whose target
    comes early is behind with it, so those pairs go to Schedule-Free. Where it led at every length, it takes them."""
    late = _measured("val_acc", {50: {"sf": 0.80, "adamw_wsd": 0.60}, 200: {"sf": 0.83, "adamw_wsd": 0.85},
                                 400: {"sf": 0.86, "adamw_wsd": 0.88}})
    assert table_from([late])["conv"] == ((64, "schedulefree", 1, 1), (256, "schedulefree", 1, 1),
                                          (1024, "schedulefree", 1, 1))
    always = _measured("val_loss", {50: {"sf": 3.0, "adamw_wsd": 2.8}, 200: {"sf": 2.5, "adamw_wsd": 2.3},
                                    400: {"sf": 2.2, "adamw_wsd": 2.0}})
    assert table_from([always])["conv"] == ((64, "adamw+wsd", 1, 1), (256, "adamw+wsd", 1, 1),
                                            (1024, "adamw+wsd", 1, 1))
    tied = _measured("val_acc", {50: {"sf": 0.801, "adamw_wsd": 0.799}, 200: {"sf": 0.83, "adamw_wsd": 0.85}})
    assert table_from([tied])["conv"][1] == (256, "adamw+wsd", 1, 1)  # a tie at 50 steps (the same half point)


def test_the_prior_is_read_by_kind_and_length():
    table = {"conv": ((64, "sgd", 2, 3), (256, "schedulefree", 2, 2)), "mlp": ((1024, "adamw", 3, 3),)}
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    pick, why = horizon_prior(conv, 40, table)
    assert pick == "sgd" and "2 of 3 measured conv runs of up to 64 steps" in why
    assert horizon_prior(conv, 100, table)[0] == "schedulefree"
    pick, why = horizon_prior(conv, 5000, table)  # beyond what was measured: the nearest bucket, said
    assert pick == "schedulefree" and "nothing measured at this length" in why
    assert horizon_prior(nn.Linear(3, 3), 10, table)[0] == "adamw"
    pick, why = horizon_prior(nn.GRU(3, 3), 10, table)
    assert pick is None and "no run of a recurrent model" in why


@pytest.mark.skipif(not HORIZON_JSON, reason="no horizon measurement committed for this CPU kind")
def test_the_prior_table_is_the_committed_measurement():
    results = [json.loads(p.read_text()) for p in HORIZON_JSON]
    assert table_from(results) == PRIOR


def _loader(n=256, batch=16, size=8, classes=4):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


@pytest.mark.parametrize("winner", ["sgd", "schedulefree"])
def test_a_short_cold_run_takes_the_optimizer_the_table_names_and_says_so(tiny_cnn, tmp_path, monkeypatch, winner):
    """16 steps: no budget for an optimizer trial. The table's winner for a conv net of that length is taken (SGD:
    the given optimizer stays; Schedule-Free: it replaces it), with the measurement named in the reason."""
    if winner == "schedulefree":
        pytest.importorskip("schedulefree")
    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(recipe_horizon, "PRIOR", {"conv": ((64, winner, 3, 4),)})
    res = torchspeed.fit(tiny_cnn(), _loader(), epochs=1, recipe="auto", precision="fp32", progress=False,
                         compile=False)
    opt = res.decisions["optimizer"]
    assert (opt.value == "schedulefree" if winner == "schedulefree" else str(opt.value).startswith("SGD ("))
    assert opt.reason.startswith("prior: ")
    assert "3 of 4 measured conv runs of up to 64 steps" in opt.reason
    assert ("Schedule-Free" in opt.reason) == (winner == "schedulefree")


def test_a_short_run_given_sgd_takes_adamw_at_its_own_lr_where_the_table_says_so(tmp_path, monkeypatch):
    """The table names AdamW for this kind and length: a run given SGD by name (fit's default) trains with AdamW
    at AdamW's default LR as the peak of its one-cycle, not at SGD's 0.1."""
    pytest.importorskip("schedulefree")  # the licence to replace SGD is the Schedule-Free part's
    from torchspeed.train.loop.trainer import Trainer
    from torchspeed.train.optim_info import default_lr

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(recipe_horizon, "PRIOR", {"mlp": ((64, "adamw", 4, 4),)})
    used = []
    real = Trainer.setup_schedule
    monkeypatch.setattr(Trainer, "setup_schedule", lambda self, *a: used.append(self.optimizer) or real(self, *a))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    res = torchspeed.fit(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), loader, epochs=1,
                         recipe="auto", precision="fp32", progress=False, compile=False)
    opt = res.decisions["optimizer"]
    assert str(opt.value).startswith("AdamW") and "adamw in place of sgd" in opt.reason
    assert res.decisions["lr"].value == default_lr("adamw")
    assert used and type(used[0]).__name__ == "AdamW"
    assert max(g["lr"] for g in used[0].param_groups) <= default_lr("adamw") + 1e-12


def _mlp_run(monkeypatch, tmp_path, **kw):
    """A 16-step MLP run under recipe="auto" whose table names `PRIOR`'s mlp row; the LR of each optimizer step."""
    from torchspeed.train.loop.trainer import Trainer

    monkeypatch.setenv("TORCHSPEED_CACHE_DIR", str(tmp_path))
    lrs: list[float] = []
    real = Trainer.setup_schedule

    def spy(self, *a):  # the LR each optimizer step trained at: read as the scheduler steps after it
        real(self, *a)
        sched_step = self.scheduler.step

        def step(*sa, **skw):
            lrs.append(self.optimizer.param_groups[0]["lr"])
            return sched_step(*sa, **skw)
        self.scheduler.step = step
    monkeypatch.setattr(Trainer, "setup_schedule", spy)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 4, (256,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    res = torchspeed.fit(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), loader, epochs=1,
                         recipe="auto", precision="fp32", progress=False, compile=False, **kw)
    return res, lrs


def test_a_prior_that_names_its_schedule_trains_with_it_and_says_so(tmp_path, monkeypatch):
    """The table names AdamW with warmup-stable-decay ("adamw+wsd"): the run given SGD by name trains AdamW at its
    default LR, held at the peak and cooled to zero over the last fifth, and the plan says the schedule is the
    prior's. With the schedule part of the pick ignored it would train the plan's one-cycle: no flat middle."""
    pytest.importorskip("schedulefree")  # the licence to replace SGD is the Schedule-Free part's
    from torchspeed.train.optim_info import default_lr

    monkeypatch.setattr(recipe_horizon, "PRIOR", {"mlp": ((64, "adamw+wsd", 4, 4),)})
    res, lrs = _mlp_run(monkeypatch, tmp_path)
    assert str(res.decisions["optimizer"].value).startswith("AdamW")
    assert "warmup-stable-decay" in res.decisions["optimizer"].reason
    assert res.decisions["schedule"].value == "wsd" and "prior" in res.decisions["schedule"].reason
    peak = default_lr("adamw")
    assert len(lrs) == 16 and max(lrs) == pytest.approx(peak)
    assert sum(1 for lr in lrs if lr == pytest.approx(peak)) >= 10  # the stable part (one-cycle peaks once)
    assert lrs[-1] < 0.3 * peak


def test_a_schedule_you_gave_stands_over_the_priors(tmp_path, monkeypatch):
    pytest.importorskip("schedulefree")
    monkeypatch.setattr(recipe_horizon, "PRIOR", {"mlp": ((64, "adamw+wsd", 4, 4),)})
    res, _ = _mlp_run(monkeypatch, tmp_path, schedule="onecycle")
    assert str(res.decisions["optimizer"].value).startswith("AdamW")
    assert "your schedule (onecycle) kept in place of wsd" in res.decisions["optimizer"].reason
    assert res.config["schedule"] == "onecycle"


def test_a_table_pick_splits_into_optimizer_schedule_and_lr_rule():
    from torchspeed.plan.recipe_horizon import prior_parts
    assert prior_parts("adamw") == ("adamw", None, False)
    assert prior_parts("adamw+wsd") == ("adamw", "wsd", False)
    assert prior_parts("adamw+wsd+width") == ("adamw", "wsd", True)


def test_a_prior_measured_at_the_width_rules_lr_trains_at_it(tmp_path, monkeypatch):
    """"adamw+wsd+width": AdamW under warmup-stable-decay at the LR the width rule gives (Schedule-Free's, the LR the
    table measured it with), not at AdamW's default 1e-3; the LR decision says where it came from."""
    pytest.importorskip("schedulefree")
    from torchspeed.train.optim import schedule_free_lr

    monkeypatch.setattr(recipe_horizon, "PRIOR", {"mlp": ((64, "adamw+wsd+width", 4, 4),)})
    res, lrs = _mlp_run(monkeypatch, tmp_path)
    width_lr = schedule_free_lr(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))[0]
    assert width_lr != pytest.approx(1e-3)
    assert str(res.decisions["optimizer"].value).startswith("AdamW")
    assert "at the width rule's LR, with the warmup-stable-decay schedule" in res.decisions["optimizer"].reason
    assert res.decisions["lr"].value == pytest.approx(width_lr) and "width rule" in res.decisions["lr"].reason
    assert res.decisions["schedule"].value == "wsd"
    assert max(lrs) == pytest.approx(width_lr) and sum(1 for lr in lrs if lr == pytest.approx(width_lr)) >= 10
