"""Helpers the rules share: reading the observation, estimating gains, wording evidence."""

from __future__ import annotations

from torchspeed.doctor.observation import LoaderInfo, Observation
from torchspeed.doctor.observation_runs import EnvFixResult, VerifyResult
from torchspeed.doctor.report import MIN_EFFECT, Finding
from torchspeed.doctor.rules._ceiling import ceiling


def on_cuda(obs: Observation) -> bool:
    return str(obs.get("model", {}).get("device", "cpu")).startswith("cuda")


def step_ms(obs: Observation) -> float:
    return float(obs.get("breakdown", {}).get("step_ms", 0.0))


def frac(obs: Observation, key: str) -> float:
    return float(obs.get("breakdown", {}).get("fractions", {}).get(key, 0.0))


def robust_frac(obs: Observation, key: str) -> float:
    """The smaller of the trimmed-mean share and the median step's share (`_summary`): robust to a few slow steps."""
    med = obs.get("breakdown", {}).get("fractions_median", {})
    mkey = {"data_wait": "data"}.get(key, key)
    return min(frac(obs, key), float(med[mkey])) if mkey in med else frac(obs, key)


def amdahl(share: float, speedup: float) -> float:
    """Whole-step gain when `share` of the step gets `speedup` times faster."""
    share = min(max(share, 0.0), 1.0)
    return 1.0 / ((1.0 - share) + share / speedup)


def saving_gain(step: float, saved_ms: float) -> float:
    """Whole-step gain when `saved_ms` of a `step`-ms step disappears."""
    if step <= 0:
        return 1.0
    return step / max(step - max(saved_ms, 0.0), 1e-9)


def verified(obs: Observation, fix: str) -> VerifyResult | None:
    """--verify's measurement of `fix`; None when it did not run, failed, or its rounds disagree wildly
    (`inconclusive`, `_rounds`): a rule then treats the fix as not measured."""
    v = obs.get("verify", {}).get(fix)
    return v if v and "speedup" in v and not v.get("inconclusive") else None


def inconclusive_text(v: VerifyResult | EnvFixResult, what: str) -> str:
    """Evidence for a measurement of the fix whose rounds disagree wildly: named, not counted."""
    ratios = ", ".join(f"{r:.2f}" for r in v.get("ratios") or [])
    return (f"; {what} disagree (ratios {ratios}x): inconclusive, not counted as a measurement "
            "(measure again with more rounds)")


def measured_text(v: VerifyResult) -> str:
    s = v["speedup"]
    word = "a slow-down" if s < 0.97 else ("no change" if s < 1.03 else "faster")
    if v.get("within_noise"):
        lo, hi = v["iqr"]
        word = f"within noise: the middle half of the per-round ratios spans {lo:.2f}-{hi:.2f}x"
    if v.get("interval"):
        lo, hi = v["interval"]
        word = f"95% interval {lo:.2f}-{hi:.2f}x, {v.get('verdict', '?')}"
    model = (f"; the model's step alone {v['model_speedup']:.2f}x: {v['baseline_ms']:.2f} -> {v['candidate_ms']:.2f} ms, "
             f"and it is {v['compute_share']:.0%} of the script's step" if v.get("model_speedup") is not None
             else f": {v['baseline_ms']:.2f} -> {v['candidate_ms']:.2f} ms per step")
    return (f"; --verify measured {s:.2f}x of the step ({word}{model}, median of {v['rounds']} interleaved "
            f"rounds){loss_text(v)}")


def loss_text(v: VerifyResult) -> str:
    """The fix's loss check, in words (`verify`: the same steps from the same weights on both sides)."""
    lc = v.get("loss_check") or {}
    if lc.get("ok") is None:
        return ""
    word = "within" if lc["ok"] else "NOT within"
    return (f"; the loss stayed {word} {lc['tolerance']:.0%} of the script's over the first {lc['steps']} steps "
            f"(largest difference {lc['max_rel_diff']:.1%})")


