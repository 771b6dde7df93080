"""The doctor's report: the environment (T01), the step-time breakdown (T02), ranked findings.

`DoctorReport.to_dict()` is the `--json` format:
`{"breakdown": {...}, "findings": [{"rule", "severity", "evidence", "fix", "est_gain", "measured_gain", "patch",
"basis", "also"}], ...}`
plus `env`, `script`, `status`, `traceback`, `verify`, `notes`, and `observation`: every number the
rules read, in the declared schema (`torchspeed.doctor.observation.Observation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torchspeed._io import write_json
from torchspeed.doctor.observation import Breakdown, Environment, Observation
from torchspeed.doctor.observation_runs import VerifyResult

__all__ = ["Finding", "DoctorReport", "HIGH_GAIN", "MEDIUM_GAIN", "MIN_EFFECT", "interval_verdict",
           "settle_text", "report_verdict", "exit_code", "REGRESSION_EXIT"]

ESTIMATED = "estimated, not measured"
# A measured finding is high when its interval's lower bound clears HIGH_GAIN, medium when it clears MEDIUM_GAIN
# (`registry.settle`); a fix whose interval stays within MIN_EFFECT of 1.0 either way changed nothing.
HIGH_GAIN, MEDIUM_GAIN, MIN_EFFECT = 1.25, 1.05, 1.02
REGRESSION_EXIT = 3  # `--fail-on-regression`: a measured fix clears the medium threshold at its lower bound


def gain_text(f: Finding) -> str:
    """How a finding's gain is known, in words: "measured 1.42x", "est. 1.10x, estimated, not measured"."""
    if f.measured_gain is not None and f.basis == "measured":
        return f"measured {f.measured_gain:.2f}x"
    if f.est_gain is None:
        return "no estimate"
    return f"est. {f.est_gain:.2f}x" + (f", {ESTIMATED}" if f.basis == "estimated" else " from timed work")


def interval_verdict(lo: float, hi: float) -> str:
    """What a measured interval of a fix's speed-up says: "faster" (its lower bound clears `MIN_EFFECT`),
    "slower" (its upper bound is under 1 / `MIN_EFFECT`), "no-change" (it lies within `MIN_EFFECT` of 1.0 either
    way: settled), "likely-faster" / "likely-slower" (wholly on one side of 1.0, but reaching both inside and past
    the minimum effect: the direction is known, the size not), "inconclusive" (it holds 1.0 and reaches past the
    minimum effect: more rounds, or a quieter machine, would settle it)."""
    if not 0 < lo <= hi:
        raise ValueError(f"an interval needs 0 < lo <= hi, got [{lo}, {hi}]")
    if lo >= MIN_EFFECT:
        return "faster"
    if hi <= 1 / MIN_EFFECT:
        return "slower"
    if lo >= 1 / MIN_EFFECT and hi <= MIN_EFFECT:
        return "no-change"
    return "inconclusive" if lo <= 1.0 <= hi else "likely-faster" if lo > 1.0 else "likely-slower"


def settle_text(lo: float, hi: float, speedup: float, rounds: int) -> str:
    """For an inconclusive interval: about how many rounds a side would exclude 1.0 (or show the fix within the
    minimum effect), by the interval's width shrinking as 1/sqrt(rounds)."""
    half = (math.log(hi) - math.log(lo)) / 2
    centre = abs(math.log(speedup)) if speedup > 0 else 0.0
    room = centre if centre > math.log(MIN_EFFECT) / 2 else math.log(MIN_EFFECT) - centre
    need = rounds * (half / room) ** 2 if room > 0 else math.inf
    if rounds < 1:
        return f"the interval {lo:.2f}-{hi:.2f}x holds 1.0: more interleaved rounds, on an otherwise idle machine"
    n = min(99, max(rounds + 2, math.ceil(need))) if math.isfinite(need) else 99
    return (f"the interval {lo:.2f}-{hi:.2f}x holds 1.0: about {n} interleaved rounds a side (now {rounds}), on an "
            "otherwise idle machine, would settle it")


def inconclusive_text(v: dict, again: str = "measure again with more --rounds") -> str:
    """A measurement whose rounds disagree wildly (`_rounds`), in words: no speed-up is claimed from it."""
    ratios = ", ".join(f"{r:.2f}" for r in v.get("ratios") or [])
    return (f"inconclusive: the {len(v.get('ratios') or [])} interleaved rounds disagree (ratios {ratios}x); "
            f"no speed-up claimed, {again}")


