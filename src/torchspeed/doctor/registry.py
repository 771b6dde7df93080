"""The rule registry (T02): one rule per file under `torchspeed.doctor.rules`, registered with `@register`.

A rule is a pure function of the observation (`observation.Observation`: the step-time breakdown,
what the model and the DataLoader look like, the kernel shares, `--verify`'s measurements). It
returns a `Finding` or None. Registration alone defines the rule set and its order: `priority`
orders ties in the report, `fix` names the change `--verify` measures and `--fix` writes for it.
There is no list of rule IDs to keep in step: `rule_ids()` and `fix_rules()` are read from the
registrations, and a file in the rules folder that registers nothing is an error, not a skip.

Severity follows the measured (or, without `--verify`, estimated) gain on this machine:
>= 1.25x is high, >= 1.08x medium, anything less low. A host sync costs microseconds on a
CPU and a whole pipeline drain on CUDA, so the same code gets different severities.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass

from torchspeed.doctor.report import Finding

__all__ = ["Rule", "RULES", "RuleError", "register", "load_rules", "rule_ids", "fix_rules", "run_rules", "severity_for_gain",
           "HIGH_GAIN", "MEDIUM_GAIN"]

HIGH_GAIN, MEDIUM_GAIN = 1.25, 1.08
_SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}
_ID = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


class RuleError(ValueError):
    """A rule file or registration that breaks the registry's contract."""


@dataclass(frozen=True)
class Rule:
    id: str
    priority: int
    techniques: tuple[str, ...]
    summary: str
    check: Callable[[dict], Finding | None]
    fix: str | None  # the fix --verify measures and --fix writes for this rule (shared names allowed)
    module: str


RULES: dict[str, Rule] = {}


def register(rule_id: str, *, priority: int, techniques: tuple[str, ...], summary: str, fix: str | None = None):
    """Decorator: add a check function to `RULES` under a stable kebab-case ID.

    `priority` (unique) orders rules of equal severity and gain in the report; lower first.
    """
    if not _ID.match(rule_id):
        raise RuleError(f"rule id {rule_id!r} is not kebab-case (e.g. 'data-bound')")

    def deco(fn):
        old = RULES.get(rule_id)
        if old is not None and old.module != fn.__module__:
            raise RuleError(f"rule {rule_id!r} is registered twice: in {old.module} and {fn.__module__}")
        clash = next((r for r in RULES.values() if r.priority == priority and r.id != rule_id), None)
        if clash is not None:
            raise RuleError(f"rules {clash.id!r} and {rule_id!r} both have priority {priority}: pick another")
        RULES[rule_id] = Rule(rule_id, priority, tuple(techniques), summary, fn, fix, fn.__module__)
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


def run_rules(obs: dict) -> list[Finding]:
    """Every registered rule on one observation, ranked: severity, then gain, then priority."""
    order = {rid: i for i, rid in enumerate(rule_ids())}
    found = [f for rid in order if (f := RULES[rid].check(obs)) is not None]
    found.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], -(f.measured_gain or f.est_gain or 0.0), order[f.rule]))
    return found
