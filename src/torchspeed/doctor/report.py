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
from torchspeed.doctor.observation import Breakdown, Environment, Observation, VerifyResult

__all__ = ["Finding", "DoctorReport", "render_report", "HIGH_GAIN", "MEDIUM_GAIN", "MIN_EFFECT", "interval_verdict",
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
    way: settled), "below-min-effect" (on one side of 1.0, short of the minimum effect), "inconclusive" (it
    holds 1.0 and reaches past the minimum effect: more rounds, or a quieter machine, would settle it)."""
    if not 0 < lo <= hi:
        raise ValueError(f"an interval needs 0 < lo <= hi, got [{lo}, {hi}]")
    if lo >= MIN_EFFECT:
        return "faster"
    if hi <= 1 / MIN_EFFECT:
        return "slower"
    if lo >= 1 / MIN_EFFECT and hi <= MIN_EFFECT:
        return "no-change"
    return "inconclusive" if lo <= 1.0 <= hi else "below-min-effect"


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

    def to_dict(self) -> dict:
        return {"rule": self.rule, "severity": self.severity, "evidence": self.evidence, "fix": self.fix,
                "est_gain": self.est_gain, "measured_gain": self.measured_gain, "patch": self.patch,
                "basis": self.basis, "interval": list(self.interval) if self.interval else None,
                "inconclusive": self.inconclusive, "also": [{"rule": f.rule, "fix": f.fix, "est_gain": f.est_gain,
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
            if v.get("error"):
                row["verdict"] = "error"
                row["error"] = v["error"]
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


_STATUS = {
    "stopped": "stopped after {n} optimizer steps",
    "finished": "the script finished by itself after {n} optimizer steps",
    "exited": "the script exited with an error code after {n} optimizer steps",
    "raised": "the script raised an exception after {n} optimizer steps",
    "timeout": "stopped by the time limit after {n} optimizer steps",
    "interrupted": "interrupted after {n} optimizer steps",
    "killed": "the script's process had to be killed after {n} optimizer steps",
}


def render_report(report: DoctorReport, console=None) -> None:
    """Print the report with rich, one section after another: the machine and the run, the step-time
    breakdown, memory, the ranked findings, --verify, fit's plan, the environment fixes, --fix, notes."""
    from rich.console import Console

    console = console or Console()
    for section in (_render_run, _render_breakdown, _render_memory, _render_findings, _render_verify,
                    _render_fit_plan, _render_env_fixes, _render_fix, _render_notes, _render_verdict):
        section(report, console)


def _render_run(report: DoctorReport, console) -> None:
    """The machine (T01) and how the script's run ended, with its traceback."""
    from rich.text import Text

    e = report.env
    console.rule(f"torchspeed doctor: {report.script}")
    console.print(f"[bold]machine[/]: {e.get('device', '?')} ({e.get('device_name', '?')}), {e.get('cpu_cores', '?')} cores, "
                  f"torch {e.get('torch', '?')}, best precision here: {e.get('best_precision', '?')}, "
                  f"allocator {e.get('allocator', '?')}")
    for n in e.get("notes", []):
        console.print(f"  [yellow]env:[/] {n}")
    n = report.observation.get("steps_observed", 0)
    line = _STATUS.get(report.status, report.status).format(n=n)
    if report.observation.get("step_boundary") == "backward":  # a loop that updates its weights by hand
        line = line.replace("optimizer steps", "steps (each ends at a backward: the script makes no torch "
                                               "optimizer and updates its weights by hand)")
    console.print("[bold]run[/]: " + line)
    if report.traceback:
        console.print(Text(report.traceback.rstrip(), style="red"))


def _render_breakdown(report: DoctorReport, console) -> None:
    """The step-time breakdown (T02): a table of each part's time and share."""
    from rich.table import Table

    b = report.breakdown
    if not b.get("steps"):
        return
    out = b.get("outlier_steps", 0)
    left = f", {out} start-up outlier(s) left out: {b.get('outlier_step_ms')} ms" if out else ""
    when = ", all within warm-up: rough" if b.get("within_warmup") else " after warm-up"
    t = Table(title=f"step time: {b['step_ms']:.2f} ms (trimmed mean of {b['steps']} steps{when}{left})")
    for col in ("data wait", "copy", "compute", "sync", "other"):
        t.add_column(col, justify="right")
    keys = ("data_wait", "copy", "compute", "sync", "other")
    ms = ("data_wait_ms", "copy_ms", "compute_ms", "sync_ms", "other_ms")
    t.add_row(*[f"{b[m]:.2f} ms ({b['fractions'][k]:.0%})" for k, m in zip(keys, ms)])
    console.print(t)


