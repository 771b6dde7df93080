"""The doctor's report printed with rich (T01, T02): the machine and the run, the step-time breakdown, memory, the
ranked findings, --verify's measurements, fit's plan, the environment fixes, --fix, the notes and the verdict,
one section after another. The report's data and its verdict live in `report.py`.
"""

from __future__ import annotations

from torchspeed.doctor.report import DoctorReport, gain_text, inconclusive_text, report_verdict

__all__ = ["render_report"]


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
        if "error" in v or "skipped" in v:
            t.add_row(v["fix"], "-", "-", "-", v.get("error") or v["skipped"])
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
        if "error" in e or "skipped" in e:
            t.add_row(env, "-", "-", "-", e.get("error") or e["skipped"])
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
