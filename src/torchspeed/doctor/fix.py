"""`--fix`: write each applicable finding as a patch of the user's script and measure it on that script (T43).

For every finding whose rule names a source patch (`Finding.patch`, see `_patches`), the doctor
writes the patched script, runs it in place of the original (same path, folder, arguments and
`__file__`; the patched text lives only in a scratch folder) for the same bounded number of steps,
interleaved with the original: round 1 runs the original then every patched version, round 2
again, and so on. A patch's speed-up is the median over rounds of (original step time / patched
step time), each from the trimmed mean of the run's steps. Patches that measure slower, or whose
script fails, are reported and left out; the others are combined into one script, which is
measured end to end against the original the same way (`end_to_end_speedup`). The user's files
are written only with `apply=True`; nothing is left in their folder otherwise.

Example:
    >>> report = diagnose("train.py", steps=20)
    >>> result = fix_script(report, args=[], steps=20, rounds=3)
    >>> [(p["rule"], p["speedup"], p["kept"]) for p in result["patches"]]
"""

from __future__ import annotations

import difflib
import os
import statistics
from collections.abc import Sequence

from torchspeed.doctor import _patches  # noqa: F401  (registers every patch)
from torchspeed.doctor._patch_base import NotApplicable, PatchContext, apply_patch, libcst_missing, with_torch_imported
from torchspeed.doctor.diagnose import DoctorJob, diagnose_many, measure_variants
from torchspeed.doctor.report import DoctorReport

__all__ = ["FixError", "fix_script", "plan_patches", "unified_diff"]


class FixError(RuntimeError):
    """--fix cannot run (libcst missing, the script could not be diagnosed)."""


def unified_diff(before: str, after: str, path: str) -> str:
    name = os.path.basename(path)
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{name}", f"b/{name}"))


def plan_patches(report: DoctorReport, source: str) -> tuple[list[dict], list[dict]]:
    """(candidates, skipped): one patched source per patch name, from the findings in rank order."""
    obs = report.observation
    device = "cuda" if str((obs.get("model") or {}).get("device", "cpu")).startswith("cuda") else "cpu"
    candidates, skipped, seen = [], [], set()
    for f in (g for f in report.findings for g in (f, *f.also)):  # a cause's other fixes are measured too
        if not f.patch or f.patch in seen:
            continue
        seen.add(f.patch)
        args = dict(f.patch_args or {})
        ctx = PatchContext(device=device, workers=int(args.get("workers", 0)), threads=int(args.get("threads", 1)),
                           pin_memory=bool(args.get("pin_memory", False)))
        try:
            patched = with_torch_imported(apply_patch(f.patch, source, ctx), source)
            compile(patched, report.script, "exec")
        except NotApplicable as e:
            skipped.append({"rule": f.rule, "patch": f.patch, "reason": str(e)})
            continue
        except SyntaxError as e:  # a patch this script's form does not take: skipped, the rest go on
            skipped.append({"rule": f.rule, "patch": f.patch, "reason": f"the patched script would not compile "
                            f"({e.msg}, line {e.lineno}): left for a change by hand"})
            continue
        candidates.append({"rule": f.rule, "patch": f.patch, "ctx": ctx, "source": patched,
                           "diff": unified_diff(source, patched, report.script)})
    return candidates, skipped


_measure = measure_variants  # fix_script's runner (tests inject measurements here)


def fix_script(report: DoctorReport, *, args: Sequence[str] = (), steps: int = 20, warmup: int = 5, rounds: int = 3,
               time_limit: float = 300.0, apply: bool = False, threads: int | None = None) -> dict:
    """Patch, measure and (with `apply`) write the user's script; return the `fix` section of the report."""
    hint = libcst_missing()
    if hint:
        raise FixError(hint)
    if report.status not in ("stopped", "finished"):
        raise FixError(f"the script did not run to its step limit under the doctor ({report.status}): fix it first")
    script = os.path.abspath(report.script)
    with open(script) as f:
        source = f.read()
    candidates, skipped = plan_patches(report, source)
    result: dict = {"patches": [], "skipped": skipped, "end_to_end_speedup": None, "combined_diff": "",
                    "applied": False, "rounds": rounds, "steps": steps, "warmup": warmup}
    if not candidates:
        return result
    kw = {"steps": steps, "warmup": warmup, "rounds": rounds, "time_limit": time_limit, "threads": threads}
    measured = _measure(script, args, [None] + [c["source"] for c in candidates], **kw)
    result["original_ms"] = measured[0]["ms"]
    combined, kept = source, []
    for c, m in zip(candidates, measured[1:]):
        entry = {"rule": c["rule"], "patch": c["patch"], "diff": c["diff"], "speedup": m["speedup"],
                 "ratios": m["ratios"], "patched_ms": m["ms"], "kept": False}
        if m["error"]:
            entry["error"] = m["error"]
        elif m["speedup"] is not None and m["speedup"] > 1.0:
            try:  # on top of the patches kept so far (two patches may touch the same line)
                combined = apply_patch(c["patch"], combined, c["ctx"])
                entry["kept"] = True
                kept.append(c["patch"])
            except NotApplicable as e:
                entry["error"] = f"does not combine with the patches kept before it: {e}"
        result["patches"].append(entry)
    if kept:
        e2e = _measure(script, args, [None, combined], **kw)[1]
        result["end_to_end_speedup"] = e2e["speedup"]
        result["end_to_end_ratios"] = e2e["ratios"]
        result["combined_diff"] = unified_diff(source, combined, script)
        result["kept"] = kept
        if e2e["error"]:
            result["end_to_end_error"] = e2e["error"]
        if apply and e2e["speedup"] and e2e["speedup"] > 1.0:
            with open(script, "w") as f:
                f.write(combined)
            result["applied"] = True
    return result