@dataclass(frozen=True)
class Finding:
    """One problem: its rule ID, how bad it is here, the measured evidence, the fix, the gain."""

    rule: str
    severity: str  # "high" | "medium" | "low"; from a rule: the most it can be (`registry.settle` decides)
    evidence: str
    fix: str
    est_gain: float | None
    measured_gain: float | None = None
    patch: str | None = None          # the `--fix` source patch for this finding (`_patch_base.PATCHES`)
    patch_args: dict | None = None    # what the patch needs: {"workers": 0}, {"threads": 1}, ...
    # what the gain rests on: "measured" (the fix timed on this script: --verify, --fix, an environment
    # re-run), "timed" (the time the fix removes was timed directly, e.g. the data wait) or "estimated"
    basis: str = "estimated"
    # a measured gain's 95% bootstrap interval (`_interval`); a timed one's spread, where the rule gives one
    interval: tuple[float, float] | None = None
    also: tuple["Finding", ...] = ()  # findings of other rules with the same cause, folded into this one
    inconclusive: str | None = None  # the measured interval holds 1.0: what would settle it (listed apart)
    ceiling: float | None = None  # the most the fix can gain, from the measured share it removes (`rules._ceiling`)

    def to_dict(self) -> dict:
        return {"rule": self.rule, "severity": self.severity, "evidence": self.evidence, "fix": self.fix,
                "est_gain": self.est_gain, "measured_gain": self.measured_gain, "patch": self.patch,
                "basis": self.basis, "interval": list(self.interval) if self.interval else None,
                "inconclusive": self.inconclusive, "ceiling": self.ceiling, "also": [{"rule": f.rule, "fix": f.fix, "est_gain": f.est_gain,
                                               "measured_gain": f.measured_gain, "basis": f.basis} for f in self.also]}


@dataclass(frozen=True)
class DoctorReport:
    script: str
    status: str  # stopped | finished | exited | raised | timeout | interrupted | killed
    traceback: str | None
    env: Environment
    breakdown: Breakdown
    findings: tuple[Finding, ...]
    verify: dict[str, VerifyResult] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    observation: Observation = field(default_factory=dict, repr=False)
    fix: dict = field(default_factory=dict)  # `--fix`: {"patches": [...], "end_to_end_speedup": ...}

    @property
    def rules(self) -> set[str]:
        """Every rule that fired, also those folded into another finding of the same cause."""
        return {f.rule for f in self.findings} | {a.rule for f in self.findings for a in f.also}

    def finding(self, rule: str) -> Finding | None:
        return next((f for f in self.findings if f.rule == rule), None)

    def to_dict(self) -> dict:
        return {"breakdown": self.breakdown, "findings": [f.to_dict() for f in self.findings],
                "script": self.script, "status": self.status, "traceback": self.traceback, "env": self.env,
                "verify": list(self.verify.values()), "notes": list(self.notes),
                "steps_observed": self.observation.get("steps_observed", 0),
                "memory": self.observation.get("memory", {}), "observation": self.observation,
                "verdict": report_verdict(self),
                **({"fix": self.fix} if self.fix else {})}

    def write_json(self, path: str) -> None:
        """Write `to_dict()` atomically (a temp file renamed into place)."""
        write_json(path, self.to_dict())


def _fix_rows(report: "DoctorReport") -> list[dict]:
    """Each measured fix (--verify's, the environment re-runs') with its interval, rounds, loss check, verdict."""
    rows = []
    for where, entries in (("verify", report.verify), ("rerun", report.observation.get("env_fixes") or {})):
        for v in entries.values():
            row = {"fix": v.get("fix"), "rule": v.get("rule"), "measured_by": where, "rounds": v.get("rounds"),
                   "speedup": v.get("speedup"), "interval": v.get("interval"), "loss_check": v.get("loss_check")}
            if v.get("ceiling") is not None:
                row["ceiling"] = v["ceiling"]
            if v.get("error"):
                row["verdict"] = "error"
                row["error"] = v["error"]
            elif v.get("skipped"):  # its bound is under the minimum effect (`rules._ceiling`): not run
                row.update(verdict="not-run", skipped=v["skipped"])
            elif v.get("inconclusive"):  # rounds that disagree wildly (`_rounds`): no figure is claimed
                row.update(verdict="inconclusive", speedup=None, interval=None, wild=True)
            elif v.get("interval"):
                row["verdict"] = interval_verdict(*v["interval"])
            else:
                row["verdict"] = "not-measured"
            rows.append(row)
    return rows


def report_verdict(report: "DoctorReport") -> dict:
    """The run's verdict a CI job can read: "error" (the script did not run to its steps), "regression" (a
    measured fix's interval clears the medium threshold at its lower bound: the script runs measurably slower
    than it would with that fix), "inconclusive" (no such fix, but a measured interval holds 1.0), "pass"."""
    found = [g for f in report.findings for g in (f, *f.also)]
    regressions = [f.rule for f in report.findings if f.basis == "measured" and f.severity in ("high", "medium")]
    rows = _fix_rows(report)
    open_ = sorted({f.rule for f in found if f.inconclusive}
                   | {r["rule"] or r["fix"] for r in rows if r["verdict"] == "inconclusive"})
    if report.status not in ("stopped", "finished"):
        word = "error"
    else:
        word = "regression" if regressions else "inconclusive" if open_ else "pass"
    return {"verdict": word, "regressions": regressions, "inconclusive": open_, "fixes": rows,
            "thresholds": {"high": HIGH_GAIN, "medium": MEDIUM_GAIN, "min_effect": MIN_EFFECT}}


def exit_code(report: "DoctorReport", *, fail_on_regression: bool = False) -> int:
    """1 when the script raised, exited with an error or was killed; `REGRESSION_EXIT` when
    `fail_on_regression` and the verdict is "regression"; else 0."""
    if report.status in ("raised", "exited", "killed", "doctor-error"):
        return 1
    return REGRESSION_EXIT if fail_on_regression and report_verdict(report)["verdict"] == "regression" else 0
