"""The trainer's measured choice of precision, channels_last, fused kernels and threads, on its own steps
(T18, T21, T23; the candidates, the schedule and the choice are `switches.py`).

`SwitchStage.prepare` turns the settings left on "auto" into a plan: the fixed rules when
nothing is left to choose (or `trial=False`, or a deterministic run), else a `LiveTrial` armed
for the run's first steps. At the first step the trial cache is read (this model, input
shape, machine, kernels and torch version measured before: 0 steps measured); on a miss the candidates take turns
on the real model and optimizer, each step a step of the run, until the trial decides and the winner stays in
effect. A candidate in another precision or memory layout than the plain settings', or in the threads stage another
thread count than the run's, is timed apart (`shadow.ShadowTurns`): the run's numerics are the plain settings' until
the trial decides, so a run that keeps them is the plain run to the last bit (unless a candidate led them by 10% on
the way on a run not given its LR: its later turns train, `_shadows`). Under DDP every rank runs the same schedule
and applies rank 0's choice (`broadcast`); the memory layout stays (the gradient buckets were laid out for it). The
user's RNG and the loader's data order are untouched: nothing is read from the loader that the run does not train on.

Example:
    >>> trainer.switcher.prepare(loader, remaining_steps=400)   # fit does this; the trial runs in the first steps
    >>> trainer.decisions["switch_trial"]
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import asdict

import torch

from torchspeed.env import detect, sync
from torchspeed.train.trial.backends import no_autotune
from torchspeed.train.loop.batch import batch_size, first_samples, forward_loss
from torchspeed.train.decision import Decision, TrialCache
from torchspeed.train.parallel.distributed import broadcast_object, is_rank_zero
from torchspeed.train.loop.guard import is_out_of_memory, one_sample_batchnorm
from torchspeed.train.trial.memory_format import apply_channels_last, has_conv2d, state_follows_layout
from torchspeed.train.trial.pool import measure_again
from torchspeed.train.optim_info import kernel_reason
from torchspeed.train.trial.precision import MixedPrecision, Precision, normalize_precision
from torchspeed.train.trial.shadow import ShadowTurns
from torchspeed.train.loop.step import OptimizerClock
from torchspeed.train.trial.switch_choice import (AHEAD, Switches, autocast_moot, batch_signature, candidate_grid,
                                                  fusable, model_signature, prior_first, rule_switches, small_here)
from torchspeed.train.trial.switches import LiveTrial
from torchspeed.train.transfer import trial_layout
from torchspeed.train.trial.trial_safety import TrialSafety, forked_rng, kept_buffers
from torchspeed.train.trial.trial_size import (_as_decisions, _current_fused, _depth, _summary, _thread_choices,
                                               set_kernel, trial_settings)

__all__ = ["PRICE_SHARE", "SwitchStage", "kernel_isa", "arm_switch_trial"]

log = logging.getLogger("torchspeed")

PRICE_SHARE = 0.08  # the most a trial may cost of a run choosing its own LR: docs/train.md, "The share"
# How the trial measures and chooses, in the cache key: a trial cached by an earlier method (which, say, timed the
# optimizer kernels on whole steps) is measured again, not read. Bump it with any change to the schedule or the choice.
TRIAL_METHOD = 7  # 6: a run affording some candidates tries them (prior_first); 7: its timed steps kept (pool.py)
GUARD_SAMPLES = 8  # the numerics guard compares the precisions' losses on the first batch's first 8 samples


def kernel_isa() -> dict:
    """The instruction sets torch's kernels run with here: ATen's dispatch level (ATEN_CPU_CAPABILITY can lower
    it) and oneDNN's cap. A trial measured under other kernels is not reused."""
    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")}


