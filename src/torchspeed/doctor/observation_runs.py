"""The observation schema's measured part (T02): what the doctor records when it runs candidates against the
script's own settings (`--verify`'s fixes, `fit`'s plan on the script's model, the environment re-runs).

`observation.Observation` holds these under "verify", "fit_plan" and "env_fixes"; readers import them from here.
Keys several TypedDicts share in meaning are declared once, in a private base they inherit (`_RoundRatios`: the
per-round ratios of every interleaved measurement; `_FixRun`; `_StageFigure`).
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["VerifyResult", "FitPlan", "BeyondGrid", "ThreadStage", "CompileStage", "AllocatorStage", "EnvFixResult",
           "LossCheck"]


class _RoundRatios(TypedDict, total=False):
    """A candidate timed against the script's own settings in interleaved rounds: the per-round ratios (the
    script's time / the candidate's) and what they say. `--verify`'s fixes, the environment re-runs and fit's
    plan all report these."""
    speedup: float               # median of the per-round ratios
    ratios: list[float]
    iqr: list[float]             # the middle half of the ratios
    within_noise: bool           # the middle half holds 1.0 (with fewer than 3 rounds: any round on each side)
    inconclusive: bool           # the rounds disagree by more than 2x (`_rounds`): no claim is made on them
    interval: list[float]        # 95% bootstrap interval of the ratio of the medians (`_interval`)
    verdict: str                 # `report.interval_verdict`: faster | slower | no-change | likely-* | inconclusive
    settle: str                  # inconclusive: what would settle it
    samples_ms: list[list[float]]  # the raw rounds: [the script's ms per step, the fix's]


class LossCheck(TypedDict, total=False):
    """The fix's losses against the script's over its first `steps` steps, same weights (`verify`); ok None: n/a."""
    steps: int
    baseline: list[float]
    candidate: list[float]
    max_rel_diff: float
    tolerance: float
    ok: bool | None


class _FixRun(_RoundRatios, total=False):
    """One named fix measured in `rounds` rounds, or why it could not be."""
    fix: str
    rounds: int
    error: str                   # the fix could not be measured
    ceiling: float; skipped: str  # its gain's bound from a measured share; not run: that bound is under 2%


class VerifyResult(_FixRun, total=False):
    """`--verify`'s measurement of one fix on the script's model, interleaved with its baseline (`verify`)."""
    rule: str | None             # the first rule the fix proves (`registry.fix_rules`)
    baseline_ms: float
    candidate_ms: float
    steps_per_round: int
    candidate: str               # what the candidate ran: "num_workers=2", "torch.autocast('cpu', ...)", the fix
    current: str                 # workers, pin_memory: the script's setting, "num_workers=0"
    direction: str               # workers: "fewer" | "more" | "same"
    tuner: str                   # workers: why the tuner chose its count
    compile_s: float             # compile: the first step's time, compilation included
    note: str                    # the optimizer could not be rebuilt: what was used instead
    seconds: float               # the measurement's own wall time
    loss_check: LossCheck
    model_speedup: float; model_interval: list[float]; model_ratios: list[float]  # the model's step alone
    compute_share: float         # the model's step's share of the script's (`_interval.whole_step`)


class _StageFigure(TypedDict, total=False):
    """What the doctor measured for one of fit's stages beyond the plan's grid: how, or why not, and the figure."""
    how: str                     # what ran to measure it
    why: str                     # why it was not measured
    speedup: float
    iqr: list[float] | None


class ThreadStage(_StageFigure, total=False):
    """fit's thread stage on a CPU with DataLoader workers, read from the `threads` environment re-run."""
    choices: list[int]
    chosen: int | None


class _SwitchStage(_StageFigure, total=False):
    """A stage fit switches on or leaves off: `measured` says whether the doctor has its figure."""
    measured: bool


class CompileStage(_SwitchStage, total=False):
    """torch.compile on top of the plan, from `--verify`'s compile fix on the script's model."""
    compile_s: float | None


class AllocatorStage(_SwitchStage, total=False):
    """fit's in-process malloc thresholds, from the `malloc` environment re-run of the script."""


class BeyondGrid(TypedDict, total=False):
    """What fit does beyond the plan's grid, each with its own figure (`_fit_plan.beyond_grid`)."""
    threads: ThreadStage | None
    compile: CompileStage
    allocator: AllocatorStage
    not_covered: list[str]


class FitPlan(_RoundRatios, total=False):
    """fit's choice of switches for the script's model under `--verify`, measured against the script (`_fit_plan`)."""
    error: str                   # no plan: no model forward with a captured batch
    run: str                     # "ported" (the script's optimizer and LR given: its kernel kept, the 10% rule)
                                 # or "lr_left_to_fit" (the fused kernel in the grid, the 2% rule)
    grid: list[str]              # the candidates' labels, "bf16+channels_last+fused", ...
    script: str                  # the script's own switches
    chosen: str
    why: str
    candidates: dict[str, float]  # label -> median ratio against the script
    fixes: list[str]             # the verify fixes for the switches the plan changes
    errors: dict[str, str]       # label -> why that candidate could not run
    beyond_grid: BeyondGrid      # added by the report (`diagnose.report_from_observation`)


class EnvFixResult(_FixRun, total=False):
    """One environment fix (or the workers patch) re-run on the script, interleaved with the original (`_envfix`)."""
    rule: str
    env: dict[str, str]          # the variables set
    steps: int
    baseline_ms: float | None
    candidate_ms: float | None
    patch: str                   # a source fix: the --fix patch that ran, its label and worker count
    label: str
    workers: int
    more_rounds: str             # why rounds beyond the first were not run (`_envfix.ENV_MORE_S`)
