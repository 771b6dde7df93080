"""The rule registry (T02): one rule per file under `torchspeed.doctor.rules`, registered with `@register`.

A rule is a pure function of the observation (`observation.Observation`: the step-time breakdown,
what the model and the DataLoader look like, the kernel shares, `--verify`'s measurements). It
returns a `Finding` or None. Registration alone defines the rule set and its order: `priority`
orders ties in the report, `fix` names the change `--verify` measures and `--fix` writes for it.
There is no list of rule IDs to keep in step: `rule_ids()` and `fix_rules()` are read from the
registrations, and a file in the rules folder that registers nothing is an error, not a skip.

Severity is decided here, in one place (`settle`), from what the finding's gain rests on:

- measured: the fix itself was timed on the user's script (`--verify`, `--fix`, an environment
  re-run), in randomised interleaved rounds with the original (`_interval`). The thresholds apply to the
  lower bound of the measured interval (the 95% bootstrap interval of the ratio of the medians), never to one
  reading: high when it is >= 1.25x, medium when >= 1.05x, low otherwise (`severity_for_interval`). An
  interval that holds 1.0 and reaches past the 2% minimum effect is inconclusive: ranked low, after every
  settled finding, and listed apart with what would settle it (`Finding.inconclusive`). Rounds that disagree
  by more than `WILD_SPREAD` (`is_inconclusive`; `_rounds` marks --verify's and the re-runs' measurements
  with it) are no measurement: the finding stays what it was without them;
- timed: the time the fix removes was timed directly on the script (the data wait, the memset of
  zero_grad, the copies of torch.tensor): high/medium by the same thresholds, on the low end of the
  finding's interval when the rule gives one (the compute cpu-oversubscribed loses: quartiles of the
  steps in the script against quartiles of the steps alone);
- estimated: a model of the machine (page faults x an assumed cost, a kernel share x an assumed
  speed-up): at most low, and the evidence says "estimated, not measured".

A rule's own severity is a ceiling (a host sync is cheap on a CPU whatever it measures).
A rule that reads nothing of the recorded steps says so (`per_step=False`); on a run that recorded no
step only those run. Rules may declare a `cause`: findings with the same cause (no-amp and cpu-bf16-math both point at
fp32 matmuls) are folded into the best-ranked one, which names the others (`Finding.also`).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.report import (ESTIMATED, HIGH_GAIN, MEDIUM_GAIN, Finding, gain_text, interval_verdict,
                                      settle_text)

__all__ = ["Rule", "RULES", "RuleError", "register", "load_rules", "rule_ids", "fix_rules", "run_rules", "severity_for_gain",
           "severity_for_interval", "settle", "merge_causes", "apply_fix_measurements", "with_fix", "WILD_SPREAD",
           "MIN_ROUNDS", "spread", "is_inconclusive"]

WILD_SPREAD = 2.0  # interleaved rounds that disagree by more than this (`spread`) prove nothing: inconclusive
MIN_ROUNDS = 3     # fewer rounds: every round counts in the spread; more: the median outvotes one bad round
_SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}
_BASIS_ORDER = {"measured": 0, "timed": 1, "estimated": 2}
_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


class RuleError(ValueError):
    """A rule file or registration that breaks the registry's contract."""


@dataclass(frozen=True)
class Rule:
    id: str
    priority: int
    techniques: tuple[str, ...]
    summary: str
    check: Callable[[Observation], Finding | None]
    fix: str | None  # the fix --verify measures and --fix writes for this rule (shared names allowed)
    module: str
    cause: str | None = None  # rules with the same cause report one finding between them
    per_step: bool = True  # rests on the recorded steps: not run on a run that recorded none


RULES: dict[str, Rule] = {}


