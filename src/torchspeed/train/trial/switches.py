"""Every automatic switch measured on the user's own model, on the run's own steps (T18, T21, T23; T25 in compile.py; threads).

A fixed rule ("bf16 whenever the CPU has it", "channels_last for any conv net") loses on
models unlike the one it was tuned on: torchvision's ImageNet-stem ResNet-18 on 32 px images
runs slower with bf16 + channels_last on a bf16 CPU than a plain fp32 loop, while the same
rules give 2x on a CIFAR ResNet-20. So `fit` measures instead:

1. **Candidates** (`candidate_grid`, a pure function of the device's capabilities and the
   settings left on "auto"): precision (fp32, and the half precision the hardware runs
   natively: emulated bf16 is 20-50x slower and is never tried) x channels_last (only for
   models with 2D convolutions), with the optimizer's fused kernel. Then, on the winner, the
   fused kernel against foreach (SGD/Adam/AdamW), and on a CPU whose DataLoader has worker processes,
   the intra-op thread count (all usable cores, or the cores the workers leave). Switches interact
   (bf16 with channels_last can lose where each alone wins), so the first stage is a grid, not one
   switch at a time; the later stages are pruned to the winner.
2. **Measurement** (`LiveTrial`): the run's own first steps, on the real model and optimizer.
   Each candidate is put into effect (autocast dtype, memory layout of the weights, the
   optimizer state and the inputs, optimizer kernel, threads) and trains real steps: `warmup`
   untimed, then `rounds` interleaved rounds of `steps` timed steps; median per candidate.
   Every one of those steps counts toward the run, so the cost of measuring is the time the
   slower candidates and the switches between settings lose (`LiveTrial.extra_seconds`, warm-up
   steps included), and a turn timed apart (shadow.py) its pass thrown away. A short run measures
   fewer rounds (`trial_size.trial_settings`) and says so; a run too short to pay for every candidate,
   all of it counted, tries those it affords, the rules' choice first (`switch_choice.prior_first`), and
   one too short for even that keeps the plain settings (`_price`). Every candidate gets its warm-up step, even
   in the shortest trial: a setting's first step in a process carries one-off work (oneDNN
   primitives, cuDNN plans) that, timed, picks the setting the process happened to run before.
3. **Choice** (`choose`, pure): the fastest candidate, except that a candidate with fewer
   changes from the plain loop wins when it is within `min_gain` (2%) of the fastest, and a
   change must be the faster in `SURE` (75%) of the pairings of its timed steps with the plain
   settings': noise does not buy a change. A half precision whose loss, at the same weights on the same
   batch, differs from fp32's by more than `loss_tol` is not taken (the numerics guard).
4. **Cache**: the result is cached per (model, input shape, machine, kernels, torch version) in
   `TrialCache`, so the next run measures nothing, unless the cached trial measured less than
   this run affords (a short run's choice is measured again by a longer run, once).

torch.compile is measured on real training steps after this trial, on top of its winner (`compile.py`).

Example:
    >>> trial = LiveTrial(candidate_grid(caps=DeviceCaps.of("cpu"), has_conv=True))
    >>> while not trial.done:
    ...     apply(trial.current()); trial.record(seconds_of_one_training_step())
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

from torchspeed.train.trial.pool import CLOSE, pooled
from torchspeed.train.rounds import medians, turns
from torchspeed.train.trial.switch_choice import AHEAD, Switches, choose, numerics_ok

DROP_AT = 1.5  # a candidate this many times slower than the fastest after one timed step is out of the later rounds
# The least a switch's one-off work (its kernels' first use in the process) is priced at. Measured: in a process that
# had run fp32 steps, a 32-128-128-10 MLP's first bf16 autocast step took 9.4 ms against 0.45 ms a step after
# (2-core Zen 4): the plain settings' first step, warm there, had priced it at one step, 20x under.
FIRST_SWITCH_S = 0.008

__all__ = ["LiveTrial", "trial_steps", "DROP_AT"]


def trial_steps(n_candidates: int, *, rounds: int, steps: int, warmup: int) -> int:
    return n_candidates * (warmup + rounds * steps)


class LiveTrial:
    """The schedule and the record of a switch trial run on the run's own training steps.

    Each step the trainer asks `current()` for the candidate to train with, applies it, trains
    one real step and `record`s its seconds. Stage 1 (the `grid`): every candidate gets `warmup`
    untimed steps, then `rounds` interleaved rounds of `steps` timed steps each (a slow phase of
    the machine hits every candidate alike). Stage 2 (`fused_choice`): the winner's optimizer
    kernel against the other one; stage 3 (`thread_choices`): intra-op thread counts on the
    winner. `losses` (precision -> loss at the same weights on the same batch, measured before
    the first step) feed the numerics guard. Every step trains (a turn timed apart: `shadow.ShadowTurns`)."""

    def __init__(self, grid: list[Switches], *, fused_choice: bool = False, thread_choices: tuple[int, ...] = (),
                 rounds: int = 3, steps: int = 2, warmup: int = 1, min_gain: float = 1.02, loss_tol: float = 0.05,
                 losses: dict[str, float] | None = None, run_steps: int | None = None, share: float = 0.25,
                 race: bool = True, apart: bool = True):
        self.grid, self.fused_choice, self.thread_choices = grid, fused_choice, thread_choices
        self.rounds, self.steps, self.warmup = rounds, steps, warmup
        self.min_gain, self.loss_tol = min_gain, loss_tol
        self.run_steps, self.share = run_steps, share  # the trial's price in seconds: see _price
        self.apart = apart  # a candidate in another precision or layout is timed apart: its timed passes thrown away
        self.race = race  # drop a candidate every timed step of the fastest beat (_drop_beaten); off under DDP
        self.losses = dict(losses or {})
        self.report: dict = {"failed": {}, "rejected": {}, "stages": [], "rounds": rounds, "steps_per_round": steps,
                             "warmup": warmup}
        self.steps_run = 0
        self._extra = 0.0
        self._seen: dict[Switches, list[float]] = {}
        self.best: Switches | None = None
        self.prior: dict | None = None  # a cached trial's pool, measured again (pool.py)
        self._stages = self._stage_list()
        self._start_stage(self._stages.pop(0))

    # ------------------------------------------------------------------ the schedule
    def _stage_list(self) -> list[str]:
        return ["precision x layout"] + (["optimizer kernel"] if self.fused_choice else []) + (
            ["threads"] if len(self.thread_choices) > 1 else [])

    def _stage_candidates(self, name: str) -> list[Switches]:
        if name == "precision x layout":
            return list(self.grid)
        if name == "optimizer kernel":
            return [self.best, replace(self.best, fused=not self.best.fused)] if self.best.fused is not None else []
        return [replace(self.best, threads=n) for n in self.thread_choices]

    def _start_stage(self, name: str) -> None:
        cands = self._stage_candidates(name)
        self.stage, self.candidates = name, cands
        self.times: dict[Switches, list[float]] = {s: [] for s in cands}
        schedule = turns(cands, rounds=self.rounds, warmup=self.warmup, repeat=self.steps,
                         warm=[s for s in cands if s != self.best])  # the winner is warm
        self._queue = [(t.key, t.round > 0) for t in schedule]
        if name == "precision x layout" and self.run_steps is not None and self.warmup and len(cands) > 1:
            # the plain settings' first timed step right after their warm-up: the step's cost and a switch's
            # one-off cost are known before any other candidate is tried (_price)
            self._queue.insert(self.warmup, self._queue.pop(self._queue.index((cands[0], True))))
        self._pruned = self._raced = self._part_timed = False
        self._warm: list[tuple[Switches, float, bool]] = []  # (candidate, seconds, the run's first step)

    def _fastest_allowed(self) -> tuple[Switches | None, dict[Switches, float]]:
        """The fastest candidate by median that the numerics guard allows (None: none is), and every median."""
        rejected = self._rejections(self.grid[0]) if self.stage == "precision x layout" else {}
        med = medians(self.times)
        allowed = [c for c in med if c not in rejected]
        return (min(allowed, key=med.get) if allowed else None), med

    def _leave(self, out: dict[Switches, str]) -> None:
        """`out`'s candidates take no later turns (their timings stay in the record), each with its reason."""
        if out:
            self._queue = [(c, t) for c, t in self._queue if c not in out]
            self.report.setdefault("dropped", {}).update({c.label(): why for c, why in out.items()})

    def _drop_long_shots(self) -> None:
        """Once every candidate has a timed step: one DROP_AT x slower than the fastest (that the numerics guard
        allows) leaves the later rounds. Each of its turns would cost the run a slow step, and no step's noise
        turns 1.5x around; its timings stay in the record."""
        if self._pruned or not all(self.times.values()):
            return
        self._pruned = True
        ref, med = self._fastest_allowed()
        if ref is not None:
            self._leave({c: f"{m / med[ref]:.2f}x the fastest after its first timed step: out of the later rounds"
                         for c, m in med.items() if m > DROP_AT * med[ref]})

    def _drop_beaten(self) -> None:
        """Once every candidate has two timed steps: one whose fastest step is slower than every step of the fastest
        candidate (by median, that the numerics guard allows) leaves the later rounds. Where the two run alike,
        that happens by chance to 1 pair in 6 and costs nothing (within `min_gain` the choice keeps the one with
        fewer changes); where the candidate is slower, it saves its later turns, each a slow step or, timed
        apart, a forward and backward thrown away. The plain settings leave only to one AHEAD of them."""
        if not self.race or self._raced or not all(len(v) >= 2 for v in self.times.values()) or len(self.times) < 2:
            return
        self._raced = True
        ref, med = self._fastest_allowed()
        queued = {c for c, _ in self._queue}
        if ref is not None:
            self._leave({c: f"each of its timed steps slower than every one of {ref.label()}: out of the later rounds"
                         for c, v in self.times.items() if c != ref and c in queued and min(v) > max(self.times[ref])
                         and (c != self.candidates[0] or med[ref] * AHEAD <= med[c])})

    @property
    def done(self) -> bool:
        return not self._queue

    def current(self) -> Switches:
        return self._queue[0][0]

    def timed_now(self) -> bool: return self._queue[0][1]  # whether the current turn is timed (not a warm-up)

    def record(self, seconds: float, *, whole_step: bool = True) -> None:
        """The seconds the current candidate's step took (warm-up steps are not timed); `whole_step` False: the
        seconds of the part the stage's candidates differ in (the optimizer's step), not a step's."""
        s, timed = self._queue.pop(0)
        self.steps_run += 1
        if not timed and whole_step:  # a warm-up step trains and costs too: see extra_seconds
            first = self.steps_run == 1  # the run's first step: its start-up cost is paid with or without a trial
            self._warm.append((s, seconds, first))
            if self.stage == "precision x layout" and s != self.grid[0]:
                self._price()  # its one-off cost is known now: the rest priced at the dearest seen so far
        if timed and s in self.times:
            self.times[s].append(seconds)
            if whole_step:  # what the compile trial compares against: seconds per whole eager step
                self._seen.setdefault(s, []).append(seconds)
            else:
                self._part_timed = True
            self._drop_long_shots()
            self._drop_beaten()
            if self.stage == "precision x layout" and s == self.grid[0] and len(self.times[s]) == 1:
                self._price()
        if not self._queue:
            self._end_stage()

    def _price(self) -> None:
        """The trial priced in seconds, once the plain settings have one warm-up and one timed step, and again after
        each other candidate's first step: each candidate not tried yet costs at least a switch's one-off work
        (kernel loading, cuDNN's autotuning, oneDNN's primitives) or a step, and one timed apart (`apart`) its first
        look's timed passes too, each a forward and backward thrown away. The one-off work is the dearest first
        step seen so far over the plain settings' timed step: the plain settings' own (an upper estimate in a fresh
        process, as it holds the process's start-up too) or a candidate's (in a process that ran the plain
        settings before, theirs is cheap and a new setting's is not), for a precision or layout never under
        `FIRST_SWITCH_S` (its kernels' first use; a later stage's kernel or thread count costs far less). Where the
        rest exceeds what is left of `share` of the run's seconds at the plain settings' pace once what the trial
        cost so far is taken off (the share bounds the whole trial, not each look), the candidates not
        tried yet leave from the end of the grid's order (the rules' choice comes first: `switch_choice.prior_first`)
        until the rest fits (`report["untried"]`); where not even the first fits and nothing but the plain settings was
        tried, no gain the trial could find pays for it: the run keeps the plain settings (`report["stopped"]`)."""
        plain = self.grid[0]
        timed = self.times.get(plain)
        if self.run_steps is None or not timed or math.isinf(self.share) or "stopped" in self.report:
            return
        step_s = timed[0]
        dearest = max((sec for _, sec, _ in self._warm), default=step_s)  # any setting's first step, the plain's too
        switch_s = max(dearest - step_s, step_s) * self.warmup
        new_s = max(switch_s, FIRST_SWITCH_S * self.warmup)  # a precision or layout's kernels: their first use
        tried = {c for c, _, _ in self._warm}
        queued = {c for c, _ in self._queue}
        untried = [c for c in self.candidates if c not in tried and c in queued]
        later = (1 if self.fused_choice else 0) + len(self.thread_choices)
        run_s = self.run_steps * step_s

        def cost(cands: list[Switches], stages: int = later) -> float:
            # a candidate timed apart also throws its first look's timed passes away: a step each
            thrown = sum(self.steps for c in cands if self.apart and c.rounds_apart(plain))
            return len(cands) * new_s + stages * switch_s + thrown * step_s

        spent = self._extra + self._stage_extra(self.times, medians(self.times), step_s)  # cost so far, as counted
        budget = self.share * run_s - spent  # the share bounds the whole trial, not each look
        paid = f", {spent:.2f} s of it spent already" if spent > 0 else ""
        if not untried and not later or cost(untried) <= budget:
            return

        def fitting(stages: int) -> list[Switches]:
            keep = list(untried)
            while keep and cost(keep, stages) > budget:
                keep.pop()
            return keep
        keep, stages = fitting(later), later
        if not keep and later and (alone := fitting(0)):  # the rules' choice before the later stages (kernel, threads)
            keep, stages = alone, 0
        others = len(untried) + later
        if keep or len(tried) > 1:  # some candidate is (or was) tried: the rest that does not fit is left out
            out = untried[len(keep):]
            why = (f"not tried: the {len(keep)} setting(s) ahead of it in the rules' order cost about "
                   f"{cost(keep, stages):.2f} s to try (a switch's first step {new_s:.3f} s), all {others} about "
                   f"{cost(untried):.2f} s, over {self.share:.0%} of this {self.run_steps}-step run's ~{run_s:.2f} s "
                   f"at the plain settings' pace{paid}")
            self._untried(out, cost(keep, stages) > budget or stages < later, why)
            return
        self.report["stopped"] = (f"not measured: {others} other setting(s) would cost about {cost(untried):.2f} s to "
                                  f"try (a switch's first step {new_s:.3f} s), over {self.share:.0%} of this "
                                  f"{self.run_steps}-step run's ~{run_s:.2f} s at the plain settings' pace{paid}")
        self._queue, self._stages = [], []

    def pool_with(self, pool: dict, rivals: list[str]) -> None:
        """Measure a cached close choice again (`pool.measure_again`): the plain settings, the cached choice and
        its `rivals` take their turns, the others none, and the choice reads `pool`'s timed steps too."""
        self.prior, keep = pool, {pool["chosen"], *rivals}
        self._leave({c: f"not within {CLOSE:.0%} of the cached choice {pool['chosen']}: not measured again"
                     for c in self.candidates if c != self.grid[0] and c.label() not in keep})

    def _untried(self, out: list[Switches], stages: bool, why: str) -> None:
        """`out`'s candidates, and with `stages` the later stages (the optimizer kernel, the threads), are not tried
        (`_price`): named in `report["untried"]` with `why`, and off the schedule."""
        out_stages = self._stage_list()[1:] if stages else []
        if stages:
            self._stages = []
            self.fused_choice, self.thread_choices = False, ()
        self.report.setdefault("untried", {}).update({c.label(): why for c in out} | {
            f"the {name} stage": why for name in out_stages})
        self.report["run_steps"] = self.run_steps
        for c in out:
            self.times.pop(c, None)
        self._queue = [(c, t) for c, t in self._queue if c not in out]

    def fail(self, error: BaseException, cand: Switches | None = None) -> None:
        """`cand` (the current candidate) cannot run (a precision this model cannot take): out of the race, why."""
        s = cand if cand is not None else self.current()
        self.report["failed"][s.label()] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
        self.times.pop(s, None)
        self._queue = [(c, t) for c, t in self._queue if c != s]
        if not self._queue:
            self._end_stage()

    def finish_early(self) -> None:
        """The run ended inside the trial: decide on what was measured so far."""
        while self._queue or self._stages:
            self._queue = []
            self._end_stage()

    def _end_stage(self) -> None:
        name, times = self.stage, self.times
        if name == "precision x layout":
            plain = self.grid[0]
            rejected = self._numerics(plain)
            basis, pool = pooled(times, plain, self.prior)  # with a close cached choice's timed steps (pool.py)
            best, why = choose(basis, plain=plain, min_gain=self.min_gain, rejected=rejected)
            if self.prior and pool:
                why += f"; pooled with the timed steps of {pool['runs'] - 1} earlier run(s)"
            if pool:
                self.report["pool"] = pool | {"chosen": best.label(), "run_steps": self.run_steps}
            if self.report.get("stopped"):  # (a close cached choice measured again: the cache's stands)
                best = next((c for c in self.grid if self.prior and c.label() == self.prior["chosen"]), plain)
                why = f"kept {'the cached choice' if best != plain else 'the plain settings'}, {self.report['stopped']}"
            elif self.report.get("untried"):
                left = self.report["untried"]
                why += f"; {', '.join(left)} {next(iter(left.values()))}"
        else:
            # within the noise the run keeps the kernel it started with (the rule's: fused where torch has one, a
            # 2-3x cheaper optimizer step on a CPU), not foreach: a 1-step trial cannot resolve a 10% step difference
            plain = self.best if name == "optimizer kernel" else self.candidates[0]
            best, why = choose(times, plain=plain, min_gain=self.min_gain,
                               ref="the kernel the run started with" if name == "optimizer kernel" else "the plain settings")
            if not any(times.values()):
                best, why = self.best, "not measured (the run ended first): kept"
        med = medians(times)
        self.report["stages"].append({"stage": name, "chosen": best.label(), "why": why, "seconds_per_step": {
            s.label(): m for s, m in med.items()}, "timed": "the optimizer step" if self._part_timed else "the step"})
        self.best = best
        if best in med:
            self._extra += self._stage_extra(times, med, med[best])
        if self._stages:
            self._start_stage(self._stages.pop(0))
        else:
            self.report.update(steps=self.steps_run, chosen=best.label(), switches=asdict(best))

    def _stage_extra(self, times: dict, med: dict, best: float) -> float:
        """A stage's cost over its winner: each timed step at its candidate's median above the winner's, and each
        warm-up step above the winner's median (switching to a setting and its first step's one-off work are
        part of measuring). The run's first step counts at most its candidate's median: the start-up cost
        there is paid with or without a trial."""
        extra = sum(max(0.0, m - best) * len(times[c]) for c, m in med.items())
        for c, sec, first in self._warm:
            extra += max(0.0, (min(sec, med[c]) if first and c in med else sec) - best)
        return extra

    def _rejections(self, plain: Switches) -> dict[Switches, str]:
        """The candidates whose precision moves the loss at the same weights beyond `loss_tol`, and why."""
        ref = self.losses.get(plain.precision)
        rejected = {}
        for s in self.times:
            loss = self.losses.get(s.precision)
            if ref is None or loss is None or s.precision == plain.precision:
                continue
            if not numerics_ok(ref, loss, tol=self.loss_tol):
                rejected[s] = f"loss {loss:.4g} vs {ref:.4g} in {plain.precision} at the same weights (> {self.loss_tol:.0%} apart)"
        return rejected

    def _numerics(self, plain: Switches) -> dict[Switches, str]:
        rejected = self._rejections(plain)
        self.report["rejected"].update({s.label(): why for s, why in rejected.items()})
        self.report["losses"] = dict(self.losses)
        return rejected

    def winner_times(self) -> list[float]:
        """The timed steps of the chosen settings (eager seconds per step: what a compile trial compares against)."""
        return list(self._seen.get(self.best, []))

    def looked(self) -> bool:
        """In the first stage: whether every candidate in another precision or layout than the plain settings' has a
        timed step, or has left the race (the first look at what a switch of them would buy)."""
        if self.stage != "precision x layout":
            return True
        queued = {c for c, _ in self._queue}
        return all(self.times.get(c) or c not in queued for c in self.candidates if c.rounds_apart(self.grid[0]))

    def ahead_of_plain(self, cand: Switches | None = None) -> bool:
        """First stage: whether a candidate in another precision or layout that the numerics guard allows measured
        AHEAD x faster (median) than the plain settings (a lead noise rarely makes), `cand` not one it refuses."""
        if self.stage != "precision x layout" or not self.times.get(plain := self.grid[0]):
            return False
        med, out = medians(self.times), self._rejections(plain)
        return cand not in out and any(m * AHEAD <= med[plain] for c, m in med.items() if c.rounds_apart(plain)
                                       and c not in out)

    def leave_apart(self, why: str, apart=None) -> None:
        """The candidates timed apart (`apart(c)`, default: in another precision or layout than the plain settings')
        take no more turns (`why`); the stage decides on what they measured."""
        self._leave({c: why for c, _ in self._queue if (apart(c) if apart else c.rounds_apart(self.grid[0]))})
        if not self._queue:
            self._end_stage()

    def turns_left(self) -> int:
        """The turns still to run: this stage's, and at most a full schedule for each stage after it."""
        later = sum(trial_steps(2 if name == "optimizer kernel" else len(self.thread_choices), rounds=self.rounds,
                                steps=self.steps, warmup=self.warmup) for name in self._stages)
        return len(self._queue) + later

    def add_extra(self, seconds: float) -> None:
        """Seconds the run spent measuring beyond the steps recorded (a step timed apart: autoswitch)."""
        self._extra += seconds

    def extra_seconds(self) -> float:
        """What measuring cost: the trial's steps (warm-ups too) above their stage winner's median (each trained)."""
        return self._extra
