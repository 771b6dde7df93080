"""Timing candidates in interleaved rounds after a warm-up: the one home of that schedule and its statistics.

No technique of its own: this is how every measured choice is timed, the switch trial (T18,
T21, T23), the loader tuner (T06-T08), the batch finder (T17), the bench's rows, the
hand-written loop's search, the scaling and sharding benches and the data pipeline bench.

On a shared or virtualised machine one stretch of seconds can run 30% slower than the next
for reasons that have nothing to do with the code. Timing candidate A to the end, then B,
lets such a drift pick the winner. So each candidate is first warmed up, untimed (first-call
set-up of kernels and allocator, compilation, worker start-up), then timed in rounds: round 1
times A, B, C, round 2 A, B, C again, and so on; each candidate's median over the rounds
decides, and the per-round ratios pair the candidates that ran side by side.

- `turns`: the schedule itself, as a list of (candidate, round) with round 0 the warm-up. A
  caller driven one step at a time (the switch trial, on the run's own training steps) walks it.
- `interleaved`: walks the schedule over callables that each return one measurement (seconds,
  or a rate) and returns every candidate's measurements (`Rounds`).
- `run_for`: one measurement, a call repeated until it ran at least `min_calls` times and
  `min_time` seconds, on a clock that can be injected.
- `medians`, `paired_ratios`, `ratio_summary`: how the rounds are read; `share_faster` and `faster_beyond_chance`:
  whether one candidate's timed steps beat another's.

Example:
    >>> r = interleaved({"a": time_a, "b": time_b}, rounds=3, warmup=1)
    >>> r.medians(), r.ratios("a")
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

__all__ = ["ORDERS", "Turn", "Rounds", "round_order", "turns", "interleaved", "run_for", "medians", "paired_ratios",
           "ratio_summary", "share_faster", "faster_beyond_chance"]

K = TypeVar("K", bound=Hashable)

# fixed: the given order every round; alternate: reversed every second round; rotate: round r starts
# at the r-th candidate (each candidate runs first once every len(candidates) rounds).
ORDERS = ("fixed", "alternate", "rotate")


class Turn(NamedTuple):
    key: Hashable
    round: int  # 0: warm-up (untimed); 1..rounds: timed


def round_order(keys: Sequence[K], r: int, order: str = "fixed") -> list[K]:
    """The candidates in the order they run in timed round `r` (1-based)."""
    keys = list(keys)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "fixed" or not keys:
        return keys
    if order == "alternate":
        return keys if r % 2 else keys[::-1]
    k = (r - 1) % len(keys)
    return keys[k:] + keys[:k]


def turns(keys: Sequence[K], *, rounds: int, warmup: int = 0, repeat: int = 1, order: str = "fixed",
          warm: Collection[K] | None = None) -> list[Turn]:
    """The schedule: first each candidate's `warmup` untimed turns, one candidate after the other (round 0);
    then `rounds` rounds in which every candidate takes `repeat` consecutive timed turns, in `order`.
    `warm`: the candidates that get a warm-up (default: all; one already warm can be left out)."""
    if rounds < 0 or warmup < 0 or repeat < 1:
        raise ValueError(f"need rounds >= 0, warmup >= 0 and repeat >= 1, got rounds={rounds}, warmup={warmup}, "
                         f"repeat={repeat}")
    keys = list(keys)
    warm_keys = keys if warm is None else [k for k in keys if k in warm]
    out = [Turn(k, 0) for k in warm_keys for _ in range(warmup)]
    out += [Turn(k, r) for r in range(1, rounds + 1) for k in round_order(keys, r, order) for _ in range(repeat)]
    return out


def medians(times: Mapping[K, Sequence[float]]) -> dict[K, float]:
    """Each candidate's median; candidates with no measurement are left out."""
    return {k: statistics.median(v) for k, v in times.items() if len(v)}


def share_faster(times: Sequence[float], reference: Sequence[float]) -> float:
    """Of every pairing of one of `times` with one of `reference` (seconds), the share in which it is the faster
    (ties count half): 0.5 where the two are the same distribution, 1.0 where every step beat every reference step."""
    pairs = [(a < b) + 0.5 * (a == b) for a in times for b in reference]
    return sum(pairs) / len(pairs) if pairs else 0.5


