"""How the doctor reads per-round ratios before it claims a speed-up: `torchspeed.train.rounds.ratio_summary`,
checked for rounds that disagree.

Two interleaved rounds of which one ran while the machine was busy elsewhere read [66.58, 0.96]: their
median is their mean, 33.77x, and their middle half (17.4-50.2x) does not hold 1.0, so `ratio_summary`
alone calls that a measured speed-up. `round_summary` adds two checks:

- `inconclusive`: the rounds disagree by more than `registry.WILD_SPREAD` times (`registry.is_inconclusive`,
  the severity policy's, which `--fix`'s runs are read with too). With fewer than `MIN_ROUNDS`
  rounds one bad round is half the evidence, so the spread is the largest ratio over the smallest; with
  more, the median outvotes one bad round either way, so the highest and the lowest ratio are set aside
  and the spread is that of the rest (3 rounds: never inconclusive; 5: the middle three). An
  inconclusive measurement is never a claim: the rules treat the fix as not measured
  (`rules._common.verified`, `env_measured`), the report says the rounds disagree, and more rounds
  (`--rounds`) settle it;
- `within_noise`, with fewer than `MIN_ROUNDS` rounds: also when one round is faster and the other
  slower (the inclusive quartiles of two ratios lie strictly between them, so they can miss 1.0).
"""

from __future__ import annotations

from collections.abc import Sequence

from torchspeed.doctor.registry import MIN_ROUNDS, is_inconclusive
from torchspeed.train.rounds import ratio_summary

__all__ = ["round_summary"]


def round_summary(ratios: Sequence[float]) -> dict:
    """`ratio_summary(ratios)` with `inconclusive` added and, with fewer than `MIN_ROUNDS` rounds, `within_noise`
    also where the rounds disagree on the direction. Needs one ratio."""
    out = ratio_summary(ratios)
    if len(ratios) < MIN_ROUNDS and min(ratios) <= 1.0 <= max(ratios):
        out["within_noise"] = True
    out["inconclusive"] = is_inconclusive(ratios)
    return out
