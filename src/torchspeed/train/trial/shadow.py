"""Switch-trial turns timed apart from the run's numerics, and paced over the run (T21; the trial: autoswitch.py).

A candidate in another precision (bf16, fp16) or memory layout (channels_last) than the plain settings', or in the
threads stage another intra-op thread count than the run's (the sums of a matmul split otherwise), is timed
apart (`ShadowTurns.step`): its forward and backward on the batch are timed, then the RNG, the module's buffers and
the gradients are put back, and the batch trains in the plain precision and layout. So a run whose trial keeps the
plain settings is the plain run to the last bit, unless a candidate led them by 10% on the way (below: its later
turns trained). A layout rounds otherwise too (oneDNN's and cuDNN's channels_last
convolutions sum in another order), and on a short run at a high LR that last-bit difference grows into another
trajectory within an epoch: measured on a port of PyTorch's MNIST example (Adadelta at 1.0), a trial that trained its
channels_last turns ended its first epoch at 0.74 and 0.77 accuracy against the script's 0.82 and 0.81.

Such a turn is pure measuring: its forward and backward are thrown away. So, once each candidate in another
precision has had its warm-up and one timed turn (the first look, in the run's first steps: a precision that wins
must be found early), the turns are **paced**: the k-th waits, and the run trains steps in the plain settings
meanwhile, until the run has trained k / `SHADOW_SHARE` steps since the trial began (5%, the tuning share of
`plan/budget.py`: a turn costs about a step's forward and backward). A run stopped at any moment (a callback at its
target accuracy, an interrupt) has paid, beyond the first look, about that share of its steps for them, as a run
that goes to its end has. A run of known length takes no more of them than that share of its steps (`spent`): the
trial decides on what the turns so far measured. The pace is counted in steps, so the schedule does not hang on the
machine's load. A run of known length never waits so long that the trial could not finish in it. Once a
candidate timed apart measures 10% faster than the plain settings (`LiveTrial.ahead_of_plain`: a lead one step's
noise rarely makes; a candidate the numerics guard refuses never leads), the run is likely to switch, and its
numerics with it: from then on every turn trains (`SwitchStage._shadows`), none is thrown away, and none waits
(by hand, on 22-step runs of the suite's digits CNN: 0.39 s with the trial's first look at channels_last timed
apart, against 0.35 s with channels_last asked for; with all 7 of its turns timed apart, about 0.1 s more).

Example:
    >>> trainer.switcher.shadow.waited   # plain steps trained between the timed-apart turns
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from torchspeed.env import sync
from torchspeed.train.trial.dynamo_deferred import torch_zero_grad
from torchspeed.train.transfer import batch_layout, map_tensors, trial_layout
from torchspeed.train.trial.trial_safety import forked_rng, kept_buffers

__all__ = ["SHADOW_SHARE", "ShadowTurns"]

SHADOW_SHARE = 0.05  # after the first look, the turns timed apart take at most this share of the run's steps so far


class ShadowTurns:
    """The timed-apart turns of one switch trial (`SwitchStage.shadow`): run one (`step`), say whether the next one
    waits (`waits`), and how many ran (`turns`) and waited (`waited`: plain steps trained between them)."""

    def __init__(self, stage):
        self.stage = stage  # the SwitchStage: its trainer (`.t`), its trial (`.live`), `apply`
        self.seen = 0  # the run's steps since the trial began, this one included
        self.turns = 0  # turns timed apart so far (the report's `shadow_steps`)
        self.waited = 0  # steps trained in the plain settings while a turn waited
        self.cap = math.inf  # a run's own cap on SHADOW_SHARE (a ported run's: half its trial share)

    @property
    def share(self) -> float:
        return min(SHADOW_SHARE, self.cap)

    def tick(self) -> None:
        """One of the run's steps while the trial is on."""
        self.seen += 1

    def waits(self, *, steps_left: int | None, turns_left: int) -> bool:
        """Whether the next timed-apart turn, after the first look, waits this step (after `tick`). The k-th turn
        (about a step's forward and backward) waits until the run has trained k / SHADOW_SHARE steps since the
        trial began: counted in steps, not seconds, so the schedule, and the run's numerics with it, do not hang on
        the machine's load. Never where the run's remaining steps (`steps_left`, None: unknown) are no more than
        the trial's remaining turns."""
        if not self._waiting(self.seen, steps_left, turns_left):
            return False
        self.waited += 1
        return True

    def waits_ahead(self, *, steps_left: int | None, turns_left: int) -> int:
        """How many of the steps after this one (which waits) wait too, nothing else changing in between: the run's
        steps so far and left move, the turns do not (`waits` asked of each, without the trial's bookkeeping)."""
        n = 0
        while self._waiting(self.seen + n + 1, None if steps_left is None else steps_left - n - 1, turns_left):
            n += 1
        return n

    def _waiting(self, seen: int, steps_left: int | None, turns_left: int) -> bool:
        return (math.isfinite(self.share) and (steps_left is None or steps_left > turns_left)
                and self.turns + 1 > self.share * seen)

    def spent(self, run_steps: int | None) -> bool:
        """Whether the turns timed apart so far are all a run of `run_steps` steps (None: unknown) affords beyond the
        first look: SHADOW_SHARE of its steps. Each is a forward and backward thrown away, so on a short run whose
        step is dear they are seconds no gain the trial could find pays back (on a port of PyTorch's MNIST example,
        66 steps of 0.1 s, 7 turns were 0.6 s: 8% of the run); a run of unknown length is paced instead (`waits`)."""
        return run_steps is not None and self.turns >= self.share * run_steps

    def step(self, batch, run_step, cand, *, settle: bool = False, state=None) -> float:
        """`cand`'s step time, with the batch trained in the plain settings' precision and layout: the candidate's
        forward and backward on a copy of `batch` (in the candidate's layout) timed, then the RNG, the module's buffers
        (BatchNorm's running statistics, spectral norm's vectors) and the gradients put back as they were, and the
        batch trained in the plain precision and layout (the candidate's kernel). Returns the trained step's seconds
        with its forward and backward swapped for the candidate's, each of them where an optimizer's closure runs
        more (SAM's second pass, L-BFGS's line search; the optimizer step, the guard and the meter as every
        candidate pays them); the trained forward and backward (the price of keeping the numerics) is added to
        the trial's cost. `settle` (a timed turn): one untimed forward and backward first, its seconds added to the
        trial's cost, so the timed one is the candidate's steady step: the first pass after the run's own step, in
        another layout or precision, is not (mobilenet_v3_small, channels_last on a Zen 5 CPU: 83 ms, then 28 ms,
        its steady step; a run that switches pays that once). `state`: the user's state as the step found it
        (`user_state.Snapshot`: a `step_fn`'s carried hidden state, a forward's attributes), put back after the
        candidate's passes too."""
        t, live = self.stage.t, self.stage.live
        laid = batch_layout(batch, cand.channels_last)

        def candidate_pass() -> float:  # the candidate's forward and backward on a copy of the batch, its seconds
            own = map_tensors(laid, torch.Tensor.clone)  # a forward that writes its input (`x.mul_(0.5)`) leaves
            # the trained batch as it was (each tensor copied, as `to_device` walks a batch: mappings, sequences)
            t0 = time.perf_counter()
            t.forward_backward(own)
            sync(t.device)
            return time.perf_counter() - t0
        try:  # a candidate that fails part-way leaves the statistics (and the user's state) as they were too
            with forked_rng(t.device), kept_buffers(t.module):
                if settle:
                    live.add_extra(candidate_pass())
                    torch_zero_grad(t.optimizer)
                timed = candidate_pass()
        finally:
            if state is not None:
                self.stage.safety.restore(state)
        torch_zero_grad(t.optimizer)  # no torch._dynamo import for it (dynamo_deferred)
        plain = live.grid[0]
        self.stage.apply(replace(cand, precision=plain.precision, channels_last=plain.channels_last,
                                 threads=None if cand.threads is None else self.stage.plain_threads))
        batch = trial_layout(t, batch, plain.channels_last)  # as the loader gave it, where the plain layout is
        self.turns += 1
        trained_fb, forward_backward = [0.0, 0], t.forward_backward

        def clocked(b):  # the trained step's own forward and backward, to swap for the candidate's
            t2 = time.perf_counter()
            out = forward_backward(b)
            sync(t.device)
            trained_fb[0] += time.perf_counter() - t2
            trained_fb[1] += 1  # an optimizer's closure (L-BFGS's line search, SAM's second pass) runs more
            return out

        t.forward_backward = clocked  # this step only (an instance attribute over the method)
        t1 = time.perf_counter()
        try:
            run_step(batch)
            sync(t.device)
        finally:
            del t.forward_backward
        whole = time.perf_counter() - t1
        live.add_extra(trained_fb[0])
        # the step as the candidate's: its forward and backward as many times as the step ran them, the rest as run
        return whole - trained_fb[0] + timed * max(1, trained_fb[1])
