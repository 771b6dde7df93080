"""Environment fixes measured on the script itself (T44, T45): allocator settings, thread counts, OpenMP waiting.

Some fixes live in the environment, not in the script: glibc's malloc thresholds (T44), the intra-op
thread count when DataLoader workers share the cores, and OMP_WAIT_POLICY=PASSIVE, which stops idle
OpenMP threads spinning on cores the workers need (T45). They are read when a process starts, so the
doctor measures each by re-running a few of the script's steps in a fresh child process with the
variable set, interleaved with the original in a fresh process of its own (5 rounds by default, each in an
order drawn at random; each process's own warm-up steps are discarded), through the same runner as `--fix`
(`diagnose.measure_variants`). The speed-up is the median of the per-round ratios, its interval the 95%
bootstrap interval of the ratio of the median step times (`_interval.gain_interval`; re-runs that disagree
by more than 2x are inconclusive, and no rule counts them); the rules read them from `obs["env_fixes"]`
and the registry ranks the finding on that interval's lower bound (`registry.settle`).

A fix applies only where its rule's trigger holds (page-fault churn with glibc's default thresholds,
`allocator.churn`; workers + threads beyond the cores; workers beside more than one OpenMP thread; intra-op threads
beyond the usable cores, `cores`) and the variable is not set already, so a clean script pays nothing; nor is one
whose gain a measured share of the step bounds under the 2% minimum effect (`rules._ceiling`: the data wait for
`workers`, the page faults at their upper-bound cost for `malloc`), and its entry says so. A re-run times
`job.env_steps` steps (6), more for a short step (about 300 ms of steps, at most 60: `env_steps`); a fix whose
interval is still too wide to rank gets 5 more rounds, up to 15, while those re-runs fit in `ENV_MORE_S` (45 s,
priced at the first rounds' seconds a process; where not all fit, the largest measured gain first: `affordable`);
a loop with DataLoader workers warms up until the batches they loaded ahead at start are drained (`backlog`), else
its timed steps read a loop that does not wait on its data, and the fix's gain with it. Each re-run is a process
that imports torch and starts the script, 2-4 s on 2 cores, and a tiny script's 15 rounds of two fixes had
made a plain `torchspeed doctor` take 4 minutes. Default cost: 5 rounds x (1 + fixes) runs of `warmup + 6` or
more steps, then at most 45 s more.

One source fix is measured the same way, because no timing of the script alone can say what it gains:
DataLoader workers for a loop that loads in the main process (`workers`, the `--fix` patch with
num_workers = the usable cores, at most 4). Whether workers help depends on what the timed data wait
cannot show: whether they overlap compute on cores the model's threads leave, and what starting them
costs when the script builds a new DataLoader every epoch. `dataloader-workers` and `data-bound` rank
on that re-run. It needs libcst (the patch is written with it); without it they stay timed estimates.

`measure_env(job, candidates) -> {name: {"ratios": [...], "ms": [...], "baseline_ms": [...], "error": ...}}`
replaces the re-runs (tests inject measured ratios through `diagnose_many(..., measure_env=)`); a source
fix appears in `candidates` with no variables.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Mapping

from torchspeed.doctor._interval import MAX_ROUNDS, bootstrap_interval, gain_interval, wide
from torchspeed.doctor import _patches  # noqa: F401  (registers every patch)
from torchspeed.doctor._patch_base import NotApplicable, PatchContext, apply_patch, libcst_missing
from torchspeed.doctor._rounds import round_summary
from torchspeed.doctor.observation import Observation
from torchspeed.doctor.observation_runs import EnvFixResult
from torchspeed.doctor.rules._ceiling import below_minimum, ceiling, skipped_entry
from torchspeed.doctor.rules.allocator import churn
from torchspeed.env import GLIBC_MALLOC_ENV

__all__ = ["ENV_FIXES", "ENV_BUDGET_MS", "env_candidates", "patch_candidates", "measure_env_fixes", "summarize",
           "run_env_rounds", "env_steps"]

ENV_BUDGET_MS, ENV_MAX_STEPS = 300.0, 60  # measured time per re-run (`env_steps`), and the most steps for it
BACKLOG_MAX = 8  # the most batches ahead a re-run drains (8 workers x 4 ahead would be 64 steps of warm-up)
ENV_MORE_S = 45.0  # the most seconds the re-runs beyond the first `env_rounds` rounds may take (a script's start-up)
_clock = time.perf_counter

# fix name -> the rule whose advice it measures
ENV_FIXES = {"malloc": "allocator", "threads": "cpu-oversubscribed", "omp_passive": "omp-wait-policy",
             "workers": "dataloader-workers", "cores": "cpu-threads"}
WAIT_SHARE = 0.05  # the data wait (share of the step) worth re-running the script with workers for


def env_candidates(obs: Observation, environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """The environment fixes that apply to this observation: {name: variables to add}."""
    environ = os.environ if environ is None else environ
    out: dict[str, dict[str, str]] = {}
    on_cpu = not str((obs.get("model") or {}).get("device", "cpu")).startswith("cuda")
    if churn(obs) and "MALLOC_MMAP_THRESHOLD_" not in environ:
        out["malloc"] = dict(GLIBC_MALLOC_ENV)
    c = obs.get("cpu") or {}
    workers, threads, cores = int(c.get("workers", 0)), int(c.get("threads", 1)), int(c.get("cores", 1))
    fewer = max(1, cores - workers)  # the threads the workers leave (the count cpu-oversubscribed names)
    if on_cpu and workers and workers + threads > cores and fewer < threads and "OMP_NUM_THREADS" not in environ:
        out["threads"] = {"OMP_NUM_THREADS": str(fewer)}
    if on_cpu and workers and threads > 1 and "OMP_WAIT_POLICY" not in environ:
        out["omp_passive"] = {"OMP_WAIT_POLICY": "PASSIVE"}
    usable = int(obs.get("cpu_cores") or 1)  # intra-op threads beyond the usable cores (a collapsed affinity)
    if on_cpu and int(obs.get("threads") or 1) > usable and "threads" not in out and "OMP_NUM_THREADS" not in environ:
        out["cores"] = {"OMP_NUM_THREADS": str(usable)}
    return out


def patch_candidates(obs: Observation, source: str | None) -> dict[str, dict]:
    """The source fixes that apply: {"workers": {"source": patched text, "workers": n, "label": ...}}."""
    loaders = [ld for ld in obs.get("loaders") or [] if ld.get("num_workers") == 0 and ld.get("map_style", True)
               and not ld.get("in_memory")]
    wait = float(((obs.get("breakdown") or {}).get("fractions") or {}).get("data_wait", 0.0))
    if not source or not loaders or wait < WAIT_SHARE or libcst_missing():
        return {}
    n = min(4, max(1, int(obs.get("cpu_cores", 2))))
    on_cuda = str((obs.get("model") or {}).get("device", "cpu")).startswith("cuda")
    try:
        patched = apply_patch("workers", source, PatchContext(device="cuda" if on_cuda else "cpu", workers=n))
    except (NotApplicable, SyntaxError, ValueError):
        return {}
    return {"workers": {"source": patched, "workers": n, "label": f"num_workers={n}, persistent_workers=True"}}


def summarize(name: str, env: dict, m: dict, *, steps: int) -> EnvFixResult:
    """One environment fix's entry in `obs["env_fixes"]` from its per-round ratios and step times."""
    entry: EnvFixResult = {"fix": name, "rule": ENV_FIXES[name], "env": dict(env), "steps": steps}
    ratios = [float(r) for r in m.get("ratios") or []]
    if m.get("error") or not ratios:
        entry["error"] = m.get("error") or "no round could be measured"
        return entry
    base, cand = m.get("baseline_ms") or [], m.get("ms") or []
    # the interval of the ratio of the medians, from both sides' step times (`_interval`); without them
    # (an injected measurement of ratios alone), from the ratios against a baseline of 1
    summary = gain_interval(base, cand) if base and cand else gain_interval([1.0] * len(ratios), [1 / r for r in ratios])
    entry.update({**summary, **round_summary(ratios), "rounds": len(ratios),
                  "baseline_ms": round(statistics.median(base), 3) if base else None,
                  "candidate_ms": round(statistics.median(cand), 3) if cand else None})
    if base and cand:
        entry["samples_ms"] = [list(base), list(cand)]
    if m.get("more_rounds"):
        entry["more_rounds"] = m["more_rounds"]
    return entry


