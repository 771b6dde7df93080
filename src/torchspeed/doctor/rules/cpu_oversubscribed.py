"""`cpu-oversubscribed`: DataLoader workers plus the model's intra-op threads exceed the usable cores (T45).

Each worker process decodes and augments on the same cores where the model's OpenMP threads run,
so both slow down. The evidence is measured: the model's compute time per step in the script
against the same step (a copy of the model, the captured batch) with nothing else running, timed
once the workers have filled their queue and gone idle. Both are spreads, not one reading: the
middle half of the script's per-step compute times and of the steps timed alone. The slow-down
counts only when the script's first quartile is at least `RATIO` times the third quartile alone
(most steps in the script slower than most steps alone), and the gain's interval runs from that
low end to the high end, so the registry ranks it on the low end (`registry.settle`) and a
reading near the threshold does not flip the verdict from run to run. An "alone" timing during
which the workers still used more than `BUSY` of a core is no evidence (it was not alone).

The workers must do enough work to explain the slow-down: at least a quarter of the compute time
lost per step (`dataset[i]` x batch size); otherwise the slow-down is the rest of the machine's load.
The fix is a worker and thread count chosen by measuring (`--verify` runs the tuner, fewer and more).
Without `--verify`, the plain run measures the thread count the fix names (OMP_NUM_THREADS = cores -
workers) by re-running a few steps of the script with it (`_envfix`, "threads"); without a timed slow-down the
finding stands on that re-run alone, listed as `_common.env_listed` says (inconclusive when its interval holds 1.0).
"""

from __future__ import annotations

from dataclasses import replace

from torchspeed.doctor.observation import CpuContention, Observation
from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import env_listed, finding, saving_gain, step_ms

RATIO = 1.15  # compute in the script / compute alone worth reporting (on the low end of the spreads)
EXPLAINS = 0.25  # the workers' CPU work per step must be at least this share of the compute time lost
BUSY = 0.25  # workers using more than this share of a core while the model was timed alone: not alone


def slow_down(c: CpuContention) -> dict | None:
    """The timed slow-down, or None: {"ratio": (low, median), "lost_ms": (low, median, high)}.

    Low end: the script's first quartile against the third quartile alone; high end the other way round."""
    alone, inside = c.get("compute_ms_alone"), float(c.get("compute_ms_in_script") or 0.0)
    if not alone or (c.get("workers_busy_during_alone") or 0.0) > BUSY:
        return None
    in_lo, in_hi = c.get("compute_ms_in_script_iqr") or (inside, inside)
    al_lo, al_hi = c.get("compute_ms_alone_iqr") or (alone, alone)
    return {"ratio": (in_lo / max(al_hi, 1e-9), inside / alone),
            "lost_ms": (in_lo - al_hi, inside - alone, in_hi - al_lo)}


@register("cpu-oversubscribed", priority=15, techniques=("T45", "T06"),
          summary="workers + intra-op threads exceed the cores and slow the model's compute", fix="workers",
          cause="cpu-contention")
def check(obs: Observation):
    c = obs.get("cpu") or {}
    workers, threads, cores = c.get("workers", 0), c.get("threads", 1), c.get("cores", 1)
    if workers == 0 or workers + threads <= cores:
        return None
    work = c.get("worker_ms_per_batch", 0.0)
    s = slow_down(c)
    slowed = s is not None and s["ratio"][0] >= RATIO and work >= EXPLAINS * s["lost_ms"][1]
    if not slowed and env_listed(obs, "threads") is None:
        return None  # no slow-down the workers explain (idle workers cannot cost this much), none measured
    evidence = f"{workers} DataLoader workers + {threads} intra-op threads on {cores} usable cores"
    interval = None
    est = None
    if slowed:
        inside, alone = c["compute_ms_in_script"], c["compute_ms_alone"]
        lo, hi = c.get("compute_ms_in_script_iqr") or (inside, inside), c.get("compute_ms_alone_iqr") or (alone, alone)
        evidence += (f": the model's step takes {inside:.2f} ms of compute in the script (middle half of the steps "
                     f"{lo[0]:.2f}-{lo[1]:.2f}) but {alone:.2f} ms alone ({hi[0]:.2f}-{hi[1]:.2f}): at least "
                     f"{s['ratio'][0]:.2f}x slower while the workers run; they do {work:.1f} ms of CPU work per batch")
        step = step_ms(obs)
        est = saving_gain(step, s["lost_ms"][1])
        interval = (saving_gain(step, s["lost_ms"][0]), saving_gain(step, s["lost_ms"][2]))
    n = max(1, cores - workers)
    fix = (f"keep workers + threads within the {cores} cores: torch.set_num_threads({n}) (or OMP_NUM_THREADS={n}) "
           f"with num_workers={workers}, or fewer workers (num_workers=0 when the data is cheap to load); measure "
           "both with `torchspeed doctor --verify` or `torchspeed tune` (T45, T06)")
    f = finding("cpu-oversubscribed", evidence=evidence, fix=fix, est_gain=est, obs=obs, verify_fix="workers",
                basis="timed", patch="threads", env_fix="threads", patch_args={"threads": n})
    if f.basis == "timed" and interval is not None:  # a measurement of the fix carries its own interval
        f = replace(f, interval=(round(interval[0], 4), round(interval[1], 4)))
    return f