def _render_memory(report: DoctorReport, console) -> None:
    """Peak memory: the process's RSS and, on CUDA, the peak allocated of the total."""
    mem = report.observation.get("memory") or {}
    if not mem:
        return
    line = f"[bold]memory[/]: peak RSS {mem.get('max_rss_mib', 0):.0f} MiB"
    if "cuda_max_allocated_mib" in mem:
        line += f", CUDA peak allocated {mem['cuda_max_allocated_mib']:.0f} of {mem['cuda_total_mib']:.0f} MiB"
    console.print(line)


def _render_findings(report: DoctorReport, console) -> None:
    """The findings, most costly first: severity, rule, gain, evidence, fix, and the folded-in fixes."""
    from rich.text import Text

    settled = [f for f in report.findings if not f.inconclusive]
    if not report.findings:
        console.print("[green]no findings[/]")
        return
    console.print("[bold]findings, most costly first[/]" if settled else "[green]no settled findings[/]")
    colors = {"high": "red", "medium": "yellow", "low": "dim"}
    for i, f in enumerate(settled, 1):
        gain = "" if f.est_gain is None else f"  est. {f.est_gain:.2f}x"
        if f.measured_gain is not None:
            gain += f", measured {f.measured_gain:.2f}x"
            if f.interval and f.basis == "measured":
                gain += f" [{f.interval[0]:.2f}-{f.interval[1]:.2f}]"
        elif f.basis == "estimated" and f.est_gain is not None:
            gain += " (estimated, not measured)"
        head = Text(f"{i:2d}. ")
        head.append(f"{f.severity.upper():6s}", style=f"bold {colors[f.severity]}")
        head.append(f" {f.rule}", style="bold")
        head.append(gain)
        console.print(head)
        console.print(Text("    evidence: " + f.evidence))
        console.print(Text("    fix:      " + f.fix, style="green"))
        for a in f.also:  # another rule's fix for the same cause
            console.print(Text(f"    or:       ({a.rule}, {gain_text(a)}) {a.fix}", style="green"))
    open_ = [f for f in report.findings if f.inconclusive]
    if open_:
        console.print("[bold]inconclusive[/] (measured, but the interval holds 1.0: no gain claimed, not ranked)")
    for f in open_:
        console.print(Text(f"  - {f.rule}: measured {f.measured_gain:.2f}x; {f.inconclusive}. Fix: {f.fix}"))


def _render_verify(report: DoctorReport, console) -> None:
    """`--verify`: each fix measured on the captured model against its interleaved baseline."""
    from rich.table import Table

    if not report.verify:
        return
    t = Table(title="--verify: each fix measured on this model, interleaved with its baseline")
    for col in ("fix", "baseline ms/step", "with fix ms/step", "speed-up", "note"):
        t.add_column(col)
    for v in report.verify.values():
        if "error" in v:
            t.add_row(v["fix"], "-", "-", "-", v["error"])
            continue
        s = v["speedup"]
        note = "slower here: not recommended on this machine" if s < 0.97 else ""
        if v.get("within_noise"):
            note = f"within noise (middle half of rounds {v['iqr'][0]:.2f}-{v['iqr'][1]:.2f}x)"
        if v.get("inconclusive"):
            note = inconclusive_text(v)
        if "compile_s" in v:
            note = (note + f" compile took {v['compile_s']} s").strip()
        t.add_row(v["fix"], f"{v['baseline_ms']:.2f}", f"{v['candidate_ms']:.2f}",
                  "inconclusive" if v.get("inconclusive") else f"{s:.2f}x", note)
    console.print(t)


def _render_fit_plan(report: DoctorReport, console) -> None:
    """What fit's plan would choose for this model, measured against the script's own settings."""
    plan = report.observation.get("fit_plan") or {}
    if not plan.get("chosen"):
        return
    head = f"[bold]fit's plan[/] for this model: {plan['chosen']} ({plan['why']}); "
    if plan.get("speedup") is None:  # the plan keeps the script's settings: nothing measured against them
        cands = ", ".join(f"{k} {r:.2f}x" for k, r in (plan.get("candidates") or {}).items())
        head += f"the script's own {plan['script']}, kept" + (
            f": no candidate gained enough to change it ({cands})" if cands else "")
    elif plan.get("inconclusive"):
        head += f"against the script's own {plan['script']}: " + inconclusive_text(plan)
    else:
        head += (f"measured {plan['speedup']:.2f}x per step against the script's own {plan['script']}"
                 + (" (within noise)" if plan.get("within_noise") else ""))
    console.print(head, highlight=False)
    for label, err in (plan.get("errors") or {}).items():
        console.print(f"  {label} could not run: {err}", highlight=False)
    rest = plan.get("beyond_grid") or {}
    if rest.get("not_covered"):
        console.print("  the plan's figure leaves out: " + "; ".join(rest["not_covered"]), highlight=False)


