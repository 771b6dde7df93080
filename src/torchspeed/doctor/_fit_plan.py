"""The gap to `fit`, explained under `--verify` (T18, T21, T23, T51): what fit's plan would choose for this script.

`fit` measures its switches on the user's model (`torchspeed.train.trial.switches`): precision x
channels_last (`candidate_grid`), and takes the fastest, or the one with fewer changes within its
`min_gain` of it (`choose`). A script has its own optimizer and LR, so the plan shown by default is the
one a port gets (`ported=True`, `fit(model, loader, optimizer=..., lr=...)`): fit keeps the script's
optimizer kernel (its numbers, bit for bit) and takes a change of precision or layout only
`PORTED_MIN_GAIN` (10%) faster a step (`plan.planner._schedule`). `ported=False` is the plan of a run
that leaves the LR to fit (`recipe="auto"`): the optimizer's fused kernel joins the grid, and 2% buys
a change. The doctor holds the script's model, optimizer
and a batch, so it runs the same grid with `--verify`'s trainer (`verify._Trainer`: a copy of the
model and optimizer, one step on the captured batch), each candidate interleaved with the script's
own settings (`verify._interleave`). A candidate that differs from the script in one switch reuses
`--verify`'s measurement of that fix. The result, `obs["fit_plan"]`, names the plan, why, and its
measured per-step ratio against the script as it runs (`_rounds.round_summary`: marked inconclusive
where the rounds disagree wildly); a plan that keeps the script's own settings has no such ratio (the
script is the reference, nothing was measured against it), only each candidate's. Each switch the plan
changes maps to the fix whose rule reports it (`PLAN_FIXES`), and that finding names the plan.

fit does more than the grid, and the plan's figure does not cover it (`beyond_grid`, read from what
the doctor measured elsewhere, nothing run again): fit's thread stage (on a CPU with DataLoader
workers: all cores against the cores the workers leave), measured by the plain run's re-run of the
script with OMP_NUM_THREADS (`_envfix`); torch.compile, which fit measures on top of the plan's winner
and `--verify` measures alone on the script's model; and the glibc malloc thresholds fit sets
in-process, measured by the allocator re-run only where the script churns page faults. Each is
reported with its own figure, never multiplied into the plan's, or named as not measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from torchspeed.doctor._rounds import round_summary
from torchspeed.doctor._candidate import _Trainer
from torchspeed.doctor.verify import _amp_dtype, _interleave
from torchspeed.env import DeviceCaps
from torchspeed.doctor.observation import Observation
from torchspeed.doctor.observation_runs import (AllocatorStage, BeyondGrid, CompileStage, FitPlan, ThreadStage,
                                               VerifyResult)
from torchspeed.plan.planner import PORTED_MIN_GAIN
from torchspeed.train.trial.switch_choice import Switches, candidate_grid, choose, fusable

__all__ = ["fit_plan", "PLAN_FIXES", "plan_fixes", "beyond_grid", "MIN_GAIN"]

MIN_GAIN = 1.02  # fit's `choose` on a run that leaves the LR to fit: a change must gain at least this
PORTED_WHY = "ported with the script's own optimizer and LR: fit keeps its optimizer kernel, a change must buy " \
    f"{PORTED_MIN_GAIN:.1f}x a step"
PLAN_FIXES = {"precision": "autocast", "channels_last": "channels_last", "fused": "fused_optimizer"}


def plan_fixes(chosen: Switches, script: Switches) -> list[str]:
    """The verify fixes for the switches where the plan differs from the script."""
    return [PLAN_FIXES[k] for k in ("precision", "channels_last", "fused")
            if getattr(chosen, k) != getattr(script, k) and not (k == "fused" and not chosen.fused)]


def _script_switches(obs: Observation, caps, fusable: bool) -> Switches:
    m, o = obs.get("model") or {}, obs.get("optimizer") or {}
    precision = (caps.half or "bf16") if m.get("autocast") else "fp32"
    return Switches(precision, bool(m.get("channels_last_weights")), bool(o.get("fused")) if fusable else None)


def _measure_on_model(cap, rounds: int) -> Callable[[Switches, Switches], list[float]]:

    device = next(cap.model.parameters()).device

    def trainer(s: Switches):
        return _Trainer(cap, set_to_none=cap.set_to_none, channels_last=s.channels_last, fused_optimizer=bool(s.fused),
                        amp_dtype=_amp_dtype(device) if s.precision != "fp32" else None)

    def measure(cand: Switches, script: Switches) -> list[float]:
        return _interleave(trainer(script).step, trainer(cand).step, device, rounds=rounds)["ratios"]
    return measure


def _reused(cand: Switches, script: Switches, verify: dict[str, VerifyResult]) -> list[float] | None:
    """--verify's ratios when `cand` is the script with exactly that one fix."""
    fixes = plan_fixes(cand, script)
    diff = sum(getattr(cand, k) != getattr(script, k) for k in ("precision", "channels_last", "fused"))
    if len(fixes) == 1 and diff == 1:
        v = verify.get(fixes[0]) or {}
        return v.get("model_ratios") or v.get("ratios") if "error" not in v else None  # the model's step, as here
    return None


