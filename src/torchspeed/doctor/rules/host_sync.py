"""`host-sync`: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `nonzero` in the loop (T13).

On CUDA each one waits until the GPU has finished all queued work, so the CPU can no longer
run ahead; on a CPU the same call costs microseconds. Severity follows that: low on CPU
unless the calls themselves are measurably slow, medium/high on CUDA.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, on_cuda, saving_gain, step_ms

PER_STEP = 0.5  # calls per optimizer step worth reporting


@register("host-sync", priority=60, techniques=("T13",), summary="host-device synchronisation in every step")
def check(obs: Observation):
    s = obs.get("syncs", {})
    if s.get("calls_per_step", 0.0) < PER_STEP:
        return None
    step = step_ms(obs)
    kinds = ", ".join(f".{k}() x{v}" for k, v in sorted(s["by_kind"].items(), key=lambda kv: -kv[1]))
    sites = ", ".join(s.get("sites", []))
    share = s["ms_per_step"] / step if step else 0.0
    evidence = (f"{s['calls_per_step']:.1f} host reads per step ({kinds}) at {sites}; they take "
                f"{s['ms_per_step']:.3f} ms per step ({share:.1%}) here")
    fix = ("keep running totals on the device (`total += loss.detach()`), read them every N steps or at the end "
           "of the epoch; avoid Python `if` on tensor values and boolean-mask indexing in the step (T13)")
    if on_cuda(obs):
        evidence += "; on CUDA each one stalls the CPU until the GPU drains its queue"
        if s.get("cuda_sync_warnings"):
            evidence += f" (CUDA sync debug mode counted {s['cuda_sync_warnings']} synchronizing calls in all)"
        sev = "high" if s["calls_per_step"] >= 5 else "medium"
        return finding("host-sync", evidence=evidence, fix=fix, est_gain=saving_gain(step, s["ms_per_step"]),
                       obs=obs, severity=sev, basis="timed")
    evidence += "; cheap on this CPU, but each one would stall the pipeline on a GPU"
    return finding("host-sync", evidence=evidence, fix=fix, est_gain=saving_gain(step, s["ms_per_step"]), obs=obs,
                   basis="timed")
