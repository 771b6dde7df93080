"""`debug-mode-on`: anomaly detection, the autograd profiler or deterministic algorithms left on in training (T02).

Anomaly detection records a traceback for every autograd node and checks every backward output for
NaN; the profiler records every operator; deterministic algorithms swap fast kernels for
reproducible ones (on CUDA mostly). All are debugging switches, read from the running script.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, on_cuda

# Typical cost of each switch on a training step; the report says these are estimates.
EST = {"anomaly_detection": 1.3, "profiler": 1.15, "deterministic": 1.0}
FIX = {"anomaly_detection": "remove torch.autograd.set_detect_anomaly(True) / detect_anomaly() from training runs "
                            "(turn it on only to find where a NaN comes from)",
       "profiler": "profile a few steps with a schedule (torch.profiler.schedule(wait=1, warmup=1, active=3)) "
                   "instead of the whole run",
       "deterministic": "torch.use_deterministic_algorithms(False) unless bitwise reproducibility is required"}


@register("debug-mode-on", priority=5, techniques=("T02",), summary="debugging switches left on in a training run",
          per_step=False)
def check(obs: Observation):
    d = obs.get("debug") or {}
    on = [k for k in ("anomaly_detection", "profiler", "deterministic") if d.get(k)]
    if not on:
        return None
    est = 1.0
    for k in on:
        est *= 1.1 if (k == "deterministic" and on_cuda(obs)) else EST[k]
    evidence = "left on while training: " + ", ".join(on).replace("_", " ")
    sev = "high" if "anomaly_detection" in on else "medium" if "profiler" in on else "low"
    return finding("debug-mode-on", evidence=evidence, fix="; ".join(FIX[k] for k in on), est_gain=est, obs=obs,
                   severity=sev, patch="debug_off" if set(on) & {"anomaly_detection", "deterministic"} else None)
