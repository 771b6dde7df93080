"""Rounds that disagree wildly prove nothing: `_rounds.round_summary` marks them inconclusive, and no finding,
table or plan claims a speed-up from them (--verify, the environment re-runs, --fix).

Every measurement here is injected; nothing asserts on the clock."""

import copy

from rich.console import Console

from torchspeed.doctor import DoctorJob, RULES, render_report, report_from_observation
from torchspeed.doctor import _envfix
from torchspeed.doctor._rounds import round_summary
from torchspeed.doctor.registry import apply_fix_measurements, is_inconclusive, spread
from torchspeed.train.rounds import ratio_summary

from test_rules import BF16_CPU, TRIGGERS, _obs, _oversubscribed, _set

WILD = [66.58, 0.96]  # --rounds 2: one round's baseline ran while the machine was busy


def test_two_rounds_that_disagree_wildly_are_inconclusive_and_within_noise():
    assert not ratio_summary(WILD)["within_noise"]  # the shared summary alone reads this as a 33.77x speed-up
    s = round_summary(WILD)
    assert s["speedup"] == 33.77 and s["inconclusive"] and s["within_noise"]
    # two rounds on either side of 1.0 are noise, however close their quartiles sit
    assert round_summary([1.4, 0.95])["within_noise"] and not round_summary([1.4, 0.95])["inconclusive"]
    assert not round_summary([1.3, 1.34])["within_noise"] and not round_summary([1.3, 1.34])["inconclusive"]
    assert spread([3.0, 5.0]) == 5.0 / 3.0 and not is_inconclusive([3.0, 5.0])  # agree on a big gain: a claim
    # with 3 rounds or more the median outvotes one bad round either way; a majority that disagrees does not
    assert not is_inconclusive([66.58, 1.2, 1.3]) and not is_inconclusive([0.01, 1.2, 1.3, 1.25, 1.22])
    assert is_inconclusive([0.5, 0.6, 1.5, 1.6, 1.7])


def _wild_verify(fix):
    return _set("verify", {fix: {"fix": fix, **round_summary(WILD), "baseline_ms": 10.0, "candidate_ms": 0.3,
                                 "rounds": 2, "steps_per_round": 20}})


def test_an_inconclusive_verify_is_no_measured_claim():
    o = _obs(*TRIGGERS["channels-last"], _wild_verify("channels_last"))
    f = RULES["channels-last"].check(o)
    assert f.measured_gain is None and f.basis == "estimated" and f.severity == "low"
    assert "--verify measured" not in f.evidence and "33.77" not in f.evidence
    assert "--verify's interleaved rounds disagree (ratios 66.58, 0.96x): inconclusive" in f.evidence
    console = Console(record=True, width=300)
    render_report(report_from_observation({**o, "script": "train.py"}), console)
    text = console.export_text()
    assert "33.77x" not in text and "inconclusive: the 2 interleaved rounds disagree (ratios 66.58, 0.96x)" in text


def test_no_amp_does_not_read_an_inconclusive_verify_as_a_slow_down_or_a_speed_up():
    o = _obs(_set("env", BF16_CPU), *TRIGGERS["no-amp"], _wild_verify("autocast"))
    f = RULES["no-amp"].check(o)
    assert f.measured_gain is None and not f.fix.startswith("keep fp32") and "inconclusive" in f.evidence


def test_inconclusive_re_runs_of_the_script_rank_nothing():
    measure = lambda job, cands: {n: {"ratios": WILD, "ms": [10.0 / r for r in WILD], "baseline_ms": [10.0] * 2,
                                      "error": None} for n in cands}
    o = _obs(_oversubscribed)
    _envfix.measure_env_fixes(DoctorJob(script="train.py"), o, measure=measure)
    assert o["env_fixes"]["omp_passive"]["inconclusive"]
    f = RULES["omp-wait-policy"].check(o)  # listed apart as inconclusive: no gain claimed, the same every run
    assert f.severity == "low" and f.measured_gain is None and "33.77" not in f.evidence
    assert "disagree (ratios 66.58, 0.96x): inconclusive" in f.evidence
    f = RULES["cpu-oversubscribed"].check(o)  # ranked on its own timing of the slow-down, not on the re-runs
    assert f.basis == "timed" and f.measured_gain is None and "33.77" not in f.evidence
    assert "the interleaved re-runs of the script disagree (ratios 66.58, 0.96x): inconclusive" in f.evidence
    console = Console(record=True, width=300)
    render_report(report_from_observation({**o, "script": "train.py"}), console)
    assert "33.77x" not in console.export_text()


def test_fix_runs_that_disagree_wildly_do_not_rank_a_finding():
    o = _obs(*TRIGGERS["zero-grad-memset"])
    before = RULES["zero-grad-memset"].check(o)
    assert before.patch and before.basis == "timed"
    fix = {"patches": [{"rule": "zero-grad-memset", "patch": before.patch, "speedup": 33.77, "ratios": WILD}]}
    after = next(f for f in apply_fix_measurements([before], copy.deepcopy(fix)) if f.rule == "zero-grad-memset")
    assert after.measured_gain is None and after.basis == before.basis and after.severity == before.severity
