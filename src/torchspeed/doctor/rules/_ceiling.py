"""The ceiling before the trial (T02, T06, T13, T44): a fix whose gain is bounded by a measured share of the
step is not run where that bound is under the minimum effect.

What a fix can remove, it removes from the step the probe timed:
- `workers` (more DataLoader workers) hides at most the data wait: step / (step - wait). Where the loader's
  workers and the model's threads already oversubscribe the cores the fix may instead be fewer workers,
  which frees cores for compute; no share bounds that, and the fix always runs;
- `malloc` (glibc's thresholds) removes at most the minor page faults: faults per step at `US_PER_FAULT_MAX`
  each (a fault and the zeroing of its 4 KiB page; the allocator rule's estimate assumes 0.7 us);
- `host_sync` (no fix the doctor runs; the bound is stated) removes at most the time the host reads took.

`ceiling(obs, fix)` gives the bound with what it rests on; `below_minimum(c)`: the fix is not worth a trial
(its bound is under `report.MIN_EFFECT`, 2%), and `skipped_entry` records it in place of a measurement. The
findings state the bound (`rules._common.finding`, `Finding.ceiling`). Cost: arithmetic on the observation.
"""

from __future__ import annotations

from typing import TypedDict

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.report import MIN_EFFECT

__all__ = ["US_PER_FAULT_MAX", "Ceiling", "ceiling", "below_minimum", "skipped_entry"]

US_PER_FAULT_MAX = 2.0  # microseconds: an upper bound on one minor fault plus zeroing its page


class Ceiling(TypedDict):
    bound: float   # the most the fix can gain: step / (step - the share it removes)
    share: float   # that share of the step
    of: str        # what the share is: "the data wait", ...


def _bound(step: float, removed: float, of: str) -> Ceiling | None:
    if step <= 0 or removed >= step:  # the share could be the whole step: it bounds nothing
        return None
    removed = max(removed, 0.0)
    return {"bound": round(step / max(step - removed, 1e-9), 4), "share": round(removed / step, 4), "of": of}


def ceiling(obs: Observation, fix: str | None) -> Ceiling | None:
    """The bound a measured share puts on `fix`'s gain, or None where no share bounds it."""
    b = obs.get("breakdown") or {}
    step = float(b.get("step_ms", 0.0))
    if fix == "workers":
        c = obs.get("cpu") or {}
        workers, threads, cores = int(c.get("workers", 0)), int(c.get("threads", 1)), int(c.get("cores", 1))
        if workers and workers + threads > cores:
            return None  # fewer workers may be the fix: it frees cores, which no wait share bounds
        return _bound(step, float(b.get("data_wait_ms", 0.0)), "the data wait")
    if fix == "malloc":
        faults = float(b.get("minor_faults_per_step", 0.0))
        return _bound(step, faults * US_PER_FAULT_MAX / 1e3, f"{faults:,.0f} minor page faults per step")
    if fix == "host_sync":
        return _bound(step, float((obs.get("syncs") or {}).get("ms_per_step", 0.0)), "the host reads")
    return None


def below_minimum(c: Ceiling | None) -> bool:
    return c is not None and c["bound"] < MIN_EFFECT


def skipped_entry(fix: str, rule: str | None, c: Ceiling) -> dict:
    """What stands in for a fix not run: its bound, and why."""
    return {"fix": fix, "rule": rule, "ceiling": c["bound"],
            "skipped": (f"not run: {c['of']} is {c['share']:.1%} of the step, so the fix gains at most "
                        f"{c['bound']:.3f}x, under the {MIN_EFFECT - 1:.0%} minimum effect")}
