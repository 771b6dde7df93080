"""train/rounds.py, the one home of timing candidates in interleaved rounds: its schedule, its warm-up and its
statistics, on a fake clock and fixed measurements (no wall time)."""

import pytest

from torchspeed.train.rounds import (Turn, interleaved, medians, paired_ratios, ratio_summary, round_order,
                                           run_for, turns)


def test_the_schedule_warms_each_candidate_then_runs_round_robin_rounds():
    assert turns("ABC", rounds=2, warmup=1) == [
        Turn("A", 0), Turn("B", 0), Turn("C", 0),
        Turn("A", 1), Turn("B", 1), Turn("C", 1),
        Turn("A", 2), Turn("B", 2), Turn("C", 2)]
    # repeat: consecutive timed turns per candidate each round; warm: only the candidates not yet warm
    assert [(t.key, t.round) for t in turns("AB", rounds=2, warmup=2, repeat=2, warm={"B"})] == [
        ("B", 0), ("B", 0), ("A", 1), ("A", 1), ("B", 1), ("B", 1), ("A", 2), ("A", 2), ("B", 2), ("B", 2)]


def test_start_orders():
    assert [round_order("ABC", r, "fixed") for r in (1, 2, 3)] == [list("ABC")] * 3
    assert [round_order("ABC", r, "alternate") for r in (1, 2, 3)] == [list("ABC"), list("CBA"), list("ABC")]
    assert [round_order("ABC", r, "rotate") for r in (1, 2, 3, 4)] == [list("ABC"), list("BCA"), list("CAB"),
                                                                       list("ABC")]
    with pytest.raises(ValueError, match="order must be one of"):
        round_order("AB", 1, "random")
    with pytest.raises(ValueError, match="repeat >= 1"):
        turns("AB", rounds=1, repeat=0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interleaved_times_after_an_untimed_warm_up_and_takes_medians():
    # Each candidate's calls cost fixed seconds on a fake clock; the first call of each is slow (the warm-up),
    # and it must not be among the timings.
    clock, log = Clock(), []
    costs = {"A": iter([9.0, 1.0, 3.0, 2.0]), "B": iter([9.0, 4.0, 4.0, 5.0])}

    def measure(key):
        def once():
            log.append(key)
            return run_for(lambda: setattr(clock, "now", clock.now + next(costs[key])), clock=clock)[1]
        return once

    seen = []
    r = interleaved({k: measure(k) for k in "AB"}, rounds=3, warmup=1, before=lambda k, rnd: seen.append((k, rnd)))
    assert log == ["A", "B", "A", "B", "A", "B", "A", "B"]  # warm-up first, then round by round
    assert seen == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2), ("A", 3), ("B", 3)]
    assert r.times == {"A": [1.0, 3.0, 2.0], "B": [4.0, 4.0, 5.0]}
    assert r.medians() == {"A": 2.0, "B": 4.0}
    assert r.ratios("B")["A"] == [4.0, 4 / 3, 2.5]  # B's seconds over A's, per round: A's speed-up


def test_a_warm_callable_replaces_the_candidates_own_call_in_the_warm_up():
    calls = []
    r = interleaved({"A": lambda: calls.append("A") or 1.0}, rounds=2, warmup=1, warm=lambda k: calls.append(("warm", k)))
    assert calls == [("warm", "A"), "A", "A"] and r.times == {"A": [1.0, 1.0]}


def test_run_for_runs_at_least_min_calls_and_min_time_and_syncs_before_reading_the_clock():
    clock, events = Clock(), []

    def step():
        clock.now += 0.01
        events.append("step")

    n, seconds = run_for(step, min_calls=3, min_time=0.05, clock=clock, sync=lambda: events.append("sync"))
    assert n == 5 and seconds == pytest.approx(0.05) and events == ["step"] * 5 + ["sync"]
    n, seconds = run_for(step, min_calls=3, min_time=0.0, clock=clock)
    assert n == 3 and seconds == pytest.approx(0.03)


def test_medians_leave_out_candidates_never_measured_and_ratios_pair_rounds():
    assert medians({"A": [3.0, 1.0, 2.0], "B": []}) == {"A": 2.0}
    assert paired_ratios([2.0, 3.0], [1.0, 2.0, 9.0]) == [2.0, 1.5]


def test_the_ratio_summary_reads_the_median_the_quartiles_and_whether_they_straddle_one():
    assert ratio_summary([1.2, 0.8, 1.5, 1.1, 1.3]) == {
        "speedup": 1.2, "ratios": [1.2, 0.8, 1.5, 1.1, 1.3], "iqr": [1.1, 1.3], "within_noise": False}
    assert ratio_summary([0.9, 1.1, 1.0]) == {"speedup": 1.0, "ratios": [0.9, 1.1, 1.0], "iqr": [0.95, 1.05],
                                              "within_noise": True}
    one = ratio_summary([1.234567])
    assert one["iqr"] == [1.2346, 1.2346] and one["speedup"] == 1.2346 and not one["within_noise"]
    # the test is on the unrounded quartiles: a first quartile of 1.00003 rounds to 1.0 but is above 1.0
    near = ratio_summary([1.00003, 1.00003, 1.2])
    assert near["iqr"][0] == 1.0 and near["within_noise"] is False
