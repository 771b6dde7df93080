"""The workload suite (bench/suite.py): every registered workload's plain loop learns, a workload registered
anywhere joins the suite, and the AlgoPerf scoring gives the hand-computed numbers. Nothing here reads a clock."""

import dataclasses
import functools
import math
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed._extras import MissingExtraError
from torchspeed.bench import suite
from torchspeed.bench.suite import (WORKLOADS, SuiteData, Workload, compute_loss, evaluate, geometric_mean_speed,
                                    load_data, make_optimizer, performance_profile, plain_run, plain_to_target,
                                    plot_profile, profile_score, register_workload, relative_times, suite_workloads,
                                    targets_reached)

from suite_helpers import line_data, registered  # tests/bench/suite_helpers.py

BUILTIN = [w.name for w in suite_workloads()]
EPOCHS = 3  # on reduced data: 8 batches an epoch


def test_the_suite_has_six_kinds_of_workload():
    kinds = {w.kind for w in suite_workloads()}
    assert len(BUILTIN) >= 6 and {"image CNN", "language model", "tabular MLP", "regression", "sequence",
            "transformer on non-text input"} <= kinds
    assert {WORKLOADS[n].loss for n in BUILTIN} == {"cross_entropy", "mse"}
    assert {WORKLOADS[n].metric for n in BUILTIN} == {"val_acc", "val_loss"}
    assert all(w.description and w.epochs > 0 and w.lr > 0 for w in suite_workloads())


@functools.lru_cache(maxsize=None)
def _reduced(name: str) -> SuiteData:
    """The workload's data cut to 8 batches to train on and 400 held out."""
    w = WORKLOADS[name]
    return load_data(w, n_train=8 * w.batch_size, n_val=400)


@pytest.mark.parametrize("name", BUILTIN)
def test_the_plain_loop_learns_on_reduced_data(name):
    w, d = WORKLOADS[name], _reduced(name)
    again = load_data(w, n_train=8 * w.batch_size, n_val=400)
    assert all(torch.equal(a, b) for a, b in zip(d, again)), "the data are made deterministically"
    torch.manual_seed(0)
    before = evaluate(w, w.model(), d.vx, d.vy)
    out = plain_run(w, 0, epochs=EPOCHS, data=d)
    assert out["steps"] == EPOCHS * 8 and out["epochs"] == EPOCHS and len(out["history"]) == EPOCHS
    after = out["metric"]
    if w.metric == "val_acc":
        chance = torch.bincount(d.vy).max().item() / len(d.vy)  # always guessing the commonest class
        assert after >= before + 0.15 and after >= chance + 0.1, (before, after, chance)
    else:
        assert after <= 0.7 * before, (before, after)


