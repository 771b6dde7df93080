"""What choosing may cost: at most a share of the run it serves, and nothing on a cache hit (T15, T17, T42).

Users pay in seconds to a trained model, tuning included (MLCommons AlgoPerf's self-tuning
rule). So a recipe part that must train off the run (the LR range test, the optimizer
trial, the batch timing) runs only when its cost, in training steps, fits in `TUNING_SHARE`
(5%) of the run's steps; otherwise it is decided from the plan cache (measured by an earlier
run of this model on this machine) or from a stated prior, and its `Decision` says which.
Measurements that are training steps of the run itself (the switch trial) are not charged here.

Example:
    >>> budget = TuningBudget(run_steps=4000)
    >>> budget.allows(172), budget.allows(400)
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TUNING_SHARE", "TuningBudget"]

TUNING_SHARE = 0.05


@dataclass
class TuningBudget:
    """Steps off the run that choosing may spend: `share` of `run_steps` (None: a run of unknown length, no budget)."""

    run_steps: int | None
    share: float = TUNING_SHARE
    spent: int = 0

    @property
    def limit(self) -> int:
        return int(self.share * self.run_steps) if self.run_steps else 0

    def allows(self, cost_steps: int) -> bool:
        return self.spent + cost_steps <= self.limit

    def spend(self, steps: int) -> None:
        self.spent += int(steps)

    def refusal(self, cost_steps: int) -> str:
        """Why a part of `cost_steps` was not measured, in words."""
        if not self.run_steps:
            return f"measuring costs ~{cost_steps} steps off the run, and this run's length is unknown"
        return (f"measuring costs ~{cost_steps} steps off the run, over {self.share:.0%} of this "
                f"{self.run_steps}-step run ({self.limit} steps)")
