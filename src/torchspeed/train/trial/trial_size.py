"""How large the switch trial is and how its outcome is written down (T18, T21, T23): `TRIAL_SETTINGS` and
`trial_settings`, the rounds and timed steps a run affords within `LIVE_SHARE` of its steps; the thread counts
the threads stage tries; whether the optimizer runs its fused kernel now; and one `Decision` per switch
(precision, channels_last, fused kernels, threads) for what the trial chose.

`autoswitch.SwitchStage` runs the trial with these; `switches.LiveTrial` is its schedule.
"""

from __future__ import annotations

import torch

from torchspeed.env import DeviceCaps
from torchspeed.train.decision import Decision
from torchspeed.train.optim import describe_optimizer
from torchspeed.train.trial.switch_choice import Switches, fusable, set_fused
from torchspeed.train.trial.switches import trial_steps

__all__ = ["TRIAL_SETTINGS", "LIVE_SHARE", "trial_settings"]

TRIAL_SETTINGS = {"rounds": 3, "steps": 2, "warmup": 1}
LIVE_SHARE = 0.25  # a short run spends at most about this share of its steps trying candidates (each step trains)


def trial_settings(n_first: int, n_later: int, remaining_steps: int | None) -> tuple[dict, str]:
    """Rounds, timed steps and warm-up steps for a trial of `n_first` grid candidates and `n_later` later ones,
    within LIVE_SHARE of `remaining_steps` (None: a run of unknown length takes the full settings)."""
    if remaining_steps is None:
        return dict(TRIAL_SETTINGS), ""
    budget = max(2 * n_first, int(LIVE_SHARE * remaining_steps))
    fits = [(r, s) for r, s in ((3, 2), (2, 2), (2, 1)) if trial_steps(n_first + n_later, rounds=r, steps=s,
                                                                         warmup=1) <= budget]
    rounds, steps = fits[0] if fits else (1, 1)  # the fullest that fits; the least there is
    why = "" if (rounds, steps) == (3, 2) else (
        f"; a {remaining_steps}-step run affords {rounds} round(s) of {steps} timed step(s) per candidate")
    return {"rounds": rounds, "steps": steps, "warmup": 1}, why

def _depth(report: dict) -> int:
    """How many timed steps a trial gave each candidate (a cached report: rounds x steps_per_round)."""
    return int(report.get("rounds", TRIAL_SETTINGS["rounds"])) * int(report.get("steps_per_round",
                                                                                 TRIAL_SETTINGS["steps"]))

def _thread_choices(loader, device: torch.device, caps: DeviceCaps) -> tuple[int, ...]:
    workers = getattr(loader, "num_workers", 0) or 0
    if device.type != "cpu" or workers <= 0 or caps.cores < 2:
        return ()
    return tuple(dict.fromkeys((caps.cores, max(1, caps.cores - workers))))

def _current_fused(optimizer, model) -> bool | None:
    return bool(optimizer.defaults.get("fused")) if fusable(optimizer, model) else None

def _as_decisions(sw: Switches, how: str, why: str, measured: dict | None, *, fixed: dict) -> dict[str, Decision]:
    """One Decision per switch: 'asked for' where the user fixed it, else `how` (measured/cached/rule)."""
    out = {"precision": Decision(sw.precision, fixed.get("precision") or f"{how}: {why}", measured),
           "channels_last": Decision(sw.channels_last, fixed.get("channels_last") or f"{how}: {why}", measured)}
    if sw.fused is not None:  # the rule's kernel is the fused one where torch has it, whatever the other switches
        out["fused_optimizer"] = Decision(sw.fused, fixed.get("fused") or (
            "rule: the fused kernel where torch has one" if how == "rule" else f"{how}: {why}"), measured)
    if sw.threads is not None:
        out["threads"] = Decision(sw.threads, f"{how}: {why}", measured)
    return out

def set_kernel(optimizer, fused: bool, decisions) -> None:
    """The optimizer's fused kernel on or off (a trial's candidate), the "optimizer" decision refined once."""
    set_fused(optimizer, fused)
    before = decisions.get("optimizer")  # the optimizer's choice (the plan's, or asked for) stands
    if before is None:
        why = "kernel measured"
    elif before.reason.endswith("its kernel measured"):  # each candidate's turn flips it: said once
        why = before.reason
    else:
        why = f"{before.reason}; its kernel measured"
    decisions.refine("optimizer", Decision(describe_optimizer(optimizer), why))

def _summary(report: dict) -> str:
    return "; ".join(f"{s['stage']}: {s['chosen']}, {s['why']}" for s in report.get("stages", []))