def register(rule_id: str, *, priority: int, techniques: tuple[str, ...], summary: str, fix: str | None = None,
             cause: str | None = None, per_step: bool = True):
    """Decorator: add a check function to `RULES` under a stable kebab-case ID.

    `priority` (unique) orders rules of equal severity and gain in the report; lower first. The
    registered check returns its finding settled (`settle`): the rule's severity is only a ceiling.
    `per_step=False`: the rule reads nothing of the recorded steps (a debug switch, the model's layers), so it
    runs also where the script recorded no step (`run_rules`).
    """
    if not _ID.match(rule_id):
        raise RuleError(f"rule id {rule_id!r} is not kebab-case (e.g. 'data-bound')")

    def deco(fn: Callable[[Observation], Finding | None]):
        old = RULES.get(rule_id)
        if old is not None and old.module != fn.__module__:
            raise RuleError(f"rule {rule_id!r} is registered twice: in {old.module} and {fn.__module__}")
        clash = next((r for r in RULES.values() if r.priority == priority and r.id != rule_id), None)
        if clash is not None:
            raise RuleError(f"rules {clash.id!r} and {rule_id!r} both have priority {priority}: pick another")
        RULES[rule_id] = Rule(rule_id, priority, tuple(techniques), summary, _settled(fn), fix, fn.__module__, cause,
                              per_step)
        return fn
    return deco


def load_rules() -> dict[str, Rule]:
    """Import every rule file in `torchspeed.doctor.rules` and return the registry.

    Raises RuleError for a file there (not `_`-prefixed) that registers no rule.
    """
    import torchspeed.doctor.rules as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        name = f"{package.__name__}.{info.name}"
        importlib.import_module(name)
        if not any(r.module == name for r in RULES.values()):
            raise RuleError(f"{info.name}.py in the doctor's rules folder registers no rule: decorate its check "
                            "with @register(rule_id, priority=..., techniques=..., summary=...) or rename it "
                            f"_{info.name}.py if it is a helper")
    return RULES


def rule_ids() -> tuple[str, ...]:
    """Every registered rule ID, in priority order."""
    return tuple(r.id for r in sorted(load_rules().values(), key=lambda r: r.priority))


def fix_rules() -> dict[str, tuple[str, ...]]:
    """Each fix name -> the rules whose advice it proves, in priority order (the one table of fixes)."""
    out: dict[str, tuple[str, ...]] = {}
    for rid in rule_ids():
        fix = RULES[rid].fix
        if fix:
            out[fix] = out.get(fix, ()) + (rid,)
    return out


def severity_for_gain(gain: float | None) -> str:
    if gain is None:
        return "low"
    if gain >= HIGH_GAIN:
        return "high"
    if gain >= MEDIUM_GAIN:
        return "medium"
    return "low"


def severity_for_interval(lo: float, hi: float) -> str:
    """A measured gain's severity from its interval: high or medium only when the lower bound clears that
    threshold; "inconclusive" when the interval holds 1.0 and reaches past the minimum effect
    (`report.interval_verdict`): `settle` ranks that as low and lists it apart."""
    if interval_verdict(lo, hi) == "inconclusive":
        return "inconclusive"
    return severity_for_gain(lo)


def spread(ratios) -> float:
    """How far interleaved rounds disagree: their largest ratio over their smallest; with `MIN_ROUNDS` or more,
    once the highest and the lowest are set aside (the median outvotes one bad round either way)."""
    kept = sorted(ratios)
    if len(kept) >= MIN_ROUNDS:
        kept = kept[1:-1]
    return kept[-1] / kept[0] if kept[0] > 0 else float("inf")


def is_inconclusive(ratios) -> bool:
    """The rounds disagree by more than `WILD_SPREAD` times: no measurement to rank a finding on."""
    return bool(ratios) and spread(ratios) > WILD_SPREAD


def _lower(a: str, b: str) -> str:
    return a if _SEVERITY_ORDER[a] >= _SEVERITY_ORDER[b] else b


def settle(f: Finding) -> Finding:
    """The finding's severity from what its gain rests on (see the module docstring).

    A rule's own severity is a ceiling on an unmeasured finding; a measurement of the fix decides alone."""
    settle_by = None
    if f.basis == "measured" and f.measured_gain is not None:
        lo, hi = f.interval or (f.measured_gain, f.measured_gain)
        lo, hi = min(lo, f.measured_gain), max(hi, f.measured_gain)
        sev = severity_for_interval(lo, hi)
        if sev == "inconclusive":  # listed apart, with what would settle it
            sev, settle_by = "low", f.inconclusive or settle_text(lo, hi, f.measured_gain, 0)
    else:
        gain = f.est_gain
        if f.basis == "timed" and gain is not None and f.interval:  # a spread: rank on its low end
            gain = min(gain, f.interval[0])
        sev = severity_for_gain(gain) if f.basis == "timed" else "low"
        sev = _lower(sev, f.severity if f.severity in _SEVERITY_ORDER else "high")
    evidence = f.evidence
    if f.basis not in ("measured", "timed") and f.est_gain is not None and ESTIMATED not in evidence:
        evidence += f"; the gain is {ESTIMATED} (est. {f.est_gain:.2f}x)"
    return replace(f, severity=sev, evidence=evidence, inconclusive=settle_by)


