"""The suite's runner (bench/suite_run.py) and `torchspeed bench`'s default: a workload registered in a test runs
with no other edit, every row records its budget, seconds, choosing and steps, a miss is a miss and scores
infinite, the rows are interleaved, and the table prints. Nothing here asserts a duration."""

import dataclasses
import json
import math
import sys

import pytest
import torch
from rich.console import Console
from torch import nn

from torchspeed.bench import suite_report, suite_run
from torchspeed.bench.suite import Workload, suite_workloads
from torchspeed.cli.main import main

from suite_helpers import line_data, registered  # tests/bench/suite_helpers.py


TINY = Workload("tiny_suite", "test", line_data, lambda: nn.Linear(4, 2), "sgd", 0.5, 25, 2, "cross_entropy", "val_acc",
                0.0, "a linear model on one informative feature")
RUN_FIELDS = {"call", "seed", "budget_epochs", "budget_steps", "to_target_s", "reached", "seconds", "steps_to_target",
              "steps_trained", "stopped", "metric", "choosing_s", "in_run_choosing_s", "steps_measured", "decisions"}


@pytest.fixture
def tiny():
    with registered(TINY) as w:
        yield w


def _fake_run(calls, *, reach=lambda w, row, seed: True):
    def run_row(w, row, seed, data, *, cap_s=None, cache_dir=None):
        calls.append((w.name, row, seed, cache_dir))
        hit = reach(w, row, seed)
        return {"seed": seed, "budget_epochs": 1, "budget_steps": 4, "to_target_s": 1.0 + len(row) if hit else None,
                "reached": hit, "seconds": 2.0, "steps_to_target": 4 if hit else None, "steps_trained": 4,
                "stopped": "target" if hit else "budget", "metric": 0.5, "choosing_s": 0.0, "in_run_choosing_s": 0.0,
                "steps_measured": 0, "decisions": {}}
    return run_row


@pytest.fixture
def fake(monkeypatch):
    """run_suite with its runs and warm-ups replaced (no training): the calls in order."""
    calls = []
    monkeypatch.setattr(suite_run, "run_row", _fake_run(calls))
    monkeypatch.setattr(suite_run, "_warm_up", lambda w, data, first: 0.01)
    monkeypatch.setattr(suite_run, "load_data", lambda w: line_data(0))
    return calls


def test_a_workload_registered_in_a_test_is_run_by_the_suite(tiny, fake):
    res = suite_run.run_suite(seeds=(0,), console=Console(file=sys.stderr))
    names = [w.name for w in suite_workloads()]
    assert list(res["workloads"]) == names and names[-1] == "tiny_suite"
    assert {c[0] for c in fake} == set(names)
    assert res["workloads"]["tiny_suite"]["rows"].keys() == set(suite_run.ROWS) - set(res["rows_left_out"])


def test_rows_are_interleaved_and_rotated_per_seed_with_auto_warm_after_its_auto(tiny, fake):
    rows = ("naive", "fit", "auto", "auto_warm")
    suite_run.run_suite(workloads=["tiny_suite", "mlp"], rows=rows, seeds=(0, 1), console=Console(file=sys.stderr))
    seed0 = [(w, r) for w, r, s, _ in fake if s == 0]
    assert seed0 == [(w, r) for w in ("tiny_suite", "mlp") for r in rows]  # every row of a workload, then the next
    seed1 = [r for w, r, s, _ in fake if s == 1 and w == "mlp"]
    assert seed1 == ["fit", "auto", "auto_warm", "naive"]  # rotated by one
    auto = [c for c in fake if c[1] in ("auto", "auto_warm")]
    assert all(a[3] is not None and a[3] == b[3] for a, b in zip(auto[::2], auto[1::2]))  # warm reads auto's cache
    assert all(c[3] is None for c in fake if c[1] in ("naive", "fit"))
    with pytest.raises(ValueError, match="add auto"):
        suite_run.run_suite(workloads=["tiny_suite"], rows=("naive", "auto_warm"), console=Console(file=sys.stderr))