def _render_env_fixes(report: DoctorReport, console) -> None:
    """The environment fixes (and the workers patch), each re-run on the script against the original."""
    from rich.table import Table

    entries = (report.observation.get("env_fixes") or {}).values()
    if not entries:
        return
    t = Table(title="environment fixes (and the workers patch): a few steps of the script re-run with each, "
                    "interleaved with the original")
    for col in ("environment", "original ms/step", "with it ms/step", "speed-up", "note"):
        t.add_column(col)
    for e in entries:
        env = f"--fix patch: {e['label']}" if e.get("patch") else " ".join(f"{k}={v}" for k, v in e["env"].items())
        if "error" in e:
            t.add_row(env, "-", "-", "-", e["error"])
            continue
        note = f"within noise ({e['iqr'][0]:.2f}-{e['iqr'][1]:.2f}x)" if e.get("within_noise") else ""
        if e.get("inconclusive"):
            note = inconclusive_text(e, "run the doctor again on a quieter machine")
        ms = [f"{v:.2f}" if v else "-" for v in (e.get("baseline_ms"), e.get("candidate_ms"))]
        t.add_row(env, *ms, "inconclusive" if e.get("inconclusive") else f"{e['speedup']:.2f}x", note)
    console.print(t)


def _render_fix(report: DoctorReport, console) -> None:
    """`--fix`: each patch measured on the script, the kept ones together end to end, their diff."""
    from rich.table import Table
    from rich.text import Text

    fx = report.fix
    if not fx:
        return
    t = Table(title=f"--fix: each patch measured on the script itself ({fx['rounds']} interleaved rounds of "
                    f"{fx['steps']} steps)")
    for col in ("rule", "patch", "speed-up", "kept", "note"):
        t.add_column(col)
    for p in fx["patches"]:
        s = "-" if p["speedup"] is None else f"{p['speedup']:.2f}x"
        note = p.get("error") or ("" if p["kept"] else "slower here: left out")
        t.add_row(p["rule"], p["patch"], s, "yes" if p["kept"] else "no", note)
    for p in fx.get("skipped", []):
        t.add_row(p["rule"], p["patch"], "-", "no", f"not applied: {p['reason']}")
    console.print(t)
    if fx.get("end_to_end_speedup") is not None:
        console.print(f"[bold]all kept patches together[/]: {fx['end_to_end_speedup']:.2f}x end to end "
                      f"(ratios {fx.get('end_to_end_ratios')})")
        console.print(Text(fx["combined_diff"].rstrip()), highlight=False)
        console.print("[green]written to the script[/]" if fx.get("applied") else
                      "[dim]the script was not changed; add --apply to write these patches[/]")


def _render_notes(report: DoctorReport, console) -> None:
    """The doctor's notes: checks it skipped or that failed, and why."""
    for n in report.notes:
        console.print(f"[dim]note: {n}[/]")


def _render_verdict(report: DoctorReport, console) -> None:
    """The verdict a CI job reads (`report_verdict`), with the measured fixes' intervals."""
    v = report_verdict(report)
    for r in v["fixes"]:
        if r.get("wild"):
            console.print(f"  {r['fix']}: its {r['rounds']} rounds disagree wildly: inconclusive", highlight=False)
        if not r.get("interval"):
            continue
        lc = r.get("loss_check") or {}
        loss = "" if lc.get("ok") is None else (f", loss within {lc['tolerance']:.0%} over {lc['steps']} steps"
                                                if lc["ok"] else f", LOSS MOVED {lc['max_rel_diff']:.1%} "
                                                                 f"(tolerance {lc['tolerance']:.0%})")
        console.print(f"  {r['fix']}: {r['speedup']:.2f}x [{r['interval'][0]:.2f}-{r['interval'][1]:.2f}], "
                      f"{r['rounds']} rounds a side: {r['verdict']}{loss}", highlight=False)
    color = {"pass": "green", "regression": "red", "inconclusive": "yellow"}.get(v["verdict"], "red")
    console.print(f"[bold]verdict[/]: [{color}]{v['verdict']}[/]"
                  + (f" ({', '.join(v['regressions'])})" if v["regressions"] else ""), highlight=False)