@pytest.mark.parametrize("name", BUILTIN)
def test_the_loss_falls_on_one_fixed_batch(name):
    w, d = WORKLOADS[name], _reduced(name)
    x, y = d.x[:w.batch_size], d.y[:w.batch_size]
    torch.manual_seed(0)
    model = w.model()
    opt = make_optimizer(w, model)
    losses = []
    for _ in range(15):
        loss = compute_loss(w, model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses


# ---------------------------------------------------------------- the registry
TINY = Workload("tiny_line", "test", line_data, lambda: nn.Linear(4, 2), "sgd", 0.5, 25, 3, "cross_entropy", "val_acc",
                0.0, "a linear model on one informative feature")


@pytest.fixture
def tiny():
    with registered(TINY) as w:
        yield w


def test_a_workload_registered_anywhere_joins_the_suite(tiny):
    assert suite_workloads()[-1] is tiny and [w.name for w in suite_workloads()][:-1] == BUILTIN
    assert suite_workloads(["tiny_line", "mlp"]) == [tiny, WORKLOADS["mlp"]]
    with pytest.raises(ValueError, match="already registered"):
        register_workload(TINY)
    assert register_workload(dataclasses.replace(TINY, lr=0.1), replace=True).lr == 0.1
    with pytest.raises(ValueError, match="no workload 'nope'"):
        suite_workloads(["nope"])


def test_the_registry_is_left_as_it_was():
    assert "tiny_line" not in WORKLOADS and [w.name for w in suite_workloads()] == BUILTIN


def test_a_workload_names_a_known_optimizer_loss_and_metric():
    for field in ("optimizer", "loss", "metric"):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(TINY, **{field: "nope"})


def test_time_to_target_stops_at_the_first_evaluation_at_the_target(tiny):
    hit = plain_to_target(tiny, seed=1)
    assert (hit["epochs"], hit["steps"], hit["to_target_steps"]) == (1, 4, 4) and hit["to_target_s"] > 0
    miss = plain_to_target(dataclasses.replace(tiny, target=1.01), seed=1)
    assert (miss["epochs"], miss["steps"], miss["to_target_s"], miss["to_target_steps"]) == (3, 12, None, None)
    stopped = plain_run(tiny, 1, on_epoch=lambda epoch, metric: epoch == 1)
    assert stopped["epochs"] == 2 and stopped["steps"] == 8
    loss = dataclasses.replace(tiny, metric="val_loss", target=0.5)
    assert suite.reached(loss, 0.5) and not suite.reached(loss, 0.51) and not suite.reached(tiny, float("nan"))


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.seen = nn.Linear(4, 2), []

    def forward(self, x):
        if self.training:
            self.seen.append(x.clone())
        return self.linear(x)


def test_the_plain_loop_draws_the_batches_a_shuffling_data_loader_draws():
    rec = _Recorder()
    w = dataclasses.replace(TINY, model=lambda: rec)
    d = line_data(0)
    plain_run(w, 7, epochs=2, data=d)
    loader = DataLoader(TensorDataset(d.x, d.y), batch_size=25, shuffle=True,
                        generator=torch.Generator().manual_seed(7))
    expected = [x for _ in range(2) for x, _ in loader]
    assert len(rec.seen) == len(expected) == 8
    assert all(torch.equal(a, b) for a, b in zip(rec.seen, expected))


# ---------------------------------------------------------------- scoring
TABLE = {
    "w1": {"a": 10.0, "b": 20.0, "c": 10.0},  # a and c tie for the fastest
    "w2": {"a": 30.0, "b": 15.0, "c": None},  # c missed
    "w3": {"a": None, "b": None, "c": None},  # no row reached the target
    "w4": {"a": 8.0, "b": 2.0, "c": 5.0},
}
INF = math.inf


def test_relative_times_are_over_the_fastest_row_and_a_miss_is_infinite():
    assert relative_times(TABLE) == {"w1": {"a": 1.0, "b": 2.0, "c": 1.0}, "w2": {"a": 2.0, "b": 1.0, "c": INF},
                                     "w3": {"a": INF, "b": INF, "c": INF}, "w4": {"a": 4.0, "b": 1.0, "c": 2.5}}
    # a row absent on a workload missed there
    assert relative_times({"w1": {"a": 3.0}, "w2": {"a": 2.0, "b": 1.0}}) == {
        "w1": {"a": 1.0, "b": INF}, "w2": {"a": 2.0, "b": 1.0}}


def test_targets_reached_counts_each_rows_hits():
    assert targets_reached(TABLE) == {"a": 3, "b": 3, "c": 2}


def test_the_geometric_mean_speed_is_over_the_workloads_both_reached():
    # b against a: 10/20, 30/15, 8/2 on w1, w2, w4 (w3: neither reached)
    assert geometric_mean_speed(TABLE, "b", "a") == pytest.approx((0.5 * 2.0 * 4.0) ** (1 / 3))
    assert geometric_mean_speed(TABLE, "a", "b") == pytest.approx(4.0 ** (-1 / 3))
    assert geometric_mean_speed(TABLE, "c", "a") == pytest.approx(math.sqrt(1.0 * 8.0 / 5.0))  # w1, w4
    assert geometric_mean_speed(TABLE, "a", "a") == 1.0
    assert geometric_mean_speed({"w": {"a": 1.0, "b": None}}, "b", "a") is None


def test_the_performance_profile_is_the_share_of_all_workloads_within_tau():
    profile = performance_profile(TABLE, (1.0, 2.0, 2.5, 3.0, 4.0))
    assert profile == {"a": {1.0: 0.25, 2.0: 0.5, 2.5: 0.5, 3.0: 0.5, 4.0: 0.75},
                       "b": {1.0: 0.5, 2.0: 0.75, 2.5: 0.75, 3.0: 0.75, 4.0: 0.75},
                       "c": {1.0: 0.25, 2.0: 0.25, 2.5: 0.5, 3.0: 0.5, 4.0: 0.5}}
    default = performance_profile(TABLE)
    assert list(default["a"]) == [1.0 + 0.25 * i for i in range(13)]
    assert default["a"][3.75] == 0.5 and default["c"][2.25] == 0.25 and default["c"][2.5] == 0.5


def test_the_profile_score_is_the_normalised_area_under_the_profile():
    profile = performance_profile(TABLE, (1.0, 2.0, 3.0, 4.0))
    # b: 0.5, 0.75, 0.75, 0.75 -> trapezoids (0.625 + 0.75 + 0.75) over a range of 3
    assert profile_score(profile) == pytest.approx({"a": (0.375 + 0.5 + 0.625) / 3, "b": 2.125 / 3,
                                                    "c": (0.25 + 0.375 + 0.5) / 3})
    best = performance_profile({"w": {"x": 1.0, "y": None}}, (1.0, 4.0))
    assert profile_score(best) == {"x": 1.0, "y": 0.0}


def test_plot_profile_writes_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "profile.png"
    plot_profile(performance_profile(TABLE), path)
    assert path.stat().st_size > 1000


def test_plot_profile_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'torchspeed\[plot\]'"):
        plot_profile(performance_profile(TABLE), tmp_path / "profile.png")


def test_median_run_keeps_the_median_repeat_a_miss_counting_as_slowest():
    from torchspeed.bench.suite import median_run

    runs = [{"to_target_s": t, "seconds": 1.0} for t in (0.3, None, 0.1)]
    assert median_run(runs) == {"to_target_s": 0.3, "seconds": 1.0, "repeats_s": [0.3, None, 0.1], "all_repeats_s": 3.0}
    assert median_run(runs[:1]) == {"to_target_s": 0.3, "seconds": 1.0}
