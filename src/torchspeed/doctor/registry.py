"""The rule registry: one rule per file under `torchspeed.doctor.rules`, each registered here.

A rule is a pure function of the observation (the JSON-ready dict the probe recorded: the
step-time breakdown, what the model and the DataLoader look like, and `--verify`'s
measurements). It returns a `Finding` or None. Tests loop over `RULES`, so a new rule is
covered by adding one file and one `@register` line.

Severity follows the measured (or, without `--verify`, estimated) gain on this machine:
>= 1.25x is high, >= 1.08x medium, anything less low. A host sync costs microseconds on a
CPU and a whole pipeline drain on CUDA, so the same code gets different severities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchspeed.doctor.report import Finding

__all__ = ["Rule", "RULES", "RULE_IDS", "register", "run_rules", "severity_for_gain", "HIGH_GAIN", "MEDIUM_GAIN"]

# The stable rule IDs, in the order the report lists ties.
RULE_IDS = (
    "data-bound", "dataloader-workers", "pin-memory", "slow-jpeg-decode", "tensor-copy", "host-sync", "no-amp",
    "channels-last", "cudnn-benchmark", "zero-grad-memset", "eval-grad-enabled", "conv-bias-before-bn",
    "data-parallel", "size-not-multiple-of-8", "unused-parameters", "small-batch", "model-design",
    "input-not-normalized",
)
HIGH_GAIN, MEDIUM_GAIN = 1.25, 1.08
_SEVERITY_ORDER = {"high": 0, "medium": 1, "low": 2}


@dataclass(frozen=True)
class Rule:
    id: str
    techniques: tuple[str, ...]
    summary: str
    check: Callable[[dict], Finding | None]


RULES: dict[str, Rule] = {}


def register(rule_id: str, *, techniques: tuple[str, ...], summary: str):
    """Decorator: add a check function to `RULES` under a stable ID."""
    if rule_id not in RULE_IDS:
        raise ValueError(f"unknown rule id {rule_id!r}: add it to RULE_IDS first")

    def deco(fn):
        RULES[rule_id] = Rule(rule_id, techniques, summary, fn)
        return fn
    return deco


def severity_for_gain(gain: float | None) -> str:
    if gain is None:
        return "low"
    if gain >= HIGH_GAIN:
        return "high"
    if gain >= MEDIUM_GAIN:
        return "medium"
    return "low"


def run_rules(obs: dict) -> list[Finding]:
    """Every registered rule on one observation, ranked: severity, then gain."""
    import torchspeed.doctor.rules  # noqa: F401  (registers the rules)

    found = []
    for rule_id in RULE_IDS:
        rule = RULES.get(rule_id)
        if rule is None:
            continue
        f = rule.check(obs)
        if f is not None:
            found.append(f)
    order = {r: i for i, r in enumerate(RULE_IDS)}
    found.sort(key=lambda f: (_SEVERITY_ORDER[f.severity], -(f.measured_gain or f.est_gain or 0.0), order[f.rule]))
    return found
