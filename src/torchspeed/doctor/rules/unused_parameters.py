"""`unused-parameters`: layers created but never used by forward (T37)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding

MEDIUM_FRACTION = 0.2


@register("unused-parameters", priority=150, techniques=("T37",), summary="parameters that never receive a gradient",
          per_step=False)
def check(obs: Observation):
    m = obs.get("model", {})
    unused = m.get("unused_params") or []
    never = m.get("never_called_modules") or []
    if not unused and not never:
        return None
    f = m.get("unused_param_fraction", 0.0)
    parts = []
    if unused:
        parts.append(f"{m.get('unused_param_count', len(unused))} parameter tensors get no gradient "
                     f"({f:.0%} of the model's values): {', '.join(unused[:5])}")
    if never:
        parts.append(f"modules never called by forward: {', '.join(never[:5])}")
    evidence = "; ".join(parts) + " (they are initialised, stored, moved and passed to the optimizer anyway)"
    fix = ("delete the layers forward does not use (or create them only when used); with DDP this also avoids "
           "find_unused_parameters=True (T37)")
    return finding("unused-parameters", evidence=evidence, fix=fix, est_gain=None, obs=obs,
                   severity="medium" if f >= MEDIUM_FRACTION else "low")
