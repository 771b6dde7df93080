"""A close cached switch choice, measured again by the next runs and pooled (T43; the switches: T21, T23).

The switch trial (`switches.LiveTrial`) times each candidate on a few of the run's steps (3 rounds of 2 at most), and
`TrialCache` keeps its choice so the next run on the same model, input and machine measures nothing. Where two
settings run within a few percent of each other, six noisy steps pick between them by chance, and a cached choice
made that way was read as settled by every later run: on 400-step runs of ten conv nets (2-core Zen 4,
switches_400_10_260c855.json), the run after a cold one read a cached choice 0.74-0.89x as fast as the best
setting on four of them, where the cold runs had chosen right on 8 of 10.

So a cached choice with a rival close to it is not final: the next run (`measure_again`) times the plain settings,
the cached choice and its close rivals again (the others, far behind in the cached trial, take no turns), and
chooses on this run's timed steps and the cached ones together (`pooled`). Runs differ in pace (a busy machine runs
every setting slower), so each run's steps are pooled relative to its own plain settings' median step: a ratio,
which a run's pace cancels out of. After `POOL_RUNS` runs the entry is final, close or not.

A rival is close when its pooled median is within `CLOSE` of the cached choice's, or faster (a faster setting
not sure enough to switch to: `switch_choice.choose`). A rival the numerics guard refused is not one.

Example:
    >>> close_rivals({"pool": {"runs": 1, "chosen": "fp32", "times": {"fp32": [1.0], "bf16": [1.05]}}}, 400)
    ['bf16']
"""

from __future__ import annotations

import statistics

__all__ = ["POOL_RUNS", "CLOSE", "close_rivals", "measure_again", "pooled"]

POOL_RUNS = 3  # runs whose trials one cache entry pools at most: then it is final
CLOSE = 0.10   # a rival within this of the cached choice's pooled median (or faster) is measured again


def close_rivals(entry: dict, run_steps: int | None) -> list[str]:
    """The labels of a cached trial's candidates close to its choice (see the module docstring); [] where the
    entry is final (POOL_RUNS runs pooled), has no pool (an entry cached before pooling), or this run is shorter
    than the last one pooled (it may not afford the turns that one did: its choice stands)."""
    pool = entry.get("pool") or {}
    times, chosen = pool.get("times") or {}, pool.get("chosen")
    if int(pool.get("runs", POOL_RUNS)) >= POOL_RUNS or not times.get(chosen):
        return []
    if run_steps is not None and run_steps < (pool.get("run_steps") or 0):
        return []
    refused = set(entry.get("rejected") or {}) | set(entry.get("failed") or {})
    med = {k: statistics.median(v) for k, v in times.items() if v and k not in refused}
    return sorted(k for k, m in med.items() if k != chosen and m < med[chosen] * (1 + CLOSE))


def measure_again(entry: dict, trial, depth: int) -> str | None:
    """Why the run measures again rather than read the cached `entry` (None: it reads it): the cached trial timed
    fewer steps (`depth` each) than `trial` affords, or left settings untried that this longer run may afford; or
    its choice has close rivals, which `trial` then times with its choice and the plain settings, pooled
    (`LiveTrial.pool_with`)."""
    if depth < trial.rounds * trial.steps or (entry.get("untried") and (
            trial.run_steps is None or trial.run_steps > entry.get("run_steps", 0))):
        return "the cached switch trial measured less than this run affords: measured again"
    rivals = close_rivals(entry, trial.run_steps)
    if not rivals:
        return None
    pool = entry["pool"]
    trial.pool_with(pool, rivals)
    return (f"the cached switch choice {pool['chosen']} was within {CLOSE:.0%} of {', '.join(rivals)} over "
            f"{pool['runs']} run(s): measured again, pooled with it")


def pooled(times: dict, plain, prior: dict | None) -> tuple[dict, dict | None]:
    """(the timed steps to choose on, the pool to cache) for a trial stage's `times` (candidate -> seconds): each
    step over the plain settings' median in this run, with `prior`'s (a cached pool: label -> ratios) added where
    it is given. Without `prior` the choice reads the seconds themselves (the same choice: every rule of `choose`
    is a ratio); without a timed plain step nothing is pooled."""
    base = times.get(plain)
    if not base:
        return times, None
    m = statistics.median(base)
    rel = {s: [t / m for t in v] for s, v in times.items()}
    old = (prior or {}).get("times") or {}
    rel = {s: v + [float(x) for x in old.get(s.label(), ())] for s, v in rel.items()}
    runs = 1 + (int(prior.get("runs", 1)) if prior else 0)
    return (rel if prior else times), {"runs": runs, "times": {s.label(): [round(x, 4) for x in v]
                                                               for s, v in rel.items() if v}}