def fit_plan(cap, obs: Observation, *, rounds: int = 5, caps=None, measure: Callable | None = None,
             ported: bool = True) -> FitPlan:
    """fit's choice for this script's model and its measured ratio against the script's own settings: the plan of
    the script ported with its own optimizer and LR (`ported`), or of a run that leaves the LR to fit.

    `caps` (`torchspeed.env.DeviceCaps`) and `measure(candidate, script) -> per-round ratios` are injectable."""

    if cap.model is None or cap.args is None:
        return {"error": "no model forward with a captured batch"}
    caps = caps or DeviceCaps.of(next(cap.model.parameters()).device)
    can_fuse = not ported and fusable(cap.optimizer, cap.model) and \
        bool((obs.get("optimizer") or {}).get("fused_available"))  # a port keeps the script's kernel
    grid = candidate_grid(caps=caps, has_conv=bool((obs.get("model") or {}).get("has_conv2d")),
                          fused=True if can_fuse else None)
    script = _script_switches(obs, caps, can_fuse)
    measure = measure or _measure_on_model(cap, rounds)
    ratios: dict[Switches, list[float]] = {}
    errors = {}
    for s in grid:
        if s == script:
            continue
        try:
            ratios[s] = list(_reused(s, script, obs.get("verify") or {}) or measure(s, script))
        except Exception as e:  # a candidate this model cannot run: fit would reject it too
            errors[s.label()] = f"{type(e).__name__}: {e}"
    n = max((len(r) for r in ratios.values()), default=1)
    times = {s: [1.0 / r for r in rs] for s, rs in ratios.items() if rs}
    times[script] = [1.0] * n  # the script's own settings: the reference every ratio is taken against
    chosen, why = choose(times, plain=grid[0] if grid[0] in times else script,
                         min_gain=PORTED_MIN_GAIN if ported else MIN_GAIN)
    if not ratios:  # choose's "measured fastest" would be about nothing: say why nothing was measured
        why = ("every other candidate failed" if errors else "fit's grid here holds only the script's own settings"
               ) + ": nothing measured"
    # the plan keeps the script's settings: it is the reference itself, no ratio of it was measured
    measured = round_summary(ratios[chosen]) if chosen != script and ratios.get(chosen) else {}
    return {"run": "ported" if ported else "lr_left_to_fit", "grid": [s.label() for s in grid],
            "script": script.label(), "chosen": chosen.label(), "why": (f"{PORTED_WHY}; " if ported else "") + why,
            **measured, "candidates": {s.label(): round(statistics.median(r), 4) for s, r in ratios.items() if r},
            "fixes": plan_fixes(chosen, script), "errors": errors}


def _thread_stage(obs: Observation) -> ThreadStage | None:
    """fit's stage 3 on a CPU whose DataLoader has workers: all cores against the cores the workers leave."""
    c = obs.get("cpu") or {}
    workers, cores = int(c.get("workers", 0)), int(c.get("cores", 1))
    on_cpu = not str((obs.get("model") or {}).get("device", "cpu")).startswith("cuda")
    choices = sorted({cores, max(1, cores - workers)})
    if not on_cpu or workers <= 0 or len(choices) < 2:
        return None
    n = choices[0]
    out: ThreadStage = {"choices": choices, "how": f"the script re-run with OMP_NUM_THREADS={n} (plain run)"}
    v = (obs.get("env_fixes") or {}).get("threads") or {}
    if v.get("speedup") is None:
        out.update(chosen=None, why=v.get("error") or "not measured: OMP_NUM_THREADS was set already, or the "
                   "workers and threads fit the cores")
    else:
        out.update(speedup=v["speedup"], iqr=v.get("iqr"), chosen=n if v["speedup"] >= MIN_GAIN else cores)
    return out


def _compile_stage(obs: Observation) -> CompileStage:
    v = (obs.get("verify") or {}).get("compile") or {}
    if v.get("speedup") is None:
        return {"measured": False, "why": v.get("error") or "not measured (torch.compile not available, or not asked "
                "for with --verify)"}
    return {"measured": True, "speedup": v["speedup"], "iqr": v.get("iqr"), "compile_s": v.get("compile_s"),
            "how": "--verify, alone on the script's model against the script's settings"}


def _allocator_stage(obs: Observation) -> AllocatorStage:
    v = (obs.get("env_fixes") or {}).get("malloc") or {}
    if v.get("speedup") is not None:
        return {"measured": True, "speedup": v["speedup"], "iqr": v.get("iqr"),
                "how": "the script re-run with glibc's malloc thresholds (plain run)"}
    alloc = (obs.get("env") or {}).get("allocator")
    why = (f"not measured: the allocator is {alloc}" if alloc and alloc != "glibc" else
           "not measured: the script's page faults per step are under the allocator rule's threshold")
    return {"measured": False, "why": v.get("error") or v.get("skipped") or why}


def beyond_grid(obs: Observation) -> BeyondGrid:
    """What fit does beyond the plan's grid, each with the figure the doctor measured for it (see the
    module docstring); `not_covered` names, in words, what the plan's per-step figure leaves out."""
    threads, comp, alloc = _thread_stage(obs), _compile_stage(obs), _allocator_stage(obs)
    left = []
    if threads is not None:
        left.append("fit's thread stage (" + (f"{threads['choices'][0]} threads measured {threads['speedup']:.2f}x "
                    "on the script, separately" if threads.get("speedup") is not None else "not measured") + ")")
    left.append("torch.compile (fit measures it on top of the plan; " + (
        f"--verify measured it alone at {comp['speedup']:.2f}x" if comp["measured"] else "not measured here") + ")")
    left.append("fit's in-process malloc thresholds (" + (
        f"re-run measured {alloc['speedup']:.2f}x, separately" if alloc["measured"] else "not measured here") + ")")
    return {"threads": threads, "compile": comp, "allocator": alloc, "not_covered": left}