def faster_beyond_chance(times: Sequence[float], reference: Sequence[float], *, alpha: float = 0.05,
                         min_each: int = 4) -> bool:
    """Whether `times` (seconds) are faster than `reference` beyond chance: the one-sided Mann-Whitney rank test on
    the pairings `share_faster` counts (normal approximation, corrected for ties and continuity) at level `alpha`;
    False with fewer than `min_each` steps a side. `share_faster` tends to the share of pairings a candidate wins,
    however many steps are timed: on noisy steps a real 1.3x can win three pairings in four and no more. This test
    grows surer with more steps, as a close choice timed again over several runs has (`trial.pool`)."""
    n1, n2 = len(times), len(reference)
    if min(n1, n2) < min_each:
        return False
    n = n1 + n2
    ties = sum(c ** 3 - c for c in Counter([*times, *reference]).values())
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return False
    z = (share_faster(times, reference) * n1 * n2 - n1 * n2 / 2 - 0.5) / math.sqrt(var)
    return z > statistics.NormalDist().inv_cdf(1 - alpha)


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """`num[i] / den[i]` for every round both ran. With seconds, (reference, candidate) gives the candidate's
    speed-up per round; with rates, (candidate, reference)."""
    return [a / b for a, b in zip(num, den)]


def ratio_summary(ratios: Sequence[float]) -> dict:
    """Per-round speed-up ratios read as `{"speedup", "ratios", "iqr", "within_noise"}`: the median, the
    ratios, the first and third quartiles (inclusive method; one ratio gives [r, r]), all rounded to 4
    places, and whether the unrounded quartiles straddle 1.0 (no measurable difference). Needs one ratio."""
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) >= 2 else [ratios[0]] * 3
    return {"speedup": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios],
            "iqr": [round(q[0], 4), round(q[2], 4)], "within_noise": bool(q[0] <= 1.0 <= q[2])}


@dataclass
class Rounds(Generic[K]):
    """Every candidate's measurements, one per timed turn, in the order they were taken."""

    times: dict[K, list[float]]

    def medians(self) -> dict[K, float]:
        return medians(self.times)

    def ratios(self, reference: K) -> dict[K, list[float]]:
        """Per round, the reference's measurement over each candidate's: with seconds, the speed-up over it."""
        ref = self.times[reference]
        return {k: paired_ratios(ref, v) for k, v in self.times.items()}


def interleaved(candidates: Mapping[K, Callable[[], float]], *, rounds: int, warmup: int = 0,
                warm: Callable[[K], object] | None = None, order: str = "fixed",
                before: Callable[[K, int], object] | None = None) -> Rounds[K]:
    """Time every candidate in interleaved rounds after a warm-up (see `turns` for the schedule).

    Each callable takes one measurement and returns it (seconds, or a rate: the caller knows which).
    A warm-up turn calls `warm(key)` when given, else the candidate's callable, and drops the result.
    `before(key, round)` runs before every turn (round 0: a warm-up turn): a progress line, a pause.
    """
    times: dict[K, list[float]] = {k: [] for k in candidates}
    for turn in turns(list(candidates), rounds=rounds, warmup=warmup, order=order):
        if before is not None:
            before(turn.key, turn.round)
        if turn.round == 0:
            warm(turn.key) if warm is not None else candidates[turn.key]()
        else:
            times[turn.key].append(float(candidates[turn.key]()))
    return Rounds(times)


def run_for(call: Callable[[], object], *, min_calls: int = 1, min_time: float = 0.0,
            clock: Callable[[], float] = time.perf_counter, sync: Callable[[], object] | None = None
            ) -> tuple[int, float]:
    """One measurement: `call` repeated until it ran at least `min_calls` times and `min_time` seconds of
    `clock`; (calls, seconds). `sync` (the device's) runs once after the last call, before the clock is read."""
    t0 = clock()
    n = 0
    while n < min_calls or clock() - t0 < min_time:
        call()
        n += 1
    if sync is not None:
        sync()
    return n, clock() - t0