def _clocked(monkeypatch, seconds: float):
    """run_suite's runs faked, each taking `seconds` on the returned clock."""
    now = [0.0]

    def run_row(w, row, seed, data, **kw):
        now[0] += seconds
        return _fake_run([])(w, row, seed, data)

    monkeypatch.setattr(suite_run, "run_row", run_row)
    monkeypatch.setattr(suite_run, "_warm_up", lambda w, data, first: 0.01)
    return lambda: now[0]


def test_a_seed_that_would_end_past_the_time_limit_is_left_out(tiny, monkeypatch):
    clock = _clocked(monkeypatch, 10.0)
    res = suite_run.run_suite(workloads=["tiny_suite"], rows=("naive", "fit"), seeds=(0, 1, 2), time_limit_s=45.0,
                              console=Console(file=sys.stderr), clock=clock)
    assert res["seeds"] == [0, 1] and res["left_out"] == [{"seed": 2, "workloads": ["tiny_suite"]}]  # 20 s a seed
    assert res["workloads"]["tiny_suite"]["rows"]["fit"]["seeds"] == 2


def test_no_workload_starts_past_the_time_limit(tiny, monkeypatch):
    clock = _clocked(monkeypatch, 10.0)
    res = suite_run.run_suite(workloads=["mlp", "tiny_suite", "cnn1d"], rows=("naive", "fit"), seeds=(0, 1),
                              time_limit_s=25.0, console=Console(file=sys.stderr), clock=clock)
    assert res["seeds"] == [0] and list(res["workloads"]) == ["mlp", "tiny_suite"] == list(res["table"])
    assert res["left_out"] == [{"seed": 0, "workloads": ["cnn1d"]},
                               {"seed": 1, "workloads": ["mlp", "tiny_suite", "cnn1d"]}]
    assert res["score"]["targets_reached"] == {"naive": 2, "fit": 2}  # cnn1d, never run, is not scored


def test_a_workload_still_running_past_the_margin_is_stopped_and_its_seed_dropped(tiny, monkeypatch):
    caps = []
    clock = _clocked(monkeypatch, 40.0)
    monkeypatch.setattr(suite_run, "MIN_CAP_S", 1000.0)  # each run's cap: the time left to the hard stop
    real = suite_run.run_row
    monkeypatch.setattr(suite_run, "run_row", lambda w, row, seed, data, cap_s=None, **kw: (
        caps.append(cap_s), real(w, row, seed, data, cap_s=cap_s, **kw))[1])
    res = suite_run.run_suite(workloads=["tiny_suite", "mlp"], rows=("naive", "fit", "auto", "auto_warm"),
                              seeds=(0,), time_limit_s=100.0, console=Console(file=sys.stderr), clock=clock)
    # tiny_suite: 4 runs of 40 s end at 160 s (past 100 s, not past 190 s); mlp starts past the limit: left out
    assert list(res["workloads"]) == ["tiny_suite"] and res["left_out"] == [{"seed": 0, "workloads": ["mlp"]}]
    assert caps == pytest.approx([190.0, 150.0, 110.0, 70.0])  # 100 s + the 90 s margin, less the time so far
    res = suite_run.run_suite(workloads=["tiny_suite", "mlp"], rows=("naive", "fit", "auto", "auto_warm"),
                              seeds=(0,), time_limit_s=20.0, console=Console(file=sys.stderr), clock=clock)
    # past 110 s during tiny_suite's third run: its runs of seed 0 are dropped, and so is the suite's only seed
    assert res["workloads"] == {} and res["left_out"] == [{"seed": 0, "workloads": ["tiny_suite", "mlp"]}]