def env_measured(obs: Observation, fix: str) -> EnvFixResult | None:
    """The environment re-run's measurement of `fix` (`_envfix`: the script re-run with the variable set)."""
    v = (obs.get("env_fixes") or {}).get(fix)
    return v if v and v.get("speedup") is not None and not v.get("inconclusive") else None


def env_listed(obs: Observation, fix: str) -> EnvFixResult | None:
    """The re-runs' entry for a rule that exists only on that measurement (`omp-wait-policy`, and
    `cpu-oversubscribed` without a timed slow-down): listed unless the interval settles the fix as a loss (its
    upper bound under 1 / `MIN_EFFECT`: `report.interval_verdict`'s "slower"); so also where it holds 1.0
    (inconclusive: listed apart as low, with what would settle it), where it settles no change (low, with the
    measurement), and where the rounds disagree wildly. None when not re-run or failed.

    The line sits where few fixes' true gains do. Most measured-only fixes gain about nothing; with the line at
    the minimum effect (the interval's upper bound over 1.02), a policy that gains 1.01x read [0.9997, 1.0324],
    [0.9912, 1.0262] and [0.9853, 1.0311] on three runs and under 1.02 on two others, and came and went."""
    v = (obs.get("env_fixes") or {}).get(fix)
    if not v or v.get("error") or v.get("skipped") or not v.get("ratios"):
        return None
    if v.get("inconclusive"):
        return v
    if not v.get("interval"):  # a measurement without an interval: its median and the noise of its rounds
        return v if v.get("speedup") and (v["speedup"] > 1.0 or v.get("within_noise")) else None
    return v if v["interval"][1] >= 1 / MIN_EFFECT else None


def env_label(env: dict[str, str]) -> str:
    """Environment variables as a shell prefix: "MALLOC_MMAP_THRESHOLD_=... OMP_WAIT_POLICY=PASSIVE"."""
    return " ".join(f"{k}={v}" for k, v in env.items())


def env_text(v: EnvFixResult) -> str:
    lo, hi = v["iqr"]
    noise = f", within noise: {lo:.2f}-{hi:.2f}x" if v.get("within_noise") else ""
    if v.get("interval"):
        noise = f", 95% interval {v['interval'][0]:.2f}-{v['interval'][1]:.2f}x: {v.get('verdict', '?')}"
    ms = (f": {v['baseline_ms']:.2f} -> {v['candidate_ms']:.2f} ms per step"
          if v.get("baseline_ms") and v.get("candidate_ms") else "")
    what = f"the --fix patch ({v['label']})" if v.get("patch") else env_label(v["env"])
    return (f"; re-running {v['steps']} steps of the script with {what} measured {v['speedup']:.2f}x"
            f"{ms} (median of {v['rounds']} interleaved runs{noise})")


def in_plan(obs: Observation, fix: str | None) -> bool:
    """`fix` is one of the switches fit's plan changes for this script (`_fit_plan`, --verify)."""
    return bool(fix) and fix in ((obs.get("fit_plan") or {}).get("fixes") or [])


def plan_text(obs: Observation, fix: str | None) -> str:
    if not in_plan(obs, fix):
        return ""
    p = obs["fit_plan"]
    if p.get("inconclusive") or p.get("speedup") is None:
        return (f"; fit's plan for this model chooses it ({p['chosen']} against the script's {p['script']}; its "
                "interleaved rounds disagree: inconclusive)")
    return (f"; fit's plan for this model chooses it ({p['chosen']} against the script's {p['script']}: measured "
            f"{p['speedup']:.2f}x per step, median of {len(p['ratios'])} interleaved rounds)")


