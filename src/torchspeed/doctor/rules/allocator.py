"""`allocator`: glibc malloc hands each step's large blocks back to the kernel and faults them in again (T44).

Above its mmap threshold glibc serves a block with a fresh mmap and unmaps it on free, so every
step's activations come back as new pages the kernel must fault in and zero. The probe counts the
minor page faults per step; tcmalloc/jemalloc, or glibc with a fixed mmap threshold and a high trim
threshold (`torchspeed.env.GLIBC_MALLOC_ENV`, what the bench uses), keep those blocks for reuse. The estimate (faults x an assumed cost) is at most low; the plain run
measures the glibc settings by re-running a few steps of the script with them (`_envfix`, "malloc"),
and the finding is ranked on that measurement.

The trigger is the churn (`churn`): glibc with its default thresholds on the CPU and at least `FAULTS` faults a
step (the mean over the timed steps: their cost adds up). Whether the fix is re-run is the ceiling's call
(`_ceiling`: every fault at its upper-bound cost against the step, `_envfix`): where it cannot clear the 2% minimum
effect the finding is listed low, unmeasured, with the bound and why it was not run. The count and the step move
between processes of one script (glibc's dynamic mmap threshold settles differently in each): the gallery's
`oversubscribed` loader read 1,366, 2,622, 4,493 and 6,183 faults a step in four processes, ceilings of 0.6-2.5%
of its 490 ms step, and when the ceiling gated the listing its finding came (low) and went; the count's line, 2.7x
under its lowest reading, does not move across it. A script under `FAULTS` (23 of the gallery's 29 scripts read
0-60) is not reported.
"""

from __future__ import annotations

from torchspeed.doctor.observation import Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import finding, on_cuda, saving_gain, step_ms

FAULTS = 500        # minor page faults per step (2 MiB of pages) worth reporting
US_PER_FAULT = 0.7  # a fault plus zeroing a 4 KiB page, in microseconds


def churn(obs: Observation) -> bool:
    """glibc malloc on the CPU with at least `FAULTS` page faults a step (re-run only where their ceiling clears
    the minimum effect: `_envfix`, `_ceiling.below_minimum`)."""
    faults = (obs.get("breakdown") or {}).get("minor_faults_per_step", 0.0)
    return not on_cuda(obs) and (obs.get("env") or {}).get("allocator") == "glibc" and faults >= FAULTS


@register("allocator", priority=95, techniques=("T44",), summary="glibc malloc with page-fault churn every step")
def check(obs: Observation):
    env = obs.get("env") or {}
    faults = (obs.get("breakdown") or {}).get("minor_faults_per_step", 0.0)
    if not churn(obs):
        return None
    step = step_ms(obs)
    saved = faults * US_PER_FAULT / 1e3
    evidence = (f"{faults:,.0f} minor page faults per step with glibc malloc (about {saved:.1f} ms of "
                f"{step:.1f} ms at ~{US_PER_FAULT} us each): large blocks are unmapped on free and faulted in again")
    tcm = env.get("tcmalloc_path")
    fix = ((f"LD_PRELOAD={tcm} python train.py (tcmalloc), or " if tcm else "tcmalloc (`apt-get install "
            "libtcmalloc-minimal4`, then LD_PRELOAD=libtcmalloc_minimal.so.4) or jemalloc, or ")
           + "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 python train.py (glibc keeps the "
           "blocks; torchspeed bench and train use these) (T44)")
    return finding("allocator", evidence=evidence, fix=fix, est_gain=saving_gain(step, saved), obs=obs,
                   env_fix="malloc")