def test_a_missed_target_is_a_miss_and_scores_infinite(tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(suite_run, "run_row", _fake_run(calls, reach=lambda w, row, seed: row != "fit" or seed == 0))
    monkeypatch.setattr(suite_run, "_warm_up", lambda w, data, first: 0.01)
    res = suite_run.run_suite(workloads=["tiny_suite"], rows=("naive", "fit"), seeds=(0, 1, 2),
                              console=Console(file=sys.stderr))
    entry = res["workloads"]["tiny_suite"]["rows"]["fit"]
    assert entry["reached"] == 1 and entry["seeds"] == 3 and entry["to_target_s"] is None  # 2 of 3 seeds missed
    assert res["table"]["tiny_suite"] == {"naive": 6.0, "fit": None}
    assert res["score"]["relative"]["tiny_suite"] == {"naive": 1.0, "fit": None}  # infinite
    assert res["score"]["targets_reached"] == {"naive": 1, "fit": 0}
    assert res["score"]["profile_score"]["fit"] == 0.0 and res["score"]["geomean_vs_naive"]["fit"] is None
    assert suite_run.reduce_seeds({"w": {"r": [{"to_target_s": 1.0}, {"to_target_s": None}, {"to_target_s": 3.0}]}}) \
        == {"w": {"r": 3.0}}  # one miss in three: the median is the slower hit


def test_every_row_runs_through_fit_and_records_its_budget_seconds_and_steps(tiny, tmp_path):
    out = tmp_path / "suite.json"
    assert main(["bench", "--workloads", "tiny_suite", "--seeds", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "suite" and res["seeds"] == [0]
    assert {"commit", "torch", "python", "cpu"} <= set(res["provenance"])
    rows = res["workloads"]["tiny_suite"]["rows"]
    assert set(rows) | set(res["rows_left_out"]) == set(suite_run.ROWS)
    for name, entry in rows.items():
        (run,) = entry["runs"]
        assert RUN_FIELDS <= set(run), name
        assert run["reached"] and run["stopped"] == "target" and run["steps_to_target"] == 4  # first epoch's end
        expected = TINY.epochs * (1 if name in suite_run.SCHEDULED else suite_run.BUDGET_FACTOR)
        assert (run["budget_epochs"], run["budget_steps"]) == (expected, 4 * expected), name
        assert run["steps_trained"] >= run["steps_to_target"] and run["seconds"] >= run["to_target_s"] > 0
        if name != "naive":
            assert run["decisions"], name  # what fit decided
    assert rows["fit"]["runs"][0]["call"] == {"optimizer": "SGD", "progress": False}
    assert rows["auto"]["runs"][0]["call"] == {"optimizer": "sgd", "recipe": "auto", "progress": False}
    assert (tmp_path / "suite.png").exists() or "matplotlib" not in sys.modules


def test_a_run_stops_at_its_time_cap_as_a_miss(tiny):
    data = line_data(0)
    for row in ("naive", "fit"):
        run = suite_run.run_row(dataclasses.replace(tiny, target=1.01), row, 0, data, cap_s=0.0)
        assert run["stopped"] == "time cap" and run["to_target_s"] is None and not run["reached"], row
        assert run["steps_trained"] < run["budget_steps"], row


def test_the_fit_rows_call_fit_as_their_users_would(tiny):
    model = nn.Linear(4, 2)
    assert isinstance(suite_run.fit_kwargs(tiny, "fit", model)["optimizer"], torch.optim.SGD)
    assert suite_run.fit_kwargs(tiny, "all", model)["schedule"] == "onecycle"
    assert suite_run.fit_kwargs(tiny, "onecycle", model)["optimizer"] == "sgd"  # an SGD loop's user names SGD
    oc = suite_run.fit_kwargs(dataclasses.replace(tiny, optimizer="adam"), "onecycle", model)
    assert (oc["optimizer"], oc["lr"], oc["schedule"]) == ("adamw", 0.5, "onecycle")
    auto = suite_run.fit_kwargs(tiny, "auto", model)
    assert auto["recipe"] == "auto" and "lr" not in auto
    assert isinstance(suite_run.fit_kwargs(dataclasses.replace(tiny, loss="mse"), "fit", model)["loss_fn"], nn.MSELoss)
    with pytest.raises(ValueError, match="no fit row"):
        suite_run.fit_kwargs(tiny, "naive", model)


RESULT = {  # a hand-made suite result: w1 every row reached, w2 `b` missed on both seeds and `a` on one
    "rows": ["naive", "a", "b"], "rows_left_out": [], "seeds": [0, 1], "left_out": [{"seed": 1, "workloads": ["w2"]}],
    "table": {"w1": {"naive": 4.0, "a": 1.0, "b": 2.0}, "w2": {"naive": 3.0, "a": 1.5, "b": None}},
    "workloads": {
        "w1": {"metric": "val_acc", "target": 0.9, "rows": {r: {"reached": 2, "seeds": 2, "runs": []}
                                                          for r in ("naive", "a", "b")}},
        "w2": {"metric": "val_loss", "target": 2.1, "rows": {"naive": {"reached": 2, "seeds": 2, "runs": []},
                                                             "a": {"reached": 1, "seeds": 2, "runs": []},
                                                             "b": {"reached": 0, "seeds": 2,
                                                                   "runs": [{"stopped": "time cap"}]}}}}}


def test_the_table_prints_each_rows_time_relative_time_and_the_scores(capsys):
    res = dict(RESULT, score=suite_run.score(RESULT["table"]))
    assert res["score"]["geomean_vs_naive"]["a"] == pytest.approx(math.sqrt(4.0 * 2.0))
    suite_report.print_suite(Console(file=sys.stdout, width=200), res)
    out = capsys.readouterr().out
    assert "1.00 s 1.00x" in out and "4.00 s 4.00x" in out and "2.00 s 2.00x" in out
    assert "1.50 s 1.00x (1/2)" in out and "missed (0/2)" in out  # w2: a on one seed, b on none
    assert "acc >= 0.9" in out and "loss <= 2.1" in out
    assert "2.83x" in out and "2/2" in out and "1/2" in out  # a's geomean speed; targets reached
    assert "stopped at the time cap (a miss): w2/b" in out and "left out for time: seed 1 of w2" in out


def test_the_png_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch):
    res = dict(RESULT, score=suite_run.score(RESULT["table"]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    note = suite_report.write_suite(res, tmp_path / "s.json", tmp_path / "s.png")
    assert "matplotlib" in note and not (tmp_path / "s.png").exists()
    assert json.loads((tmp_path / "s.json").read_text())["table"]["w2"]["b"] is None


@pytest.mark.parametrize("argv, message", [
    (["--rows", "naive,fast"], "choose from"),
    (["--workloads", "nope"], "no workload 'nope'"),
    (["--full", "--workloads", "mlp"], "--workloads belong to the suite"),
    (["--model", "mlp", "--rows", "naive"], "leave out --full and --model"),
    (["--seeds", "0"], "--seeds must be positive"),
    (["--time-limit", "-1"], "--time-limit must be positive"),
])
def test_bench_cli_refuses_bad_suite_options(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_run_at_its_target_in_under_half_a_second_is_repeated_and_its_median_kept(tiny, monkeypatch):
    """Tens of milliseconds of noise on a 50 ms run is a large share: such a run is run 3 times (cold rows from an
    empty cache each time, auto_warm from its auto's), the median kept and every repeat's seconds recorded; a run
    of half a second or more, or a miss, runs once."""
    calls, times = [], iter([0.09, 0.05, 0.07] * 20)

    def run_row(w, row, seed, data, *, cap_s=None, cache_dir=None):
        calls.append((row, cache_dir))
        short = row != "fit"
        t = next(times) if short else 2.0
        return {"seed": seed, "budget_epochs": 1, "budget_steps": 4, "to_target_s": t, "reached": True,
                "seconds": t, "steps_to_target": 4, "steps_trained": 4, "stopped": "target", "metric": 0.5,
                "choosing_s": 0.0, "in_run_choosing_s": 0.0, "steps_measured": 0, "decisions": {}}

    monkeypatch.setattr(suite_run, "run_row", run_row)
    monkeypatch.setattr(suite_run, "_warm_up", lambda w, data, first: 0.01)
    res = suite_run.run_suite(workloads=["tiny_suite"], rows=("naive", "fit", "auto", "auto_warm"), seeds=(0,),
                              console=Console(file=sys.stderr))
    assert [r for r, _ in calls] == ["naive"] * 3 + ["fit"] + ["auto"] * 3 + ["auto_warm"] * 3
    auto, warm = [d for r, d in calls if r == "auto"], [d for r, d in calls if r == "auto_warm"]
    assert auto[0] is not None and auto[1:] == [None, None]  # the first cold auto fills the cache its warm row reads
    assert warm == [auto[0]] * 3
    rows = res["workloads"]["tiny_suite"]["rows"]
    (naive,) = rows["naive"]["runs"]
    assert naive["to_target_s"] == 0.07 and naive["repeats_s"] == [0.09, 0.05, 0.07]
    assert "repeats_s" not in rows["fit"]["runs"][0] and res["table"]["tiny_suite"]["naive"] == 0.07