def finding(rule: str, *, evidence: str, fix: str, est_gain: float | None, obs: Observation,
            verify_fix: str | None = None, severity: str | None = None, basis: str = "estimated",
            patch: str | None = None, patch_args: dict | None = None, env_fix: str | None = None,
            bound_of: str | None = None) -> Finding:
    """A finding; its severity is decided by the registry (`registry.settle`) from what the gain rests on.

    `basis` is "timed" when `est_gain` comes from time the fix removes, timed directly on the script,
    else "estimated"; --verify's measurement of `verify_fix` makes it "measured". `severity` is a ceiling
    for an unmeasured finding. `patch` names the source patch `--fix` writes (`torchspeed.doctor._patches`).
    The bound a measured share puts on the fix's gain (`_ceiling.ceiling` of `bound_of`, else of the fix) is
    stated, and a fix not run because that bound is under the minimum effect says so."""
    measured, interval = None, None
    bound = ceiling(obs, bound_of or verify_fix or env_fix)
    if bound is not None:
        evidence += f"; at most {bound['bound']:.3f}x: {bound['of']} is {bound['share']:.1%} of the step"
    for name, results in ((verify_fix, obs.get("verify")), (env_fix, obs.get("env_fixes"))):
        if name and ((results or {}).get(name) or {}).get("skipped"):
            evidence += f" ({name}: {results[name]['skipped']})"
    v = verified(obs, verify_fix) if verify_fix else None
    for name, results, what in ((verify_fix, obs.get("verify"), "--verify's interleaved rounds"),
                                (env_fix, obs.get("env_fixes"), "the interleaved re-runs of the script")):
        wild = (results or {}).get(name) if name else None
        if wild and wild.get("inconclusive"):
            evidence += inconclusive_text(wild, what)
    if v is None and env_fix and (v := env_measured(obs, env_fix)) is not None:
        evidence += env_text(v)
    elif v is not None:
        evidence += measured_text(v)
    settle_by = None
    if v is not None:
        measured, basis = float(v["speedup"]), "measured"
        settle_by = v.get("settle")
        if v.get("interval"):  # the 95% bootstrap interval of the ratio of the medians (`_interval`)
            interval = (float(v["interval"][0]), float(v["interval"][1]))
        elif v.get("iqr"):
            interval = (float(v["iqr"][0]), float(v["iqr"][1]))
        elif v.get("within_noise"):
            interval = (min(measured, 1.0), max(measured, 1.0))
    evidence += plan_text(obs, verify_fix)
    return Finding(rule=rule, severity=severity or "high", evidence=evidence, fix=fix,
                   est_gain=round(est_gain, 3) if est_gain is not None else None, measured_gain=measured,
                   patch=patch, patch_args=patch_args, basis=basis, interval=interval, inconclusive=settle_by,
                   ceiling=bound["bound"] if bound is not None else None)


def device_type(obs: Observation) -> str:
    return "cuda" if on_cuda(obs) else "cpu"


def loader_summary(obs: Observation) -> LoaderInfo | None:
    loaders = obs.get("loaders") or []
    return loaders[0] if loaders else None


def in_memory_fix(own: list[str] | tuple[str, ...] = ()) -> str:
    """The fix for a TensorDataset fed through a DataLoader: index whole batches, no per-sample work. `own`: the
    loader's own batching parts (`_summary.own_batching`), which the slicing must keep by hand."""
    text = ("the data is already in memory (a TensorDataset, or a Dataset whose __getitem__ only indexes its "
            "tensors): index whole batches instead of one sample at a "
            "time, `perm = torch.randperm(len(X)); for i in range(0, len(X), B): idx = perm[i:i+B]; x, y = X[idx], "
            "Y[idx]` (no per-sample __getitem__, no collate); workers would only add inter-process copies (T10, T06)")
    if own:
        text += (f"; this DataLoader batches its own way ({', '.join(own)}), so `--fix` does not rewrite it: draw "
                 "the indices as its sampler does and do its collate's work on each sliced batch")
    return text


def workers_verdict(obs: Observation) -> VerifyResult | None:
    """--verify's worker measurement (the tuner's choice against the script's setting), when it ran."""
    return verified(obs, "workers")
