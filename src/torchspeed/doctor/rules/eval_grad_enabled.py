"""`eval-grad-enabled`: evaluation builds an autograd graph nobody uses (T28)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, step_ms

SAVED = 0.3  # share of a grad-enabled forward that no_grad/inference_mode saves (graph + kept activations)


@register("eval-grad-enabled", priority=110, techniques=("T28",), summary="model.eval() forward passes with gradients enabled")
def check(obs: Observation):
    e = obs.get("eval", {})
    if not e.get("grad_calls"):
        return None
    total = step_ms(obs) * max(1, obs.get("steps_observed", 1))
    share = e["grad_ms"] / total if total else 0.0
    evidence = (f"{e['grad_calls']} forward passes in eval mode with gradients enabled ({e['grad_ms']:.1f} ms, "
                f"{share:.0%} of the training time seen): each stores activations and a graph for a backward "
                "that never comes")
    fix = ("wrap evaluation in `with torch.inference_mode():` (or torch.no_grad()); torchspeed.evaluate does this "
           "(T28)")
    est = total / max(total - SAVED * e["grad_ms"], 1e-9) if total else None
    sev = "medium" if share >= 0.10 else "low"
    return finding("eval-grad-enabled", evidence=evidence, fix=fix, est_gain=est, obs=obs, severity=sev)
