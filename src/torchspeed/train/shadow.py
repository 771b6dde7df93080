"""Switch-trial turns timed apart from the run's numerics, and paced over the run (T21; the trial: autoswitch.py).

A candidate in another precision than the plain settings' (bf16, fp16) is timed apart (`ShadowTurns.step`): its
forward and backward on the batch are timed, then the RNG, the module's buffers and the gradients are put back, and
the batch trains in the plain precision. So a run whose trial keeps fp32 is the plain fp32 run to the last bit.

Such a turn is pure measuring: its forward and backward are thrown away. So it is **paced**: it waits, and the run
trains a step in the plain settings instead, while the turns timed apart so far would cost more than `SHADOW_SHARE`
(5%, the tuning share of `plan/budget.py`) of the run's seconds since the trial began. A run stopped at any moment
(a callback at its target accuracy, an interrupt) has paid at most about that share for them, as a run that goes to
its end has. A run of known length never waits so long that the trial could not finish in it.

Example:
    >>> trainer.switcher.shadow.waited   # plain steps trained between the timed-apart turns
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from torchspeed.env import sync

__all__ = ["SHADOW_SHARE", "ShadowTurns"]

SHADOW_SHARE = 0.05  # the turns timed apart cost at most about this share of the run's seconds so far


class ShadowTurns:
    """The timed-apart turns of one switch trial (`SwitchStage.shadow`): run one (`step`), say whether the next one
    waits (`waits`), and what they cost (`spent` seconds, `waited` plain steps between them)."""

    def __init__(self, stage):
        self.stage = stage  # the SwitchStage: its trainer (`.t`), its trial (`.live`), `apply`
        self.started: float | None = None  # the trial's first step
        self.spent = 0.0  # seconds of forward and backward thrown away, with the put-back work
        self.turn_s: float | None = None  # the cheapest turn's cost so far (the first holds one-off work): the next's
        self.step_s: float | None = None  # a plain step's seconds: the estimate before any turn ran
        self.waited = 0

    def start(self) -> None:
        self.started = time.perf_counter()

    def waits(self, steps_left: int | None, turns_left: int) -> bool:
        """Whether the next timed-apart turn waits a step: the turns so far and the next (at the last one's cost)
        would be over SHADOW_SHARE of the seconds since the trial began (the next one costs what the cheapest so far
        did; before the first, what a plain step does). Never where the run's remaining steps
        (`steps_left`, None: unknown) are no more than the trial's remaining turns."""
        if not math.isfinite(SHADOW_SHARE) or self.started is None or (
                steps_left is not None and steps_left <= turns_left):
            return False
        cost = self.turn_s if self.turn_s is not None else (self.step_s or 0.0)
        if self.spent + cost <= SHADOW_SHARE * (time.perf_counter() - self.started):
            return False
        self.waited += 1
        return True

    def step(self, batch, run_step, cand) -> float:
        """`cand`'s step time, with the batch trained in the plain settings' precision: the candidate's forward and
        backward on `batch` timed, then the RNG, the module's buffers (BatchNorm's running statistics, spectral
        norm's vectors) and the gradients put back as they were, and the batch trained in the plain precision (the
        candidate's layout and kernel). Returns the trained step's seconds with its forward and backward swapped for
        the candidate's (the optimizer step, the guard and the meter as every candidate pays them); the trained
        forward and backward (the price of keeping the numerics) is added to the trial's cost."""
        t, live = self.stage.t, self.stage.live
        t_in = time.perf_counter()
        stats = [(b, b.clone()) for b in t.module.buffers()]
        try:
            with torch.random.fork_rng(devices=[t.device] if t.device.type == "cuda" else [],
                                       device_type=t.device.type):
                t0 = time.perf_counter()
                t._forward_backward(batch)
                sync(t.device)
                timed = time.perf_counter() - t0
        finally:  # a candidate that fails part-way leaves the statistics as they were too
            for b, saved in stats:
                b.copy_(saved)
        t.optimizer.zero_grad(set_to_none=True)
        self.stage.apply(replace(cand, precision=live.grid[0].precision))
        cost = time.perf_counter() - t_in
        self.spent += cost
        self.turn_s = cost if self.turn_s is None else min(self.turn_s, cost)
        trained_fb, forward_backward = [0.0], t._forward_backward

        def clocked(b):  # the trained step's own forward and backward, to swap for the candidate's
            t2 = time.perf_counter()
            out = forward_backward(b)
            sync(t.device)
            trained_fb[0] += time.perf_counter() - t2
            return out

        t._forward_backward = clocked  # this step only (an instance attribute over the method)
        t1 = time.perf_counter()
        try:
            run_step(batch)
            sync(t.device)
        finally:
            del t._forward_backward
        whole = time.perf_counter() - t1
        live.add_extra(trained_fb[0])
        live.report["shadow_steps"] = live.report.get("shadow_steps", 0) + 1
        return whole - trained_fb[0] + timed  # the step as the candidate's: its forward and backward, the rest as run
