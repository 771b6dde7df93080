"""Reading a speed ratio on a noisy machine: the median of paired ratios and its interval.

No technique ID: this is how the bench reads its own numbers.

A benchmark here interleaves the configs it compares (round by round, or seed by seed) and
keeps one ratio per pair, e.g. hand's seconds over all's for the same round. On a shared or
virtualised CPU one round can run 30% slower than the next for reasons that have nothing to
do with the code, so a single ratio, or the ratio of two means, says little. `compare_ratios`
reports the median of the paired ratios and a bootstrap interval for that median (resampling
the pairs with a fixed seed, so the same numbers always give the same interval), and a
verdict read from the interval:

- "faster": the whole interval is above 1.0;
- "slower": the whole interval is below 1.0;
- "matches": the interval holds 1.0, i.e. the difference is within this machine's noise.

The interval covers the noise from one pair to the next, not a lasting difference between
two processes (each config runs in a process of its own, and a process can keep a slightly
slower placement on a virtual machine for its whole life): with few pairs, two configs that
run the same kernels can read "slower" or "faster" by a few percent. More rounds, and a
repeat of the run, tell the two apart.

Two configs that run the same kernels (the `all` row and the best hand-written loop, when
the hand search finds the same settings torchspeed picks) read "matches" on a quiet machine.

Example:
    >>> compare_ratios([1.03, 0.98, 1.10, 0.95])["verdict"]
    'matches'
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

__all__ = ["compare_ratios", "describe_comparison"]


def compare_ratios(ratios: Sequence[float], *, level: float = 0.95, resamples: int = 2000, seed: int = 0) -> dict:
    """Median of `ratios` (each > 1 means the candidate was faster in that pair), a `level`
    bootstrap interval for it, and the verdict ("faster", "slower" or "matches")."""
    values = [float(r) for r in ratios]
    if not values or any(not (r > 0) for r in values):
        raise ValueError(f"compare_ratios needs positive ratios, got {list(ratios)!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level}")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[int((1 - tail) * (resamples - 1))]
    verdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "matches"
    return {"median": statistics.median(values), "low": low, "high": high, "level": level,
            "pairs": len(values), "verdict": verdict}


def describe_comparison(cmp: dict, *, candidate: str, baseline: str) -> str:
    """One line for a terminal: 'all matches hand within this machine's noise (95% interval 0.91-1.06)'."""
    span = f"{cmp['level']:.0%} interval {cmp['low']:.2f}-{cmp['high']:.2f} over {cmp['pairs']} pairs"
    if cmp["verdict"] == "matches":
        return f"{candidate} matches {baseline} within this machine's noise ({span})"
    return f"{candidate} is {cmp['verdict']} than {baseline} ({span})"
