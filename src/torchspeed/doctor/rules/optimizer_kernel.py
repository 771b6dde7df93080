"""`optimizer-kernel`: Adam/AdamW/SGD/Adagrad stepped without the fused kernel torch has for this device (T51).

Without `fused=True` torch steps the parameters with its multi-tensor (foreach) path, or one tensor at a
time (`foreach=False`): several passes over every parameter and optimizer state. The fused kernel does
one pass. Scripts often ask for it only on CUDA (`use_fused = fused_available and device_type == "cuda"`)
although torch has it on CPU as well. The optimizer's share of the step is timed by the probe; the gain
of the fused kernel is measured by `--verify` (the captured model and optimizer stepped with fused=True
against the script's own, interleaved) and by `--fix` (the script run with `fused=True`). Unmeasured, the finding
appears where its estimate reaches the doctor's minimum effect (`report.MIN_EFFECT`: an optimizer share of about
6%); when fit's plan (`_fit_plan`) chooses the fused kernel, whatever the share.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.report import MIN_EFFECT
from torchspeed.doctor.rules._common import amdahl, finding, in_plan, step_ms

FUSED = 1.5    # assumed speed-up of the optimizer step once fused (an estimate: --verify measures it)
# the optimizer's share of the step worth reporting without a measurement: where the estimate reaches the doctor's
# minimum effect (a share near a lower line flipped the finding between runs of the same script)
SHARE = (1 - 1 / MIN_EFFECT) / (1 - 1 / FUSED)


@register("optimizer-kernel", priority=65, techniques=("T51",),
          summary="optimizer stepped without torch's fused kernel for this device", fix="fused_optimizer")
def check(obs: Observation):
    o = obs.get("optimizer") or {}
    if not o.get("fused_available") or o.get("fused"):
        return None
    opt_ms = float(((obs.get("breakdown") or {}).get("compute_detail_ms") or {}).get("optimizer", 0.0))
    step = step_ms(obs)
    share = opt_ms / step if step else 0.0
    measured = (obs.get("verify") or {}).get("fused_optimizer")
    if share < SHARE and not measured and not in_plan(obs, "fused_optimizer"):
        return None
    path = {True: "the foreach (multi-tensor) path", False: "one tensor at a time (foreach=False)"}.get(
        o.get("foreach"), "the default foreach path")
    evidence = (f"{o['class']} steps {o.get('param_tensors', '?')} parameter tensors on {o.get('device', 'cpu')} "
                f"with {path}: the optimizer takes {opt_ms:.2f} ms of the {step:.2f} ms step ({share:.0%}); torch "
                f"has a fused {o['class']} kernel for {o.get('device', 'cpu')} (one pass over parameters and state)")
    fix = (f"torch.optim.{o['class']}(..., fused=True) (without foreach=); a script that asks for it only on CUDA "
           "(`use_fused = fused_available and device_type == 'cuda'`) can ask on CPU too; torchspeed's "
           "create_optimizer(fused='auto') does (T51)")
    return finding("optimizer-kernel", evidence=evidence, fix=fix, est_gain=amdahl(share, FUSED), obs=obs,
                   verify_fix="fused_optimizer", patch="fused_optimizer")
