"""`zero-grad-memset`: `zero_grad(set_to_none=False)` writes zeros into every gradient (T26)."""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, saving_gain, step_ms


@register("zero-grad-memset", priority=100, techniques=("T26",), summary="zero_grad(set_to_none=False)", fix="set_to_none")
def check(obs: Observation):
    z = obs.get("zero_grad", {})
    if not z.get("set_to_none_false"):
        return None
    sites = ", ".join(z.get("sites", [])) or "the loop"
    step = step_ms(obs)
    evidence = (f"zero_grad(set_to_none=False) at {sites} ({z['set_to_none_false']} calls): a memset of every "
                f"gradient, {z['ms_per_call']:.3f} ms per call here, and backward then adds instead of writing")
    fix = "optimizer.zero_grad() (set_to_none=True is the default since torch 2.0) (T26)"
    return finding("zero-grad-memset", evidence=evidence, fix=fix,
                   est_gain=saving_gain(step, 0.9 * z["ms_per_call"]), obs=obs, verify_fix="set_to_none",
                   basis="timed", patch="set_to_none")