def backlog(obs: Observation, patched: dict[str, dict] | None = None) -> int:
    """Batches the DataLoader workers load ahead while a re-run starts (workers x prefetch_factor, 2 by default):
    the original's loaders, or the workers patch's `workers`. A re-run whose timed steps eat that backlog times a
    loop that does not wait on its data: on the fault gallery's 2-worker loop (4 batches ahead) 6 timed steps read
    the thread-count fix at 0.98-1.24x, and the interval held its true 1.35x on 2 runs of 5; draining the backlog
    first, 5 of 5 (`bench_doctor.py --recovery oversubscribed`)."""
    ahead = [int(ld.get("num_workers") or 0) * (int(ld.get("prefetch_factor") or 0) or 2)
             for ld in obs.get("loaders") or []]
    ahead += [2 * int(p.get("workers") or 0) for p in (patched or {}).values()]
    return min(BACKLOG_MAX, max(ahead, default=0))


def env_steps(job, obs: Observation, patched: dict[str, dict] | None = None) -> tuple[int, int]:
    """Measured steps per re-run and the warm-up steps before them: `job.env_steps`, more for a short step, so
    that each re-run times about `ENV_BUDGET_MS` (6 steps of a 3 ms step time 18 ms, which one page-fault burst or
    a preemption moves); with DataLoader workers, a warm-up that drains their start-up `backlog` (twice over: they
    keep loading while it drains) and at least 3 backlogs of timed steps."""
    ahead = backlog(obs, patched)
    warmup = min(job.warmup, 3) + 2 * ahead
    step = float((obs.get("breakdown") or {}).get("step_ms") or 0.0)
    steps = job.env_steps if step <= 0 else max(job.env_steps, min(ENV_MAX_STEPS, math.ceil(ENV_BUDGET_MS / step)))
    return min(ENV_MAX_STEPS, max(steps, 3 * ahead)), warmup