class SwitchStage:
    """The switch trial of one Trainer (`trainer.switcher`): arm it (`prepare`), run each of the run's first steps
    with its candidate in effect (`step`, which the Trainer calls while `live`), put the winner into effect and
    report it (`finish`); `apply` puts any `Switches` into effect, `current` says which are.

    A part the Trainer holds, not a base class of it: it reads and sets the Trainer's precision, layout and
    optimizer kernel through `self.t`, and writes its decisions into the Trainer's (the plan's) `Decisions`."""

    measure_fn = None  # tests: (switches, measured seconds) -> the seconds to record
    race = True  # tests of the schedule: False keeps every candidate for every round (LiveTrial._drop_beaten)
    keep_numerics = True  # False: a trial on a copy of the model (plan/switches_first): every candidate trains its own

    def __init__(self, trainer, *, prepared: bool = False):
        self.t = trainer
        self.live = None  # the trial while it runs (arms the Trainer's stepper: `live`); `_waits`: steps ahead that
        # wait for the next turn timed apart (`step`)
        self.prepared = prepared  # True: nothing to arm (FSDP2's sharded forward is collective: no trial)
        self._fixed: dict = {}
        self._trial_meta: dict = {}
        self.shadow = ShadowTurns(self)  # the turns timed apart from the run's numerics, paced
        self.safety = TrialSafety(self)  # the user's state put back, cast back; a failed step trained again
        self._plain: Switches | None = None  # what the run trains in when the trial keeps the plain settings
        self.plain_threads = torch.get_num_threads()  # the intra-op threads the run trains at while the trial runs

    @property
    def live(self) -> LiveTrial | None:
        """The trial while it runs. Setting it arms the Trainer's `stepper` with this trial's `step` (the Trainer's
        `step_batch` steps what is armed, in place of its plain step), and clearing it disarms it."""
        return self._live

    @live.setter
    def live(self, trial: LiveTrial | None) -> None:
        self._live, self._waits = trial, 0
        self.t.stepper = self.step if trial is not None else None
        if trial is not None:  # its candidates set the layout from its first step on (the rules' is not applied)
            self.t.layout_pending = False

    def prepare(self, loader: Iterable, *, remaining_steps: int | None = None, chosen: tuple | None = None) -> None:
        """Decide the switches left on "auto": the rules, or a trial on the run's first steps (`remaining_steps`
        None: a run of unknown length), or `chosen` (Switches, report): what a trial before the run measured. Once;
        fit and the bench's `all` call it."""
        if self.prepared:
            return
        self.prepared, cfg = True, self.t.config
        precision = normalize_precision(cfg.precision)
        # Under DDP the gradient buckets were laid out for the current memory format: the layout stays.
        layout = self.t.channels_last if self.t.dist is not None else cfg.channels_last
        fused = cfg.fused_optimizer
        has_conv = has_conv2d(self.t.module)
        cur_fused = _current_fused(self.t.optimizer, self.t.module)
        moot = autocast_moot(self.t.module) if precision == "auto" else None  # a float64 model: nothing to choose
        precision = "fp32" if moot else precision
        self._fixed = {"precision": moot or (None if precision == "auto" else "asked for"),
                       "channels_last": None if layout == "auto" else (
                           "asked for" if has_conv or not layout else "asked for (no 2D convolutions to change)"),
                       "fused": None if fused == "auto" else kernel_reason(fused)}
        grid = candidate_grid(caps=self.t.caps, has_conv=has_conv, precision=precision, channels_last=layout,
                              fused=cur_fused)
        fused_choice = fused == "auto" and cur_fused is not None
        threads = _thread_choices(loader, self.t.device, self.t.caps)
        self.plain_threads = torch.get_num_threads()
        prior = rule_switches(caps=self.t.caps, has_conv=has_conv, precision=precision, channels_last=layout,
                              fused=cur_fused, small=(small := small_here(self.t.module, self.t.caps)))
        grid = prior_first(grid, prior)  # a run that affords only some candidates tries the rules' choice first
        rule_why = (f"{prior.precision} is the half precision this {self.t.caps.device_type.upper()} runs natively"
                    if prior.precision != "fp32" else "fp32 asked for" if precision != "auto" else
                    small or "no native half precision") + (
            ", channels_last for a conv net" if prior.channels_last else "")
        trial = False if cfg.deterministic else cfg.trial  # a timing-dependent choice would break bit-identical reruns
        if chosen is not None:  # measured before the run, on a copy (plan/switches_first): the run's one trial
            sw, report = chosen
            sw = Switches(sw.precision, sw.channels_last, sw.fused if cur_fused is not None else None, sw.threads)
            cached = "cached_extra_s" in report  # the copy's trial read the cache
            return self._settle(sw, "cached trial" if cached else "measured before the run", _summary(report), report,
                                Decision("cached" if cached else "before the run", "measured on a copy of the model "
                                         f"before the plan's trials ({report.get('steps', 0)} steps, off the run): one "
                                         "trial per run", report))
        if len(grid) == 1 and not fused_choice and len(threads) < 2:
            return self._settle(prior, "rule", "nothing left to choose", None, Decision(
                "none", "every switch is fixed or has one option here"))
        if trial is False:
            return self._settle(prior, "rule", rule_why, None, Decision(
                "off", "deterministic run: the fixed rules decide" if cfg.deterministic else
                "trial=False: the fixed rules decide"))
        n_later = (2 if fused_choice else 0) + (len(threads) if len(threads) > 1 else 0)
        settings, short = trial_settings(len(grid), n_later, remaining_steps)
        # priced in seconds on a run of known length; not under DDP, where every rank must run the same schedule
        self._plain = grid[0]
        share = PRICE_SHARE if cfg.trial_share is None else cfg.trial_share
        self.shadow.cap = math.inf if cfg.trial_share is None else cfg.trial_share / 2  # later turns timed apart
        self.live = LiveTrial(grid, fused_choice=fused_choice, thread_choices=threads if len(threads) > 1 else (),
                              run_steps=remaining_steps if self.t.dist is None else None, share=share,
                              race=self.race and self.t.dist is None, min_gain=cfg.min_gain,
                              apart=self.keep_numerics and cfg.grad_accum == 1 and self.t.dist is None, **settings)
        self._trial_meta = {"grid": [s.label() for s in grid], "fused_choice": fused_choice, "threads": threads,
                            "short": short, "started": None, "cache_checked": False}
        self.t.decisions.refine("switch_trial", Decision("pending", "measured on the run's first steps" + short))

    def _settle(self, sw: Switches, how: str, why: str, measured: dict | None, trial: Decision) -> None:
        self.apply(sw)
        before = self.t.decisions.get("channels_last")
        for k, d in (_as_decisions(sw, how, why, measured, fixed=self._fixed) | {"switch_trial": trial}).items():
            self.t.decisions.refine(k, d)  # the trial (or the cache) refines the rule's assumption
        clause = "; not applicable to the inputs"  # the batch contract saw list inputs: the note stays
        if sw.channels_last and isinstance(before, Decision) and clause in before.reason:
            now = self.t.decisions["channels_last"]
            self.t.decisions.refine("channels_last", Decision(True, now.reason + before.reason[before.reason.index(
                clause):], now.measured))

    # ------------------------------------------------------------------ the run's first steps
    def _cache_key(self, batch) -> str:
        info = detect()
        m = self._trial_meta
        return TrialCache.key({"model": model_signature(self.t.module), "batch": batch_signature(batch),
                               "optimizer": type(self.t.optimizer).__name__, "caps": self.t.caps, "cpu": info.cpu_model,
                               "device": info.device_name if self.t.device.type != "cpu" else "cpu",
                               "torch": torch.__version__, "grid": m["grid"], "fused_choice": m["fused_choice"],
                               "threads": m["threads"], "loss": getattr(self.t.loss_fn, "__class__", type(None)).__name__,
                               "kernels": kernel_isa(), "method": TRIAL_METHOD, "min_gain": self.t.config.min_gain})

    def _check_cache(self, batch) -> bool:
        """At the first step: a trial measured before on this model, input and machine settles it (0 steps)."""
        m = self._trial_meta
        m["cache_checked"] = True
        m["key"] = self._cache_key(batch)
        hit = TrialCache().get(m["key"]) if is_rank_zero() and self.measure_fn is None else None
        hit = broadcast_object(hit)
        if hit is None:
            return False
        now = self.live
        if (why := measure_again(hit, now, _depth(hit))) is not None:  # a deeper trial, or a close choice pooled
            log.info("torchspeed: %s", why)
            return False
        self.live = None
        sw = Switches(**hit["switches"])
        report = hit | {"steps": 0, "extra_s": 0.0, "cached_extra_s": hit.get("extra_s")}
        self._settle(sw, "cached trial", _summary(hit), report, Decision(
            "cached", f"measured before on this model, input and machine ({hit.get('steps', 0)} steps then, "
                      "0 now)", report))
        return True

    def _numerics_losses(self, batch) -> dict[str, float]:
        """The loss at the current weights on `batch`'s first GUARD_SAMPLES samples in each candidate precision (eval
        mode, no grad): the guard. Rounding moves each sample's loss alike, so a few samples show it."""
        precisions = list(dict.fromkeys(s.precision for s in self.live.grid))
        if len(precisions) < 2:
            return {}
        batch = first_samples(batch, GUARD_SAMPLES)
        was, out, state = self.t.module.training, {}, self.safety.snapshot()
        self.t.module.eval()
        try:
            with torch.no_grad(), no_autotune(), forked_rng(self.t.device), kept_buffers(self.t.module):  # draws undone
                for p in precisions:
                    try:
                        with Precision(p, self.t.device.type).autocast():
                            out[p] = float(forward_loss(self.t.module, batch, loss_fn=self.t.loss_fn,
                                                        step_fn=self.t.step_fn).loss.float())
                    except Exception:  # this precision cannot run the model: the trial finds out and says why
                        continue
        finally:
            self.t.module.train(was)
            self.safety.restore(state)  # what the losses' step_fn wrote (a carried hidden state): as it was
        return out

    def step(self, batch, run_step) -> None:
        """One of the run's steps while the switch trial is on: the candidate's settings, the step, its time.
        The steps run eager (a compiled module would recompile for each candidate); compile comes after. A step
        while a turn timed apart waits (`_waits`, counted ahead) trains in the plain settings with no bookkeeping:
        a sub-millisecond step paid 35 us a step for it, over the hundreds of steps the turns are paced across."""
        with self.t.compiler.eager():
            if self._waits:
                self._waits -= 1
                self.shadow.tick()
                self.shadow.waited += 1
                return run_step(trial_layout(self.t, batch, self.live.grid[0].channels_last))
            self._trial_step(batch, run_step)

    def _trial_step(self, batch, run_step) -> None:
        trial = self.live
        if not self._trial_meta["cache_checked"]:
            if self._check_cache(batch):
                return run_step(trial_layout(self.t, batch, self.t.channels_last))
            self._trial_meta["started"] = time.perf_counter()
        cand = trial.current()
        shadow = self._shadows(cand)
        if shadow and trial.looked() and self.shadow.spent(self.t.total_steps):
            trial.leave_apart(f"the run's {self.t.total_steps} steps afford {self.shadow.turns} turns timed apart",
                              apart=self._shadows)
            if trial.done:
                self.finish()
                return run_step(trial_layout(self.t, batch, self.t.channels_last))
            cand = trial.current()
            shadow = self._shadows(cand)
        left = None if self.t.total_steps is None else self.t.total_steps - self.t.step - 1
        self.shadow.tick()
        if shadow and trial.looked() and self.shadow.waits(steps_left=left, turns_left=trial.turns_left()):
            self.apply(trial.grid[0])  # a step in the plain settings while the turns timed apart wait (paced)
            self._waits = self.shadow.waits_ahead(steps_left=left, turns_left=trial.turns_left())
            return run_step(trial_layout(self.t, batch, trial.grid[0].channels_last))
        if not self._trial_meta.get("losses_taken") and cand.precision != trial.grid[0].precision:
            # the guard's losses, at the weights now, before the first other precision trains: not before the
            # trial starts, so a trial its price stops at once (or one of a single precision) never pays them
            self._trial_meta["losses_taken"] = True
            trial.losses = self._numerics_losses(batch)
        self.apply(cand)
        laid = trial_layout(self.t, batch, cand.channels_last)  # `batch` stays as given: the plain step's
        # the optimizer-kernel stage times the optimizer's step alone: the kernels differ there only, and a 3x
        # cheaper optimizer step is a few percent of a whole step, under a whole step's noise
        clock = OptimizerClock(self.t.optimizer, self.t.device) if (
            trial.stage == "optimizer kernel" and self.t.config.grad_accum == 1) else None
        before = self.safety.snapshot() if cand != trial.grid[0] or self.safety.recent() else None  # as found
        self.safety.before_turn(cand, trial.grid[0], apart=shadow)
        t0 = time.perf_counter()
        try:
            shadow_s = self.shadow.step(batch, run_step, cand, settle=trial.timed_now(), state=before) if shadow \
                else run_step(laid)
        except Exception as e:
            if is_out_of_memory(e) or one_sample_batchnorm(e, batch_size(batch)) or (
                    cand == trial.grid[0] and not self.safety.recent()):
                raise  # not a candidate's doing: the step's caller says why (guard.step_failed)
            if not self.safety.recover(e, batch, run_step, before=before, failed=cand):
                raise (self.safety.plain_error or e) from None  # no settings train it: the plain loop's error
        else:
            self.safety.after_turn(cand, trial.grid[0])
            sync(self.t.device)
            sec = shadow_s if shadow else time.perf_counter() - t0
            alone = clock.seconds if clock is not None else None
            sec = alone if alone is not None else sec
            trial.record(self.measure_fn(cand, sec) if self.measure_fn else sec,
                         whole_step=alone is None)
        finally:
            if clock is not None:
                clock.remove()
        if trial.done and self.live is trial:
            self.finish()

    @property
    def plain(self) -> Switches:
        """The plain settings: the trial's first candidate, what the run trains in where the trial keeps them."""
        return self.live.grid[0] if self.live is not None else (self._plain or self.current())

    def recover(self, error: BaseException, batch, run_step) -> bool:
        """A step after the trial failed (`Trainer.step_batch`): right after a candidate's turn, trained again in
        settings that work (`TrialSafety.recover`); False: the user's error, raised by the caller."""
        if is_out_of_memory(error) or self.live is not None or not self.safety.recent():
            return False
        return self.safety.recover(error, batch, run_step, before=None, failed=self.current())

    def end_with(self, sw: Switches, why: str) -> None:
        """The trial ends now in `sw` (the plain settings fail after a candidate's turn; `sw` ran)."""
        trial, self.live = self.live, None
        report = dict(trial.report) if trial is not None else {}
        report["switches"] = asdict(sw)  # what a cache hit (`_check_cache`) rebuilds with Switches(**...)
        self._settle(sw, "fallback", why, report, Decision("fallback", why, report))

    def _shadows(self, cand: Switches) -> bool:
        """Whether `cand` is timed apart from the run's numerics (`ShadowTurns.step`), on one process with no
        accumulation window open across steps:

        - in the first stage, a candidate whose precision or memory layout is not the plain settings'
          (`Switches.rounds_apart`), while none measures AHEAD (10%) faster than them (then the run likely switches:
          its turns train) or `cand` is one the numerics guard refuses; on every turn on a run that switches only
          AHEAD faster (`min_gain`: one given its LR, whose numbers stay its loop's unless a change pays);
        - in the threads stage, a thread count not the run's (a matmul's or convolution's sums split otherwise over
          another count of threads: the last bits differ), while the run still trains in the plain settings."""
        trial = self.live
        if not (self.keep_numerics and self.t.config.grad_accum == 1 and self.t.dist is None):
            return False
        if trial.stage == "precision x layout":
            strict = self.t.config.min_gain >= AHEAD  # a lead this run may still refuse never trains
            return cand.rounds_apart(trial.grid[0]) and (strict or not trial.ahead_of_plain(cand))
        plain = trial.grid[0]
        return (trial.stage == "threads" and cand.threads is not None and cand.threads != self.plain_threads
                and not trial.best.rounds_apart(plain) and trial.best.fused == plain.fused)

    def finish(self) -> None:
        """Decide on what the trial measured (all of it, or what a run that ended early allowed), apply, cache."""
        trial = self.live
        if trial is None:
            return
        self.live = None
        ended_early = not trial.done
        if ended_early:
            trial.finish_early()
        report = dict(trial.report)
        report["extra_s"] = trial.extra_seconds()
        started = self._trial_meta.get("started")
        report["trial_s"] = (time.perf_counter() - started) if started else 0.0
        if self.shadow.turns:
            report["shadow_steps"] = self.shadow.turns
        if self.shadow.waited:
            report["paced_steps"] = self.shadow.waited
        sw = broadcast_object(trial.best)  # every rank runs what rank 0 measured
        report["switches"] = asdict(sw)  # what a cache hit (`_check_cache`) rebuilds with Switches(**...)
        if (self.measure_fn is None and is_rank_zero() and self._trial_meta.get("key") and report["steps"]
                and not report.get("stopped") and not ended_early):  # nothing to keep from one stopped or cut short
            TrialCache().put(self._trial_meta["key"], report)
        self._settle(sw, "measured", _summary(report), report, Decision(
            "measured", f"{report['steps']} of the run's own steps, each trained (in the plain settings' precision "
                        f"and layout while the trial ran: {report.get('shadow_steps', 0)} steps in another timed apart"
                        + (f", paced over {self.shadow.waited} more steps" if self.shadow.waited else "")
                        + f"); measuring cost "
                        f"{report['extra_s']:.2f} s over the winner{self._trial_meta['short']}", report))
        if self.t.total_steps is not None:  # the compile trial starts from the winner's eager steps
            self.t.compiler.after_switch_trial(trial.winner_times(),
                                               max(0, (self.t.total_steps - self.t.step) * self.t.config.grad_accum))

    def apply(self, sw: Switches) -> None:
        """Put `sw` into effect: autocast dtype (and its scaler), memory layout (weights and optimizer state),
        optimizer kernel, threads."""
        self.t.layout_pending = False  # the switches set the layout: the rules' (Trainer._place_model) is not applied
        if sw.precision != self.t.precision.name:
            self.t.precision = MixedPrecision(Precision(sw.precision, self.t.device.type, "measured"))
            self.safety.precision_changed(sw.precision)
            self.t.guard.precision_skips = self.t.precision.scaler is not None  # fp16's scaler skips bad steps itself
        if sw.channels_last != self.t.channels_last:
            apply_channels_last(self.t.module, sw.channels_last)
            state_follows_layout(self.t.optimizer)
        self.t.channels_last = sw.channels_last
        if sw.fused is not None and bool(self.t.optimizer.defaults.get("fused")) != sw.fused and \
                fusable(self.t.optimizer, self.t.module):  # (asked second: it walks the parameters)
            set_kernel(self.t.optimizer, sw.fused, self.t.decisions)
        if sw.threads is not None and sw.threads != torch.get_num_threads():
            torch.set_num_threads(sw.threads)

    def current(self) -> Switches:  # in effect; saved in checkpoints: a resume runs what the run it continues ran
        fused = _current_fused(self.t.optimizer, self.t.module)
        return Switches(self.t.precision.name, self.t.channels_last, fused, torch.get_num_threads() if self.t.dist is None
                        and self.t.device.type == "cpu" else None)


def arm_switch_trial(trainer, loader: Iterable, remaining_steps: int | None, chosen: tuple | None = None) -> None:
    """A first-steps part (`Trainer.first_steps`; fit's plan: its "switch_trial" stage): decide the trainer's
    switches by the rules, or arm its trial on the run's first steps (`SwitchStage.prepare`); `chosen`: the
    (Switches, report) a trial before the run measured (plan/switches_first), put into effect: no second trial."""
    trainer.switcher.prepare(loader, remaining_steps=remaining_steps, chosen=chosen)
