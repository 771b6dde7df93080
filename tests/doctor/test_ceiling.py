"""The ceiling before the trial: a fix whose gain a measured share of the step bounds under the 2% minimum
effect is not run (`rules._ceiling`), the findings state the bound, and the report says why a fix was not run.
Every figure is injected; nothing is timed."""

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchspeed.doctor import DoctorJob, _envfix, report_from_observation
from torchspeed.doctor._capture import Captured
from torchspeed.doctor.undeclared import undeclared_keys
from torchspeed.doctor.report import report_verdict
from torchspeed.doctor.rules._ceiling import US_PER_FAULT_MAX, below_minimum, ceiling
from torchspeed.doctor.verify import verify_fixes

from test_rules import CLEAN, _oversubscribed, _set


def _obs(*mods):
    o = copy.deepcopy(CLEAN)
    for m in mods:
        m(o)
    return o


def _waits(ms):
    def mod(o):
        o["breakdown"]["data_wait_ms"] = ms
        o["cpu"].update(workers=0, threads=1, cores=2)
    return mod


def test_the_bound_is_the_share_of_the_step_the_fix_can_remove():
    c = ceiling(_obs(_waits(6.0)), "workers")  # 6 of 10 ms waiting: hiding all of it is 2.5x at most
    assert c == {"bound": 2.5, "share": 0.6, "of": "the data wait"} and not below_minimum(c)
    c = ceiling(_obs(_waits(0.1)), "workers")
    assert c["bound"] == round(10 / 9.9, 4) and below_minimum(c)
    # workers and threads beyond the cores: fewer workers may be the fix, and no wait bounds what that frees
    assert ceiling(_obs(_oversubscribed), "workers") is None
    faults = _obs(_set("breakdown.minor_faults_per_step", 1500.0), _set("breakdown.step_ms", 200.0))
    c = ceiling(faults, "malloc")
    assert c["bound"] == round(200 / (200 - 1500 * US_PER_FAULT_MAX / 1e3), 4) and below_minimum(c)
    assert ceiling(_obs(_set("syncs.ms_per_step", 1.0)), "host_sync")["bound"] == round(10 / 9, 4)
    assert ceiling(_obs(), "autocast") is None  # no measured share bounds a precision change
    assert ceiling(_obs(_waits(10.0)), "workers") is None  # the whole step waits: no bound


def test_an_environment_fix_bounded_under_the_minimum_effect_is_not_re_run(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    obs = _obs(_set("breakdown.minor_faults_per_step", 1500.0), _set("breakdown.step_ms", 200.0),
               _set("env.allocator", "glibc"))
    # page faults that could gain 1.5% at most: the churn is there (a candidate), the ceiling stops its re-run
    assert "malloc" in _envfix.env_candidates(obs, environ={})
    asked = []
    _envfix.measure_env_fixes(DoctorJob(script="train.py"), obs, measure=lambda job, c: asked.append(c) or {})
    assert asked == []  # nothing re-run
    e = obs["env_fixes"]["malloc"]
    assert e["ceiling"] == 1.0152 and "under the 2% minimum effect" in e["skipped"], e
    assert not undeclared_keys(obs)
    r = report_from_observation(obs)
    f = r.finding("allocator")  # listed low, unmeasured, with its bound and why it was not run
    assert f.severity == "low" and f.basis == "estimated" and f.measured_gain is None and f.ceiling == 1.0152
    assert "malloc: not run" in f.evidence and "under the 2% minimum effect" in f.evidence, f.evidence
    row = next(x for x in report_verdict(r)["fixes"] if x["fix"] == "malloc")
    assert row["verdict"] == "not-run" and row["ceiling"] == 1.0152
    assert report_verdict(r)["verdict"] == "pass"


def test_the_allocator_is_listed_on_the_count_and_re_run_on_the_ceiling(monkeypatch):
    """The same 990 faults a step are listed beside a 15 ms step (ceiling 1.15x) and beside a 200 ms one
    (1.0100x), but re-run only beside the first: a ceiling that a script's processes read on both sides of the 2%
    line (glibc settles differently in each) does not make the finding come and go. 400 faults (under `FAULTS`)
    are not listed whatever the step."""
    from torchspeed.doctor.rules.allocator import FAULTS, churn
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)

    def obs(faults, step):
        return _obs(_set("breakdown.minor_faults_per_step", faults), _set("breakdown.step_ms", step),
                    _set("env.allocator", "glibc"))
    for step, re_run in ((15.0, True), (200.0, False)):
        o, asked = obs(990.0, step), []
        assert churn(o)
        _envfix.measure_env_fixes(DoctorJob(script="train.py"), o, measure=lambda job, c: asked.append(c) or {})
        assert bool(asked) == re_run, (step, asked)
        assert report_from_observation(o).finding("allocator").severity == "low"
    assert not churn(obs(FAULTS - 100.0, 15.0))
    assert report_from_observation(obs(FAULTS - 100.0, 15.0)).finding("allocator") is None
    assert not churn(obs(990.0, 15.0) | {"env": {"allocator": "tcmalloc"}})


def test_a_fix_whose_bound_clears_the_minimum_is_re_run_and_its_finding_states_the_bound(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    obs = _obs(_set("breakdown.minor_faults_per_step", 6000.0), _set("breakdown.step_ms", 200.0),
               _set("env.allocator", "glibc"))
    asked = []

    def measure(job, c):
        asked.append(c)
        return {"malloc": {"ratios": [1.05] * 5, "ms": [190.0] * 5, "baseline_ms": [200.0] * 5, "error": None}}
    _envfix.measure_env_fixes(DoctorJob(script="train.py"), obs, measure=measure)
    assert [set(a) for a in asked] == [{"malloc"}]
    f = report_from_observation(obs).finding("allocator")
    assert f.basis == "measured" and f.ceiling == round(200 / 188, 4) and "at most 1.064x" in f.evidence


def test_verify_does_not_time_workers_that_can_hide_only_a_negligible_wait():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 2)), batch_size=8)
    cap = Captured(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), args=(torch.randn(8, 4),),
                   loaders=[loader])
    obs = _obs(_waits(0.1), _set("model.has_conv2d", False))
    res = verify_fixes(cap, obs, fixes=("workers",), rounds=2)
    assert set(res) == {"workers"}
    assert "speedup" not in res["workers"] and res["workers"]["ceiling"] == round(10 / 9.9, 4)
    assert "the data wait is 1.0% of the step" in res["workers"]["skipped"]
    assert not undeclared_keys({"verify": res})
