"""The plan: every automatic choice of `torchspeed.fit`, made once, with what choosing costs counted.

`train/` holds the mechanisms (the loop and each technique, the switch trial that runs on the
loop's own steps); this package decides what to measure, within what budget, and in what
order: `planner.make_plan` (the order), `budget.TuningBudget` (at most 5% of the run's steps
off the run), the training recipe's parts, each a stage (`recipe`, `recipe_optimizer`, `recipe_lr`,
`recipe_batch`, `recipe_tta`).
"""

from torchspeed.plan.budget import TUNING_SHARE, TuningBudget
from torchspeed.plan.planner import Plan, make_plan

__all__ = ["Plan", "make_plan", "TuningBudget", "TUNING_SHARE"]
