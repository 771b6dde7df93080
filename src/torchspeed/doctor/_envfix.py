"""Environment fixes measured on the script itself (T44, T45): allocator settings, thread counts, OpenMP waiting.

Some fixes live in the environment, not in the script: glibc's malloc thresholds (T44), the intra-op
thread count when DataLoader workers share the cores, and OMP_WAIT_POLICY=PASSIVE, which stops idle
OpenMP threads spinning on cores the workers need (T45). They are read when a process starts, so the
doctor measures each by re-running a few of the script's steps in a fresh child process with the
variable set, interleaved with the original in a fresh process of its own (round 1: original, each
environment; round 2: again), through the same runner as `--fix` (`diagnose.measure_variants`). The
speed-up is the median of the per-round ratios, its interval their middle half; the rules read them
from `obs["env_fixes"]` and the registry ranks the finding on that measurement (`registry.settle`).

A fix applies only where its rule's trigger holds (page-fault churn with glibc's default thresholds;
workers + threads beyond the cores; workers beside more than one OpenMP thread) and the variable is not
set already, so a clean script pays nothing. Default cost: 2 rounds x (1 + fixes) runs of
`warmup + 6` steps, each in a process that imports torch.

`measure_env(job, candidates) -> {name: {"ratios": [...], "ms": [...], "baseline_ms": [...], "error": ...}}`
replaces the re-runs (tests inject measured ratios through `diagnose_many(..., measure_env=)`).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping

from torchspeed.env import GLIBC_MALLOC_ENV

__all__ = ["ENV_FIXES", "env_candidates", "measure_env_fixes", "summarize", "env_label", "run_env_rounds"]

# fix name -> the rule whose advice it measures
ENV_FIXES = {"malloc": "allocator", "threads": "cpu-oversubscribed", "omp_passive": "omp-wait-policy"}


from torchspeed.doctor.rules._common import env_label  # noqa: E402  (one home: the rules print it too)


def env_candidates(obs: dict, environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """The environment fixes that apply to this observation: {name: variables to add}."""
    from torchspeed.doctor.rules.allocator import FAULTS

    environ = os.environ if environ is None else environ
    out: dict[str, dict[str, str]] = {}
    env = obs.get("env") or {}
    on_cpu = not str((obs.get("model") or {}).get("device", "cpu")).startswith("cuda")
    faults = (obs.get("breakdown") or {}).get("minor_faults_per_step", 0.0)
    if on_cpu and env.get("allocator") == "glibc" and faults >= FAULTS and "MALLOC_MMAP_THRESHOLD_" not in environ:
        out["malloc"] = dict(GLIBC_MALLOC_ENV)
    c = obs.get("cpu") or {}
    workers, threads, cores = int(c.get("workers", 0)), int(c.get("threads", 1)), int(c.get("cores", 1))
    fewer = max(1, cores - workers)  # the threads the workers leave (the count cpu-oversubscribed names)
    if on_cpu and workers and workers + threads > cores and fewer < threads and "OMP_NUM_THREADS" not in environ:
        out["threads"] = {"OMP_NUM_THREADS": str(fewer)}
    if on_cpu and workers and threads > 1 and "OMP_WAIT_POLICY" not in environ:
        out["omp_passive"] = {"OMP_WAIT_POLICY": "PASSIVE"}
    return out


def summarize(name: str, env: dict, m: dict, *, steps: int) -> dict:
    """One environment fix's entry in `obs["env_fixes"]` from its per-round ratios and step times."""
    entry = {"fix": name, "rule": ENV_FIXES[name], "env": dict(env), "steps": steps}
    ratios = [float(r) for r in m.get("ratios") or []]
    if m.get("error") or not ratios:
        entry["error"] = m.get("error") or "no round could be measured"
        return entry
    if len(ratios) >= 2:
        q = statistics.quantiles(ratios, n=4, method="inclusive")
        lo, hi = q[0], q[2]
    else:
        lo = hi = ratios[0]
    base, cand = m.get("baseline_ms") or [], m.get("ms") or []
    entry.update({"speedup": round(statistics.median(ratios), 4), "ratios": [round(r, 4) for r in ratios],
                  "iqr": [round(lo, 4), round(hi, 4)], "within_noise": bool(lo <= 1.0 <= hi), "rounds": len(ratios),
                  "baseline_ms": round(statistics.median(base), 3) if base else None,
                  "candidate_ms": round(statistics.median(cand), 3) if cand else None})
    return entry


def run_env_rounds(job, candidates: dict[str, dict[str, str]], run_variants: Callable) -> dict[str, dict]:
    """The re-runs: the original and each environment, each in its own process, `job.env_rounds` rounds
    (`run_variants`: `diagnose.measure_variants`, the doctor's interleaved runner, passed in by its caller)."""
    names = list(candidates)
    measured = run_variants(job.script, job.args, [None] * (1 + len(names)), steps=job.env_steps,
                                warmup=min(job.warmup, 3), rounds=job.env_rounds, time_limit=job.time_limit,
                                threads=None, envs=[{}] + [candidates[n] for n in names])
    base_ms = measured[0]["ms"]
    out = {}
    for n, m in zip(names, measured[1:]):
        out[n] = {**m, "baseline_ms": base_ms, "error": m["error"] or measured[0]["error"]}
    return out


def measure_env_fixes(job, obs: dict, *, measure: Callable | None = None, run_variants: Callable | None = None) -> dict:
    """Measure the environment fixes that apply to `obs` and store them in `obs["env_fixes"]`."""
    candidates = env_candidates(obs)
    if not candidates:
        return {}
    try:
        raw = measure(job, candidates) if measure is not None else run_env_rounds(job, candidates, run_variants)
    except Exception as e:  # a doctor failure must not lose the report
        obs.setdefault("notes", []).append(f"environment fixes not measured: {type(e).__name__}: {e}")
        return {}
    entries = {n: summarize(n, env, raw.get(n) or {}, steps=job.env_steps) for n, env in candidates.items()}
    obs["env_fixes"] = entries
    return entries
