"""How the bench reads a paired speed ratio: median, bootstrap interval, verdict."""

from __future__ import annotations

import pytest

from torchspeed.bench.compare import compare_ratios, describe_comparison


def test_same_kernels_within_noise_match():
    cmp = compare_ratios([0.991, 0.968, 0.676, 1.152, 0.969, 0.95, 1.07, 0.846])  # all/hand, a noisy CPU
    assert cmp["verdict"] == "matches" and cmp["low"] < 1.0 < cmp["high"]
    assert cmp["median"] == pytest.approx(0.9685) and cmp["pairs"] == 8
    assert "matches the best hand-written loop" in describe_comparison(cmp, candidate="all",
                                                                       baseline="the best hand-written loop")


def test_every_pair_faster_or_slower_gives_a_verdict():
    assert compare_ratios([1.12, 1.14, 1.49])["verdict"] == "faster"
    slow = compare_ratios([0.7, 0.8, 0.75, 0.9])
    assert slow["verdict"] == "slower" and slow["high"] < 1.0
    assert "is slower than naive" in describe_comparison(slow, candidate="all", baseline="naive")


def test_interval_is_deterministic_and_brackets_the_median():
    ratios = [1.3, 0.9, 1.1, 1.05, 0.97, 1.2]
    a, b = compare_ratios(ratios), compare_ratios(ratios)
    assert a == b and a["low"] <= a["median"] <= a["high"]
    assert compare_ratios(ratios, level=0.5)["high"] - compare_ratios(ratios, level=0.5)["low"] <= a["high"] - a["low"]


@pytest.mark.parametrize("bad", [[], [1.0, 0.0], [float("nan")], [-1.0]])
def test_bad_ratios_are_refused(bad):
    with pytest.raises(ValueError, match="positive ratios"):
        compare_ratios(bad)
