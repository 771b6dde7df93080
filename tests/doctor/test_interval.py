"""Every measured gain is an interval: the bootstrap interval of the ratio of the medians decides the severity
(its lower bound against the thresholds), an interval that holds 1.0 is inconclusive and listed apart, and the
verdict and the exit code a CI job reads follow from the intervals.

Every round timing here is synthetic (fed to the functions, or returned by fake sides): nothing reads a clock.
"""

import itertools
import math
import json
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from torch import nn

from torchspeed.cli.main import main
from torchspeed.doctor import DoctorJob, exit_code, render_report, report_from_observation, report_verdict
from torchspeed.doctor import _envfix
from torchspeed.doctor._capture import Captured
from torchspeed.doctor._interval import bootstrap_interval, gain_interval, measure_rounds, whole_step, wide
from torchspeed.doctor.registry import settle, severity_for_interval
from torchspeed.doctor.report import REGRESSION_EXIT, Finding, interval_verdict
from torchspeed.doctor._candidate import _Trainer, loss_check
from torchspeed.doctor.verify import verify_fixes

from test_rules import _obs, _set

FAULTS = _set("breakdown.minor_faults_per_step", 6000.0)
BASE = [10.0, 10.1, 9.9, 10.0, 10.2]


def _malloc(monkeypatch, base, cand):
    """An observation whose allocator fix was re-run in these rounds (ms per step: the script's, the fix's)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    obs = _obs(FAULTS)
    measure = lambda job, cands: {"malloc": {"ratios": [b / c for b, c in zip(base, cand)], "ms": list(cand),
                                             "baseline_ms": list(base), "error": None}}
    _envfix.measure_env_fixes(DoctorJob(script="train.py"), obs, measure=measure)
    return obs


def test_the_bootstrap_interval_is_deterministic_and_holds_the_ratio_of_the_medians():
    cand = [8.0, 8.1, 7.9, 8.2, 8.0]
    lo, hi = bootstrap_interval(BASE, cand)
    assert (lo, hi) == bootstrap_interval(BASE, cand)  # seeded: the same rounds give the same interval
    assert lo <= 10.0 / 8.0 <= hi and hi - lo < 0.1
    # more spread, the same medians: a wider interval around the same ratio
    lo2, hi2 = bootstrap_interval([10.0, 12.0, 8.5, 10.0, 11.0], [8.0, 6.5, 9.5, 8.0, 7.0])
    assert lo2 < lo and hi2 > hi
    for bad in (([], cand), (BASE, [0.0] * 5), (BASE, [float("nan")] * 5)):
        with pytest.raises(ValueError):
            bootstrap_interval(*bad)


def test_severity_is_read_from_the_lower_bound_not_the_median():
    assert severity_for_interval(1.30, 1.40) == "high"
    assert severity_for_interval(1.10, 1.60) == "medium"  # a 1.35x median, but only 1.10x is sure
    assert severity_for_interval(1.03, 1.60) == "low"
    assert severity_for_interval(0.90, 1.60) == "inconclusive"
    assert severity_for_interval(0.99, 1.01) == "low"  # settled within the 2% minimum effect: no change, not open
    assert interval_verdict(0.99, 1.01) == "no-change" and interval_verdict(0.8, 0.9) == "slower"
    assert interval_verdict(1.01, 1.3) == "likely-faster" and interval_verdict(1.02, 1.3) == "faster"
    assert interval_verdict(0.7, 0.99) == "likely-slower" and interval_verdict(0.7, 1 / 1.02) == "slower"
    # one reading of 1.35x with a wide interval is low; the rules' old reading (the median) said high
    f = settle(Finding("allocator", "high", "e", "x", None, measured_gain=1.35, basis="measured", interval=(1.03, 1.6)))
    assert f.severity == "low" and f.inconclusive is None
    with pytest.raises(ValueError):
        interval_verdict(1.2, 1.1)


def test_the_same_median_ranks_by_its_interval(monkeypatch):
    tight = _malloc(monkeypatch, BASE, [b / 1.3 for b in BASE])  # every round 1.3x
    f = report_from_observation(tight).finding("allocator")
    assert f.basis == "measured" and f.severity == "high" and f.interval[0] >= 1.25
    # the same 1.3x median, rounds that disagree (1.0x to 1.7x): the lower bound decides, not the median
    loose = _malloc(monkeypatch, BASE, [BASE[0] / 1.3, BASE[1] / 1.0, BASE[2] / 1.7, BASE[3] / 1.05, BASE[4] / 1.5])
    g = report_from_observation(loose).finding("allocator")
    assert g.measured_gain == 1.3 and g.severity in ("low", "medium") and g.interval[0] < 1.25


def test_an_interval_that_holds_one_is_inconclusive_and_listed_apart(monkeypatch):
    obs = _malloc(monkeypatch, BASE, [10.5, 9.0, 10.9, 9.4, 10.0])  # rounds either side of 1.0
    r = report_from_observation({**obs, "script": "train.py"})
    f = r.finding("allocator")
    assert f.severity == "low" and f.inconclusive and "would settle it" in f.inconclusive
    assert r.findings[-1].rule == "allocator"  # after every settled finding
    v = report_verdict(r)
    assert v["verdict"] == "inconclusive" and v["inconclusive"] == ["allocator"]
    console = Console(record=True, width=300)
    render_report(r, console)
    text = console.export_text()
    assert "inconclusive (measured, but the interval holds 1.0" in text and "verdict: inconclusive" in text
    assert json.loads(json.dumps(r.to_dict()))["verdict"]["fixes"][0]["verdict"] == "inconclusive"


def test_the_verdict_and_the_exit_code_follow_the_intervals(monkeypatch):
    medium = report_from_observation(_malloc(monkeypatch, BASE, [b / 1.12 for b in BASE]))
    assert medium.finding("allocator").severity == "medium"
    v = report_verdict(medium)
    assert v["verdict"] == "regression" and v["regressions"] == ["allocator"]
    row = v["fixes"][0]
    assert row["fix"] == "malloc" and row["rounds"] == 5 and row["verdict"] == "faster" and row["interval"][0] > 1.1
    assert exit_code(medium, fail_on_regression=True) == REGRESSION_EXIT and exit_code(medium) == 0
    clean = report_from_observation(_malloc(monkeypatch, BASE, list(BASE)))
    assert report_verdict(clean)["verdict"] == "pass" and exit_code(clean, fail_on_regression=True) == 0
    crashed = report_from_observation({**_obs(), "status": "raised"})
    assert report_verdict(crashed)["verdict"] == "error" and exit_code(crashed, fail_on_regression=True) == 1


def _sides(base_ms, cand_ms):
    b, c = iter(base_ms), iter(cand_ms)
    return (lambda: next(b)), (lambda: next(c))


def test_rounds_are_randomised_and_more_run_while_the_interval_is_too_wide_to_rank():
    still = lambda: 0.0  # a clock that never moves: the budget never runs out
    # a tight 1.5x: the 5 rounds after the warm-up settle it
    base, cand = _sides([99.0] + [10.0] * 20, [99.0] + [10.0 / 1.5] * 20)
    v = measure_rounds(base, cand, rounds=5, max_rounds=9, clock=still)
    assert v["rounds"] == 5 and 99.0 not in v["samples_ms"][0] and v["verdict"] == "faster"
    # rounds either side of the medium threshold: more rounds, up to max_rounds
    base, cand = _sides(itertools.repeat(10.0), itertools.cycle([10.0 / 1.2, 10.0 / 0.95, 10.0 / 1.1]))
    v = measure_rounds(base, cand, rounds=5, max_rounds=9, clock=still)
    assert v["rounds"] == 9 and wide(*v["interval"])
    order = []
    measure_rounds(lambda: order.append("b") or 1.0, lambda: order.append("c") or 1.0, rounds=8, clock=still)
    firsts = order[::2]  # who ran first in each round (the warm-up round included)
    assert set(firsts) == {"b", "c"}
    with pytest.raises(ValueError):
        measure_rounds(base, cand, rounds=0)


def test_gain_interval_records_the_rounds_and_what_would_settle_an_open_one():
    g = gain_interval(BASE, [10.5, 9.0, 10.9, 9.4, 10.0])
    assert g["rounds"] == 5 and g["verdict"] == "inconclusive" and "interleaved rounds a side (now 5)" in g["settle"]
    assert "settle" not in gain_interval(BASE, [b / 1.3 for b in BASE])


def test_the_loss_check_runs_both_sides_first_steps_with_the_same_random_draws():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))
    cap = Captured(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), args=(torch.randn(16, 8),))
    base, cand = _Trainer(cap), _Trainer(cap, set_to_none=False)
    for _ in range(4):
        base.step()
        cand.step()
    lc = loss_check(base, cand)
    assert lc["steps"] == 3 and lc["baseline"] == lc["candidate"] and lc["ok"]  # dropout drew the same masks
    off = loss_check(SimpleNamespace(losses=[2.0, 1.5]), SimpleNamespace(losses=[2.0, 1.8]))
    assert not off["ok"] and off["max_rel_diff"] == 0.2


def test_the_cli_refuses_a_single_round(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert main(["doctor", str(script), "--rounds", "1"]) == 2


def test_a_model_step_gain_is_reported_as_the_whole_steps_by_the_compute_share():
    timed = {**gain_interval([10.0, 10.2, 9.9, 10.1, 10.0], [8.0, 8.1, 7.9, 8.2, 8.0]),
             "samples_ms": [[10.0, 10.2, 9.9, 10.1, 10.0], [8.0, 8.1, 7.9, 8.2, 8.0]]}
    assert timed["speedup"] == pytest.approx(1.25, abs=0.01)
    half = whole_step(timed, 0.5)  # the other half of the step (10 ms: data, Python) does not change
    assert half["speedup"] == pytest.approx(20.0 / 18.0, abs=0.01) and half["model_speedup"] == timed["speedup"]
    assert half["model_interval"] == timed["interval"] and half["compute_share"] == 0.5
    assert half["interval"][0] < timed["interval"][0] and half["interval"][1] < timed["interval"][1]
    assert whole_step(timed, 1.0) is timed and whole_step(timed, None) is timed  # all compute, or unknown


def test_verify_reports_a_fix_of_the_model_as_a_gain_of_the_scripts_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4))
    cap = Captured(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), args=(torch.randn(4, 3, 8, 8),),
                   set_to_none=False)
    obs = {"model": {"autocast": True, "has_conv2d": False}, "notes": [],
           "breakdown": {"step_ms": 10.0, "fractions": {"compute": 0.25}}}
    v = verify_fixes(cap, obs, fixes=("set_to_none",), rounds=2)["set_to_none"]
    assert v["compute_share"] == 0.25 and "model_speedup" in v and len(v["model_ratios"]) == v["rounds"]
    base, cand = v["samples_ms"]
    again = whole_step({**v, **gain_interval(base, cand)}, 0.25)  # the whole step's, from the rounds
    assert v["speedup"] == pytest.approx(again["speedup"], abs=2e-3)
    assert v["interval"] == pytest.approx(again["interval"], abs=2e-3)
    assert abs(math.log(v["speedup"])) <= abs(math.log(v["model_speedup"])) + 1e-3  # a quarter of the step: nearer 1