def run_env_rounds(job, candidates: dict[str, dict[str, str]], run_variants: Callable,
                   patched: dict[str, dict] | None = None, *, steps: int | None = None,
                   warmup: int | None = None) -> dict[str, dict]:
    """The re-runs: the original and each environment (and each patched source), each in its own process,
    `job.env_rounds` rounds (`run_variants`: `diagnose.measure_variants`, the doctor's interleaved runner,
    passed in by its caller). A fix whose interval is still too wide to rank (`_interval.wide`) gets
    `job.env_rounds` more rounds beside the original, up to `_interval.MAX_ROUNDS` in all, while they fit in
    `ENV_MORE_S` at the first rounds' seconds a process, the largest gain first where not all fit (`affordable`);
    else its entry says why not (`more_rounds`)."""
    patched = patched or {}
    steps = steps or job.env_steps
    names = [n for n in candidates if n not in patched] + list(patched)
    out = {n: {"ratios": [], "ms": [], "baseline_ms": [], "error": None} for n in names}
    todo, spent, per_process = list(names), [], 0.0
    while todo:
        if spent:  # more rounds: only while their re-runs fit in what is left of ENV_MORE_S
            per_process = per_process or spent[0] / (job.env_rounds * (1 + len(names)))
            fits = affordable(todo, out, ENV_MORE_S - sum(spent[1:]), per_process * job.env_rounds)
            for n in todo:
                if n not in fits:
                    out[n]["more_rounds"] = f"not run: their re-runs would take over {ENV_MORE_S:.0f} s"
            if not fits:
                break
            todo = fits
        t0 = _clock()
        sources = [job.source] + [patched[n]["source"] if n in patched else job.source for n in todo]
        measured = run_variants(job.script, job.args, sources, steps=steps,
                                warmup=min(job.warmup, 3) if warmup is None else warmup, rounds=job.env_rounds,
                                time_limit=job.time_limit, threads=None,
                                envs=[{}] + [{} if n in patched else candidates[n] for n in todo])
        for n, m in zip(todo, measured[1:]):
            o = out[n]
            o["ratios"] += m["ratios"]
            o["ms"] += m["ms"]
            o["baseline_ms"] += measured[0]["ms"]
            o["error"] = o["error"] or m["error"] or measured[0]["error"]
        spent.append(_clock() - t0)
        todo = [n for n in todo if _too_wide(out[n]) and len(out[n]["ms"]) + job.env_rounds <= MAX_ROUNDS]
    for o in out.values():
        o["speedup"] = round(statistics.median(o["ratios"]), 4) if o["ratios"] and not o["error"] else None
    return out


