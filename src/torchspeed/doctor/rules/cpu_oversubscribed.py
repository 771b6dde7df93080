"""`cpu-oversubscribed`: DataLoader workers plus the model's intra-op threads exceed the usable cores (T45).

Each worker process decodes and augments on the same cores where the model's OpenMP threads run,
so both slow down. The evidence is measured: the model's compute time per step in the script
against the same step (a copy of the model, the captured batch) with nothing else running. The
fix is a worker and thread count chosen by measuring (`--verify` runs the tuner, fewer and more).
Without `--verify`, the plain run measures the thread count the fix names (OMP_NUM_THREADS = cores -
workers) by re-running a few steps of the script with it (`_envfix`, "threads").
The workers must do enough work to explain the slow-down: at least a quarter of the compute time
lost per step (`dataset[i]` x batch size); otherwise the slow-down is the rest of the machine's load.
"""

from torchspeed.doctor.registry import register
from torchspeed.doctor.rules._common import env_measured, finding, saving_gain, step_ms

RATIO = 1.15  # compute in the script / compute alone worth reporting
EXPLAINS = 0.25  # the workers' CPU work per step must be at least this share of the compute time lost


@register("cpu-oversubscribed", priority=15, techniques=("T45", "T06"),
          summary="workers + intra-op threads exceed the cores and slow the model's compute", fix="workers",
          cause="cpu-contention")
def check(obs: dict):
    c = obs.get("cpu") or {}
    workers, threads, cores = c.get("workers", 0), c.get("threads", 1), c.get("cores", 1)
    alone, inside = c.get("compute_ms_alone"), c.get("compute_ms_in_script", 0.0)
    if workers == 0 or workers + threads <= cores:
        return None
    work = c.get("worker_ms_per_batch", 0.0)
    slowed = bool(alone) and inside >= RATIO * alone and work >= EXPLAINS * (inside - alone)
    env = env_measured(obs, "threads")
    if not slowed and not (env and env["speedup"] > 1.0 and not env.get("within_noise")):
        return None  # no slow-down the workers explain (idle workers cannot cost this much), none measured
    evidence = f"{workers} DataLoader workers + {threads} intra-op threads on {cores} usable cores"
    if slowed:
        evidence += (f": the model's step takes {inside:.2f} ms of compute in the script but {alone:.2f} ms alone "
                     f"({inside / alone:.2f}x slower while the workers run; they do {work:.1f} ms of CPU work per "
                     "batch)")
    n = max(1, cores - workers)
    fix = (f"keep workers + threads within the {cores} cores: torch.set_num_threads({n}) (or OMP_NUM_THREADS={n}) "
           f"with num_workers={workers}, or fewer workers (num_workers=0 when the data is cheap to load); measure "
           "both with `torchspeed doctor --verify` or `torchspeed tune` (T45, T06)")
    est = saving_gain(step_ms(obs), inside - alone) if slowed else None
    return finding("cpu-oversubscribed", evidence=evidence, fix=fix, est_gain=est, obs=obs, verify_fix="workers",
                   basis="timed", patch="threads", env_fix="threads", patch_args={"threads": n})