def _settled(fn: Callable[[Observation], Finding | None]) -> Callable[[Observation], Finding | None]:
    @functools.wraps(fn)
    def check(obs: Observation) -> Finding | None:
        f = fn(obs)
        return settle(f) if f is not None else None
    return check


def _gain(f: Finding) -> float:
    return (f.measured_gain if f.measured_gain is not None else f.est_gain) or 0.0


def _rank_key(f: Finding, order: dict[str, int]) -> tuple:
    """Severity; then settled before inconclusive, measured before timed before estimated; then the gain (a
    measured one's lower bound); then the rule's priority."""
    gain = f.interval[0] if f.basis == "measured" and f.interval else _gain(f)
    return (_SEVERITY_ORDER[f.severity], f.inconclusive is not None, _BASIS_ORDER.get(f.basis, 2), -gain,
            order.get(f.rule, 10**6))


def merge_causes(found: list[Finding], order: dict[str, int]) -> list[Finding]:
    """One finding per cause: the best-ranked finding of each cause, the others in its `also`."""
    groups: dict[str, list[Finding]] = {}
    out = []
    for f in found:
        cause = RULES[f.rule].cause if f.rule in RULES else None
        if cause is None:
            out.append(f)
        else:
            groups.setdefault(cause, []).extend([replace(f, also=()), *f.also])
    for group in groups.values():
        group.sort(key=lambda f: _rank_key(f, order))
        out.append(replace(group[0], also=tuple(group[1:])))
    return out


def _rank(found: list[Finding]) -> list[Finding]:
    order = {rid: i for i, rid in enumerate(rule_ids())}
    found = merge_causes(found, order)
    found.sort(key=lambda f: _rank_key(f, order))
    return found


def run_rules(obs: Observation) -> list[Finding]:
    """Every registered rule on one observation, settled, one per cause, ranked: severity, gain, priority. A run
    that recorded no step (an optimizer never stepped: `steps_observed` 0) gets only the rules that do not rest
    on the step (`per_step=False`): the others would read an empty breakdown as a step of 0 ms."""
    no_steps = obs.get("steps_observed") == 0
    return _rank([f for rid in rule_ids() if not (no_steps and RULES[rid].per_step)
                  and (f := RULES[rid].check(obs)) is not None])


def _quartiles(ratios: list[float]) -> tuple[float, float]:
    if len(ratios) < 2:
        return (ratios[0], ratios[0])
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return (q[0], q[2])


def apply_fix_measurements(findings, fix: dict) -> list[Finding]:
    """Findings re-ranked with what `--fix` measured on the script itself (each patch against the original)."""
    measured = {p["patch"]: p for p in fix.get("patches", []) if p.get("speedup") is not None and p.get("ratios")
                and not is_inconclusive(p["ratios"])}  # runs that disagree wildly prove nothing (`_rounds`)
    out = []
    for f in (g for f in findings for g in (replace(f, also=()), *f.also)):
        p = measured.get(f.patch)
        if p is None or f.basis == "measured":  # --verify's interleaved measurement on the model stands
            out.append(f)
            continue
        text = (f"; --fix measured the {f.patch} patch on the script itself at {p['speedup']:.2f}x (median of "
                f"{len(p['ratios'])} interleaved runs)")
        out.append(settle(replace(f, measured_gain=float(p["speedup"]), basis="measured",
                                  interval=_quartiles(p["ratios"]),
                                  evidence=f.evidence.split(f"; the gain is {ESTIMATED}")[0] + text)))
    return _rank(out)


def with_fix(report, fix: dict):
    """`report` with `--fix`'s result attached and its findings re-ranked by what each patch measured."""
    return replace(report, fix=fix, findings=tuple(apply_fix_measurements(report.findings, fix)))
