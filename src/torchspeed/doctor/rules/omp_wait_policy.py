"""`omp-wait-policy`: idle OpenMP threads spin on the cores the DataLoader workers need (T45).

Between parallel regions the intra-op OpenMP threads busy-wait for the next one (the default
policy), taking CPU time from the worker processes that decode and collate the next batch.
OMP_WAIT_POLICY=PASSIVE makes them sleep instead. Whether that helps depends on the script (a
step made of many short parallel regions can lose), so the rule reports only what was measured:
the plain run re-runs a few steps of the script with the variable set, interleaved with the
original (`_envfix`, "omp_passive"), and the finding appears only on that measurement: ranked on its interval
when it clears the minimum effect, listed apart as inconclusive (low) when the interval holds 1.0 or the rounds
disagree wildly, low with the measurement when it settles no change, and absent only when it settles a loss
(`_common.env_listed`). So a policy that gains nothing reads the same on every run.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import env_listed, finding


@register("omp-wait-policy", priority=16, techniques=("T45",),
          summary="OpenMP threads spin-wait on cores the DataLoader workers need", cause="cpu-contention")
def check(obs: Observation):
    if env_listed(obs, "omp_passive") is None:
        return None
    c = obs.get("cpu") or {}
    evidence = (f"{c.get('workers', '?')} DataLoader workers beside {c.get('threads', '?')} intra-op OpenMP threads "
                f"on {c.get('cores', '?')} usable cores; idle OpenMP threads spin (the default wait policy)")
    fix = ("OMP_WAIT_POLICY=PASSIVE python train.py (set before torch starts: in the shell or the job's "
           "environment, not from the running script) (T45)")
    return finding("omp-wait-policy", evidence=evidence, fix=fix, est_gain=None, obs=obs, env_fix="omp_passive")
