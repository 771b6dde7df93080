"""Every gain the doctor measures is an interval (T02, T49): randomised interleaved rounds after a discarded
warm-up, and a bootstrap interval on the ratio of the medians.

One reading of a fix (or the median of two) moves with whatever else the machine did in those seconds: the
same script read 1.10x on one run and 1.03x on the next, and its finding flipped between medium and low. So:

- `measure_rounds` times a baseline and a candidate (callables that each return one measurement in ms) in
  rounds: one discarded warm-up round, then `rounds` (5) rounds a side, each round in an order drawn at random
  (a seeded generator: a drift or a periodic job cannot always land on the same side). When the interval is
  still too wide to rank (a severity threshold, or 1.0, lies inside it) and the budget allows, more rounds run,
  up to `max_rounds`. The rounds run through `torchspeed.train.rounds.interleaved`, one call per round.
- `bootstrap_interval`: the 95% percentile bootstrap interval of median(baseline) / median(candidate).
  Rounds of the two sides that ran side by side are resampled together (a slow stretch of the machine slows
  both); unpaired lists are resampled apart. The generator is seeded, so the same rounds give the same interval.
- `gain_interval`: what the rest of the doctor reads (`observation._RoundRatios`): the per-round ratios and
  their summary (`_rounds.round_summary`), the interval, the verdict (`report.interval_verdict`) and, for an
  inconclusive one, what would settle it (`report.settle_text`).

Severity is read from the interval's lower bound by the registry (`registry.settle`); the thresholds and the
minimum effect are `report.HIGH_GAIN`, `MEDIUM_GAIN`, `MIN_EFFECT`. Cost: the rounds themselves; the
bootstrap takes a few milliseconds.

Example:
    >>> gain_interval([10.0, 10.2, 9.9, 10.1, 10.0], [8.0, 8.1, 7.9, 8.2, 8.0])["interval"]
    [1.2317, 1.2593]
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

from torchspeed.doctor._rounds import round_summary
from torchspeed.doctor.report import HIGH_GAIN, MEDIUM_GAIN, interval_verdict, settle_text
from torchspeed.train.rounds import interleaved

__all__ = ["ROUNDS", "MAX_ROUNDS", "LEVEL", "SEED", "bootstrap_interval", "gain_interval", "wide", "measure_rounds",
           "whole_step"]

ROUNDS = 5         # timed rounds a side by default, after one discarded warm-up round
MAX_ROUNDS = 15    # at most this many when the interval is too wide to rank and the budget allows
LEVEL = 0.95
RESAMPLES = 2000
SEED = 20240601


def _ratio_of_medians(base: Sequence[float], cand: Sequence[float]) -> float:
    c = statistics.median(cand)
    return statistics.median(base) / c if c > 0 else math.inf


def bootstrap_interval(base: Sequence[float], cand: Sequence[float], *, level: float = LEVEL,
                       resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float]:
    """The `level` percentile bootstrap interval of median(base) / median(cand) (per-step times: the
    candidate's speed-up). Lists of the same length are rounds that ran side by side and are resampled as
    pairs; otherwise each side is resampled apart. Deterministic for given inputs."""
    if not base or not cand:
        raise ValueError("bootstrap_interval needs at least one measurement on each side")
    if any(not math.isfinite(x) or x <= 0 for x in (*base, *cand)):
        raise ValueError(f"step times must be positive and finite, got {list(base)} and {list(cand)}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie between 0 and 1, got {level}")
    rng = random.Random(seed)
    paired = len(base) == len(cand)
    stats = []
    for _ in range(resamples):
        if paired:
            idx = [rng.randrange(len(base)) for _ in base]
            b, c = [base[i] for i in idx], [cand[i] for i in idx]
        else:
            b, c = rng.choices(base, k=len(base)), rng.choices(cand, k=len(cand))
        stats.append(_ratio_of_medians(b, c))
    stats.sort()
    lo_i = int(math.floor((1 - level) / 2 * (resamples - 1)))
    hi_i = int(math.ceil((1 + level) / 2 * (resamples - 1)))
    return stats[lo_i], stats[hi_i]


def wide(lo: float, hi: float) -> bool:
    """A threshold that decides the ranking (1.0, the medium or the high gain) lies inside the interval."""
    return any(lo < t < hi for t in (1.0, MEDIUM_GAIN, HIGH_GAIN))


def gain_interval(base: Sequence[float], cand: Sequence[float], *, level: float = LEVEL) -> dict:
    """The measurement of one fix from its rounds (ms per step, the script's settings and the fix's), as the
    doctor records it: `_rounds.round_summary` of the per-round ratios, the bootstrap `interval` of the ratio of
    the medians, `rounds`, `verdict` and, when inconclusive, `settle` (what would settle it)."""
    n = min(len(base), len(cand))
    ratios = [b / c for b, c in zip(base, cand)] if n else []
    if not ratios:
        raise ValueError("gain_interval needs one round on each side")
    lo, hi = bootstrap_interval(base, cand, level=level)
    out = {**round_summary(ratios), "interval": [round(lo, 4), round(hi, 4)], "rounds": n}
    out["verdict"] = interval_verdict(lo, hi)
    if out["verdict"] == "inconclusive":
        out["settle"] = settle_text(lo, hi, out["speedup"], n)
    return out


def measure_rounds(base: Callable[[], float], cand: Callable[[], float], *, rounds: int = ROUNDS,
                   max_rounds: int = MAX_ROUNDS, budget_s: float = 20.0, seed: int = SEED,
                   clock: Callable[[], float] = time.perf_counter) -> dict:
    """Time `base` and `cand` (each call returns one measurement, ms per step) in randomised interleaved rounds
    after one discarded warm-up round; more rounds, up to `max_rounds`, while the interval is too wide to rank
    (`wide`) and the rounds so far took less than `budget_s`. Returns `gain_interval` of the rounds plus the
    raw samples (`samples_ms`: the baseline's, the candidate's) and `baseline_ms` / `candidate_ms` (medians)."""
    if rounds < 1 or max_rounds < rounds:
        raise ValueError(f"need rounds >= 1 and max_rounds >= rounds, got rounds={rounds}, max_rounds={max_rounds}")
    rng = random.Random(seed)
    sides = {"base": base, "cand": cand}
    times: dict[str, list[float]] = {"base": [], "cand": []}

    def one_round(warm: bool) -> None:
        keys = list(sides)
        rng.shuffle(keys)
        got = interleaved({k: sides[k] for k in keys}, rounds=1)  # one round, in the drawn order
        if not warm:
            for k in keys:
                times[k].extend(got.times[k])

    one_round(warm=True)
    t0 = clock()
    while len(times["base"]) < rounds:
        one_round(warm=False)
    while len(times["base"]) < max_rounds and clock() - t0 < budget_s:
        lo, hi = bootstrap_interval(times["base"], times["cand"])
        if not wide(lo, hi):
            break
        one_round(warm=False)
    out = gain_interval(times["base"], times["cand"])
    out.update(baseline_ms=round(statistics.median(times["base"]), 4),
               candidate_ms=round(statistics.median(times["cand"]), 4),
               samples_ms=[[round(t, 4) for t in times["base"]], [round(t, 4) for t in times["cand"]]])
    return out


def whole_step(measured: dict, share: float | None) -> dict:
    """A fix timed on the model's step alone (`measure_rounds` on the captured batch), as a gain of the script's
    whole step, of which the model's step is `share` (the probe's compute share): the rest of the step (data wait,
    copies, Python; `median(baseline) x (1 - share) / share` ms) is added to both sides' rounds and the interval
    is drawn again. A 1.17x model step in a step that computes 85% of its time is 1.14x: what the user's loop
    gains. The model-step figures stay as `model_speedup`, `model_interval` and `model_ratios`; `share` None, 0 or 1:
    unchanged."""
    base, cand = (measured.get("samples_ms") or [[], []])
    if share is None or not 0 < share < 1 or not base or len(base) != len(cand):
        return measured
    rest = statistics.median(base) * (1 - share) / share
    out = {**measured, "model_speedup": measured.get("speedup"), "model_interval": measured.get("interval"),
           "model_ratios": measured.get("ratios"), "compute_share": round(share, 4)}
    out.pop("settle", None)
    out.update(gain_interval([b + rest for b in base], [c + rest for c in cand]))
    return out