def affordable(todo: list[str], out: dict[str, dict], left_s: float, round_s: float) -> list[str]:
    """The fixes whose next rounds fit in `left_s` (each round of k fixes: k + 1 processes of `round_s` / rounds
    seconds a side, the original's beside them), the largest measured gain first: where not every fix too wide
    to rank can have more rounds, the one whose severity has the most at stake gets them."""
    by_gain = sorted(todo, key=lambda n: -statistics.median(out[n]["ratios"]) if out[n]["ratios"] else 0.0)
    k = max(0, min(len(by_gain), math.floor(left_s / round_s) - 1)) if round_s > 0 else len(by_gain)
    return [n for n in todo if n in by_gain[:k]]


def _too_wide(m: dict) -> bool:
    """Rounds that cannot rank yet: paired and error-free, with an interval holding a threshold."""
    if m["error"] or not m["ms"] or len(m["ms"]) != len(m["baseline_ms"]):
        return False
    return wide(*bootstrap_interval(m["baseline_ms"], m["ms"]))


def _source(job) -> str | None:
    if job.source is not None:
        return job.source
    try:
        with open(job.script, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def measure_env_fixes(job, obs: Observation, *, measure: Callable | None = None,
                      run_variants: Callable | None = None) -> dict[str, EnvFixResult]:
    """Measure the environment fixes (and the workers patch) that apply to `obs`; store them in `obs["env_fixes"]`."""
    env = env_candidates(obs)
    patched = patch_candidates(obs, _source(job))
    # a fix whose gain a measured share bounds under the minimum effect is not re-run (`rules._ceiling`)
    skipped = {n: skipped_entry(n, ENV_FIXES[n], c) for n in (*env, *patched)
               if below_minimum(c := ceiling(obs, n))}
    env = {n: v for n, v in env.items() if n not in skipped}
    patched = {n: v for n, v in patched.items() if n not in skipped}
    candidates = {**env, **{n: {} for n in patched}}
    if skipped:
        obs["env_fixes"] = dict(skipped)
    if not candidates:
        return dict(skipped)
    steps, warmup = env_steps(job, obs, patched)
    try:
        raw = (measure(job, candidates) if measure is not None
               else run_env_rounds(job, env, run_variants, patched, steps=steps, warmup=warmup))
    except Exception as e:  # a doctor failure must not lose the report
        obs.setdefault("notes", []).append(f"environment fixes not measured: {type(e).__name__}: {e}")
        return dict(skipped)
    entries = {n: summarize(n, v, raw.get(n) or {}, steps=steps) for n, v in candidates.items()}
    for n, p in patched.items():  # a source fix: the patch it ran and what it set
        entries[n].update(patch=n, label=p["label"], workers=p["workers"])
    obs["env_fixes"] = {**skipped, **entries}
    return obs["env_fixes"]
