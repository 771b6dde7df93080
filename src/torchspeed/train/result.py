"""What `fit` and `Trainer.fit` return: the per-epoch history, the config, every decision and why, the step counts.

Example:
    >>> result = fit(model, loader, epochs=3, val_loader=val)
    >>> result.final["val_acc"], result.decisions["precision"].value, result.steps
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchspeed.train.decision import Decisions

__all__ = ["FitResult"]


@dataclass
class FitResult:
    history: list[dict]
    config: dict
    decisions: Decisions
    steps: int
    skipped_steps: int
    evaluations: list[dict] = field(default_factory=list)  # eval_every=N under an epoch: every validation's row, inside
    # the epochs (`mid_epoch` True) and at their ends, in order (empty otherwise: the epoch rows hold them)

    @property
    def final(self) -> dict:
        """The last epoch's row (an empty dict before any)."""
        return self.history[-1] if self.history else {}
