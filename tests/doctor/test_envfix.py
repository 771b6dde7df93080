"""Environment fixes (allocator settings, thread counts, OMP_WAIT_POLICY) measured by re-running the script:
which apply, how the re-runs are interleaved, and how their measurement ranks the findings.

Every measurement here is injected (fake ratios); nothing asserts on the clock.
"""

import copy
import importlib
import itertools
import statistics
import textwrap
from types import SimpleNamespace

from torchspeed.doctor import DoctorJob, diagnose_many, report_from_observation
from torchspeed.doctor import _envfix, fix
from torchspeed.doctor.diagnose import _groups
from torchspeed.doctor.undeclared import undeclared_keys
from torchspeed.env import GLIBC_MALLOC_ENV

from test_rules import CLEAN, _oversubscribed, _set


def _obs(*mods):
    o = copy.deepcopy(CLEAN)
    for m in mods:
        m(o)
    return o


FAULTS = _set("breakdown.minor_faults_per_step", 6000.0)


def _ratios(**by_fix):
    """An injected `measure_env`: the per-round ratios of each fix; records what it was asked to measure."""
    asked = []

    def measure(job, candidates):
        asked.append(dict(candidates))
        return {n: {"ratios": by_fix[n], "ms": [10.0 / r for r in by_fix[n]], "baseline_ms": [10.0] * len(by_fix[n]),
                    "error": None} for n in candidates if n in by_fix}
    measure.asked = asked
    return measure


def test_candidates_follow_each_rules_trigger_and_skip_what_is_set():
    assert _envfix.env_candidates(_obs(), environ={}) == {}  # a clean script pays nothing
    assert _envfix.env_candidates(_obs(FAULTS), environ={}) == {"malloc": dict(GLIBC_MALLOC_ENV)}
    c = _envfix.env_candidates(_obs(_oversubscribed), environ={})
    assert c == {"threads": {"OMP_NUM_THREADS": "1"}, "omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
    assert _envfix.env_candidates(_obs(_oversubscribed), environ={"OMP_WAIT_POLICY": "PASSIVE",
                                                                  "OMP_NUM_THREADS": "1"}) == {}
    assert _envfix.env_candidates(_obs(FAULTS, _set("env.allocator", "tcmalloc")), environ={}) == {}


def test_measured_allocator_settings_rank_the_allocator_finding(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    job = DoctorJob(script="train.py")
    before = report_from_observation(_obs(FAULTS)).finding("allocator")
    assert before.basis == "estimated" and before.severity == "low"
    for ratios, severity in (([1.10, 1.12], "medium"), ([1.30, 1.34], "high"), ([0.98, 1.04], "low")):
        obs = _obs(FAULTS)
        _envfix.measure_env_fixes(job, obs, measure=_ratios(malloc=ratios))
        assert not undeclared_keys(obs)
        f = report_from_observation(obs).finding("allocator")
        assert f.basis == "measured" and f.severity == severity, (ratios, f)
        assert "re-running 30 steps of the script with MALLOC_MMAP_THRESHOLD_=" in f.evidence  # 10 ms steps: 300 ms
        assert "estimated, not measured" not in f.evidence


def test_thread_count_and_wait_policy_measured_as_one_contention_finding(monkeypatch):
    for v in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(v, raising=False)
    job = DoctorJob(script="train.py")
    # workers + threads > cores but no slow-down timed: nothing without a measurement
    quiet = _set("cpu", {"workers": 2, "threads": 2, "cores": 2, "compute_ms_in_script": 9.0,
                         "compute_ms_alone": 8.9, "worker_ms_per_batch": 4.0})
    assert not report_from_observation(_obs(quiet)).rules & {"cpu-oversubscribed", "omp-wait-policy"}
    obs = _obs(quiet)
    measure = _ratios(threads=[1.15, 1.2], omp_passive=[1.3, 1.32])
    _envfix.measure_env_fixes(job, obs, measure=measure)
    assert measure.asked == [{"threads": {"OMP_NUM_THREADS": "1"}, "omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"}}]
    r = report_from_observation(obs)
    f = r.finding("omp-wait-policy")  # the better measured fix of the cause leads, the other is named in it
    assert f is not None and f.severity == "high" and f.basis == "measured" and f.measured_gain == 1.31
    assert [a.rule for a in f.also] == ["cpu-oversubscribed"] and r.finding("cpu-oversubscribed") is None
    assert f.also[0].basis == "measured" and "OMP_NUM_THREADS=1 measured" in f.also[0].evidence
    # an interval that holds 1.0: the wait policy is listed apart as inconclusive (low), under the measured gain
    obs = _obs(quiet)
    _envfix.measure_env_fixes(job, obs, measure=_ratios(threads=[1.15, 1.2], omp_passive=[0.95, 1.1]))
    r = report_from_observation(obs)
    f = r.finding("cpu-oversubscribed")
    assert f.severity == "medium" and [(a.rule, a.severity) for a in f.also] == [("omp-wait-policy", "low")]
    assert f.also[0].inconclusive and "holds 1.0" in f.also[0].inconclusive
    # measured settled no change: listed low with its measurement; a settled slow-down: not reported
    obs = _obs(quiet)
    _envfix.measure_env_fixes(job, obs, measure=_ratios(threads=[0.8] * 5, omp_passive=[1.0, 1.005, 0.995, 1.0, 1.0]))
    f = report_from_observation(obs).finding("omp-wait-policy")
    assert f.severity == "low" and f.basis == "measured" and "no-change" in f.evidence
    obs = _obs(quiet)
    omp = [0.8, 0.82, 0.79, 0.81, 0.8]
    _envfix.measure_env_fixes(job, obs, measure=_ratios(threads=omp, omp_passive=omp))
    assert not report_from_observation(obs).rules & {"cpu-oversubscribed", "omp-wait-policy"}, omp


def test_a_measurement_only_finding_reads_the_same_on_runs_that_straddle_one():
    """Rounds of a policy that gains nothing: one run's median lands over 1.0, the next under it. Both runs list
    the same (rule, severity): inconclusive, low (the rule used to appear on the first and vanish on the second)."""
    job = DoctorJob(script="train.py")
    quiet = _set("cpu", {"workers": 2, "threads": 2, "cores": 2, "compute_ms_in_script": 9.0,
                         "compute_ms_alone": 8.9, "worker_ms_per_batch": 4.0})
    seen = set()
    for omp in ([1.08, 0.97, 1.03, 0.94, 1.06], [0.93, 1.04, 0.97, 1.07, 0.98]):
        obs = _obs(quiet)
        _envfix.measure_env_fixes(job, obs, measure=_ratios(threads=omp, omp_passive=omp))
        r = report_from_observation(obs)
        pairs = {(f.rule, f.severity) for f in r.findings for f in (f, *f.also)} & {
            ("omp-wait-policy", "low"), ("cpu-oversubscribed", "low")}
        seen.add(frozenset(pairs))
    assert seen == {frozenset({("omp-wait-policy", "low"), ("cpu-oversubscribed", "low")})}


def test_env_reruns_interleave_the_original_with_each_environment(monkeypatch):
    seen = []

    def fake_many(jobs, **kw):
        seen.extend(jobs)
        ms = {None: 10.0, "1": 8.0, "PASSIVE": 12.5}
        return [SimpleNamespace(status="stopped", traceback=None,
                                breakdown={"step_ms": ms[next(iter(j.env.values()), None)]}) for j in jobs]

    import importlib

    diagnose_mod = importlib.import_module("torchspeed.doctor.diagnose")  # the module (the package exports a function of that name)

    monkeypatch.setattr(diagnose_mod, "diagnose_many", fake_many)
    job = DoctorJob(script="train.py", args=("--x",), warmup=5, env_rounds=3, env_steps=4)
    cands = {"threads": {"OMP_NUM_THREADS": "1"}, "omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
    raw = _envfix.run_env_rounds(job, cands, diagnose_mod.measure_variants)
    # each round runs the original and every environment once, in an order drawn at random per round
    rounds = [[j.env for j in seen[i:i + 3]] for i in range(0, 9, 3)]
    assert all(sorted(map(str, r)) == sorted(map(str, [{}, cands["threads"], cands["omp_passive"]])) for r in rounds)
    assert len({str(r) for r in rounds}) > 1  # not the same order every round
    assert all(j.measure_only and j.steps == 4 and j.warmup == 3 and j.args == ("--x",) for j in seen)
    assert raw["threads"]["ratios"] == [1.25] * 3 and raw["omp_passive"]["ratios"] == [0.8] * 3
    e = _envfix.summarize("threads", cands["threads"], raw["threads"], steps=4)
    assert e["speedup"] == 1.25 and e["baseline_ms"] == 10.0 and e["candidate_ms"] == 8.0 and not e["within_noise"]


def test_a_job_with_an_environment_runs_in_its_own_process_with_it(tmp_path):
    assert _groups([DoctorJob("a"), DoctorJob("b"), DoctorJob("c", env={}), DoctorJob("d", env={"X": "1"}),
                    DoctorJob("e"), DoctorJob("f")]) == [[0, 1], [2], [3], [4, 5]]
    script = tmp_path / "env_check.py"
    script.write_text(textwrap.dedent('''
        import os, sys
        sys.exit(0 if os.environ.get("TORCHSPEED_DOCTOR_TEST") == "on" else 3)
    '''))
    jobs = [DoctorJob(str(script), env={"TORCHSPEED_DOCTOR_TEST": "on"}, time_limit=60),
            DoctorJob(str(script), time_limit=60)]
    with_env, without = diagnose_many(jobs, quiet=True)
    assert with_env.status == "finished" and without.status == "exited"


def test_plain_run_measures_env_fixes_through_the_injection_point(tmp_path, monkeypatch):
    # the re-run happens after a full run only; measure_only runs (--fix, the re-runs themselves) never recurse
    calls = []
    monkeypatch.setattr(_envfix, "env_candidates", lambda obs, environ=None: {"omp_passive": {"OMP_WAIT_POLICY":
                                                                                               "PASSIVE"}})
    script = tmp_path / "done.py"
    script.write_text("print('no training here')\n")

    def measure(job, candidates):
        calls.append((job.script, job.measure_only, dict(candidates)))
        return {"omp_passive": {"ratios": [1.2, 1.3], "ms": [8.0, 7.7], "baseline_ms": [10.0, 10.0]}}

    full, only = diagnose_many([DoctorJob(str(script), time_limit=60),
                                DoctorJob(str(script), time_limit=60, measure_only=True)], quiet=True,
                               measure_env=measure)
    assert calls == [(str(script), False, {"omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"}})]
    assert full.observation["env_fixes"]["omp_passive"]["speedup"] == 1.25
    assert "env_fixes" not in only.observation
    off = diagnose_many([DoctorJob(str(script), time_limit=60, env_rounds=0)], quiet=True, measure_env=measure)[0]
    assert len(calls) == 1 and "env_fixes" not in off.observation


def test_report_shows_the_environment_reruns(monkeypatch):
    from rich.console import Console

    from torchspeed.doctor import render_report

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    obs = _obs(FAULTS)
    _envfix.measure_env_fixes(DoctorJob(script="train.py"), obs, measure=_ratios(malloc=[1.2, 1.3]))
    console = Console(record=True, width=200)
    render_report(report_from_observation(obs, script="train.py"), console)
    text = console.export_text()
    assert "environment fixes" in text and "MALLOC_TRIM_THRESHOLD_=1073741824" in text and "1.25x" in text


LOADER_SCRIPT = textwrap.dedent('''
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    loader = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=8)
''')


def _workers0(o):
    o["breakdown"].update(data_wait_ms=6.0, compute_ms=3.5, other_ms=0.5)
    o["breakdown"]["fractions"].update(data_wait=0.6, compute=0.35)
    o["loaders"][0]["num_workers"] = 0


def test_workers_patch_is_re_run_for_a_loop_that_loads_in_the_main_process(monkeypatch):
    for v in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(v, raising=False)
    job = DoctorJob(script="train.py", source=LOADER_SCRIPT)
    # timed alone, the wait ranks the workers advice; re-run with workers that slow the script: low
    assert report_from_observation(_obs(_workers0)).finding("dataloader-workers").basis == "timed"
    obs = _obs(_workers0)
    measure = _ratios(workers=[0.9, 0.95])
    _envfix.measure_env_fixes(job, obs, measure=measure)
    assert measure.asked == [{"workers": {}}]
    e = obs["env_fixes"]["workers"]
    assert e["patch"] == "workers" and e["workers"] == 2 and e["label"] == "num_workers=2, persistent_workers=True"
    assert not undeclared_keys(obs)
    r = report_from_observation(obs)
    for rule in ("dataloader-workers", "data-bound"):
        f = next(g for f in r.findings for g in (f, *f.also) if g.rule == rule)
        assert f.basis == "measured" and f.severity == "low", (rule, f)
        assert "with the --fix patch (num_workers=2, persistent_workers=True) measured 0.93x" in f.evidence
    # workers that help: ranked on the low end of the re-run's rounds
    obs = _obs(_workers0)
    _envfix.measure_env_fixes(job, obs, measure=_ratios(workers=[1.3, 1.6]))
    f = report_from_observation(obs).finding("dataloader-workers")
    assert f.basis == "measured" and f.severity == "high" and f.measured_gain == 1.45


def test_workers_re_run_only_where_it_applies():
    job = DoctorJob(script="train.py", source=LOADER_SCRIPT)
    assert _envfix.patch_candidates(_obs(_workers0), LOADER_SCRIPT)["workers"]["workers"] == 2
    assert _envfix.patch_candidates(_obs(), LOADER_SCRIPT) == {}  # workers already
    assert _envfix.patch_candidates(_obs(_workers0, _set("breakdown.fractions.data_wait", 0.01)), LOADER_SCRIPT) == {}
    assert _envfix.patch_candidates(_obs(_workers0, lambda o: o["loaders"][0].update(in_memory=True)), LOADER_SCRIPT) == {}
    assert _envfix.patch_candidates(_obs(_workers0), "x = 1\n") == {}  # no DataLoader call to patch
    assert job.source == LOADER_SCRIPT


def test_the_patched_source_runs_in_its_own_round_slot(monkeypatch):
    seen = []

    def fake_many(jobs, **kw):
        seen.extend(jobs)
        return [SimpleNamespace(status="stopped", traceback=None, breakdown={"step_ms": 5.0 if j.source else 10.0})
                for j in jobs]

    import importlib

    diagnose_mod = importlib.import_module("torchspeed.doctor.diagnose")
    monkeypatch.setattr(diagnose_mod, "diagnose_many", fake_many)
    job = DoctorJob(script="train.py", env_rounds=2, env_steps=4)
    patched = {"workers": {"source": "PATCHED", "workers": 2, "label": "num_workers=2"}}
    raw = _envfix.run_env_rounds(job, {"threads": {"OMP_NUM_THREADS": "1"}}, diagnose_mod.measure_variants, patched)
    want = sorted(map(str, [(None, {}), (None, {"OMP_NUM_THREADS": "1"}), ("PATCHED", {})]))
    assert all(sorted(str((j.source, j.env)) for j in seen[i:i + 3]) == want for i in (0, 3))
    assert raw["workers"]["ratios"] == [2.0, 2.0] and raw["threads"]["ratios"] == [1.0, 1.0]


def test_a_short_step_is_re_run_for_more_steps_and_a_fix_too_wide_to_rank_for_more_rounds(monkeypatch):
    import importlib
    import itertools

    job = DoctorJob(script="train.py", env_rounds=5, env_steps=6)
    assert _envfix.env_steps(job, {"breakdown": {"step_ms": 100.0}}) == (6, 3)  # 600 ms of steps already
    assert _envfix.env_steps(job, {"breakdown": {"step_ms": 10.0}}) == (30, 3)  # about 300 ms of steps
    assert _envfix.env_steps(job, {"breakdown": {"step_ms": 0.5}}) == (60, 3)  # at most 60

    seen = []
    noisy = itertools.cycle([9.0, 11.0, 10.5, 9.5, 12.0, 8.5])  # the original and omp_passive: the same, noisy

    def fake_many(jobs, quiet=False, threads=None):
        seen.append(len(jobs))
        return [SimpleNamespace(status="stopped", traceback=None, breakdown={
            "step_ms": 5.0 if j.env.get("OMP_NUM_THREADS") else next(noisy)}) for j in jobs]

    diagnose_mod = importlib.import_module("torchspeed.doctor.diagnose")
    monkeypatch.setattr(diagnose_mod, "diagnose_many", fake_many)
    cands = {"threads": {"OMP_NUM_THREADS": "1"}, "omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
    raw = _envfix.run_env_rounds(job, cands, diagnose_mod.measure_variants, steps=30)
    # threads (about 2x) ranks after 5 rounds; omp_passive's interval holds 1.0: 5 more rounds, twice, to 15
    assert len(raw["threads"]["ratios"]) == 5 and len(raw["omp_passive"]["ratios"]) == 15
    assert len(raw["omp_passive"]["baseline_ms"]) == 15  # each round paired with the original run beside it
    assert seen == [15, 10, 10]  # 5 rounds of 3 variants, then the original and omp_passive alone


def test_more_env_rounds_run_only_while_they_fit_the_time_budget(monkeypatch):
    """A script whose re-runs are slow (each a process that imports torch) gets its first rounds, not 15: the
    rounds beyond them are priced at the first rounds' seconds a process against `ENV_MORE_S`."""
    noisy = itertools.cycle([6.0, 14.0, 10.0, 7.0, 13.0, 9.0, 11.0])  # every side alike and noisy
    now = [0.0]
    seen = []

    def fake_many(jobs, quiet=False, threads=None):
        seen.append(len(jobs))
        now[0] += 4.0 * len(jobs)  # 4 s a process
        return [SimpleNamespace(status="stopped", traceback=None, breakdown={"step_ms": next(noisy)}) for j in jobs]

    diagnose_mod = importlib.import_module("torchspeed.doctor.diagnose")
    monkeypatch.setattr(diagnose_mod, "diagnose_many", fake_many)
    monkeypatch.setattr(_envfix, "_clock", lambda: now[0])
    job = DoctorJob(script="train.py", env_rounds=5, env_steps=6)
    cands = {"threads": {"OMP_NUM_THREADS": "1"}, "omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"}}
    raw = _envfix.run_env_rounds(job, cands, diagnose_mod.measure_variants, steps=30)
    # both intervals hold 1.0 after 5 rounds; 5 more of both and the original would take 15 x 4 s > 45 s, of one
    # and the original 10 x 4 s: the one with the larger measured gain gets them, then nothing more fits
    assert seen == [15, 10]
    first = {n: statistics.median(raw[n]["ratios"][:5]) for n in cands}
    more, other = sorted(cands, key=lambda n: -first[n])
    assert first[more] != first[other]
    assert len(raw[more]["ratios"]) == 10 and len(raw[other]["ratios"]) == 5
    assert "not run" in raw[other]["more_rounds"]
    e = _envfix.summarize(other, cands[other], raw[other], steps=30)
    assert e["rounds"] == 5 and "45 s" in e["more_rounds"]
    # a quick script (0.5 s a process) gets its extra rounds, as before
    seen.clear()
    noisy = itertools.cycle([14.0, 10.0, 7.0, 13.0, 9.0, 11.0, 6.0])
    monkeypatch.setattr(diagnose_mod, "diagnose_many", lambda jobs, quiet=False, threads=None: (
        seen.append(len(jobs)), now.__setitem__(0, now[0] + 0.5 * len(jobs)),
        [SimpleNamespace(status="stopped", traceback=None, breakdown={"step_ms": next(noisy)}) for j in jobs])[2])
    raw = _envfix.run_env_rounds(job, cands, diagnose_mod.measure_variants, steps=30)
    assert seen == [15, 15, 15] and all(len(raw[n]["ratios"]) == 15 for n in cands)


def test_the_rounds_that_fit_go_to_the_largest_measured_gain_first():
    out = {"a": {"ratios": [1.0, 1.02, 0.99]}, "b": {"ratios": [1.3, 1.1, 1.2]}, "c": {"ratios": [1.1, 1.05, 1.08]}}
    assert _envfix.affordable(["a", "b", "c"], out, 100.0, 20.0) == ["a", "b", "c"]  # 4 processes: all fit
    assert _envfix.affordable(["a", "b", "c"], out, 60.0, 20.0) == ["b", "c"]  # 3: two fixes and the original
    assert _envfix.affordable(["a", "b", "c"], out, 45.0, 20.0) == ["b"]
    assert _envfix.affordable(["a", "b", "c"], out, 39.0, 20.0) == []  # not even one fix beside the original


def test_a_loop_with_workers_is_re_run_past_the_batches_they_load_ahead(monkeypatch):
    """2 workers load 4 batches ahead while a re-run starts: the warm-up drains them (twice over) and the timed
    steps are at least 3 backlogs, so a fix is timed on a loop that waits on its data as the script's does. The
    workers patch counts its own workers; the re-runs are run with that warm-up."""
    job = DoctorJob(script="train.py", env_rounds=5, env_steps=6, warmup=5)
    two = {"breakdown": {"step_ms": 80.0}, "loaders": [{"num_workers": 2, "prefetch_factor": 2}]}
    assert _envfix.backlog(two) == 4 and _envfix.env_steps(job, two) == (12, 11)
    assert _envfix.env_steps(job, {"breakdown": {"step_ms": 80.0}, "loaders": [{"num_workers": 0}]}) == (6, 3)
    patched = {"workers": {"source": "x", "workers": 2, "label": "num_workers=2"}}
    assert _envfix.env_steps(job, {"breakdown": {"step_ms": 80.0}, "loaders": [{"num_workers": 0}]}, patched) == (12, 11)
    many = {"breakdown": {"step_ms": 80.0}, "loaders": [{"num_workers": 16, "prefetch_factor": 4}]}
    assert _envfix.backlog(many) == _envfix.BACKLOG_MAX  # bounded: 64 batches ahead would be 128 warm-up steps
    seen = []
    monkeypatch.setattr(_envfix, "run_env_rounds", lambda job, env, rv, patched, *, steps, warmup: seen.append(
        (steps, warmup)) or {n: {"ratios": [1.3] * 5, "ms": [60.0] * 5, "baseline_ms": [80.0] * 5, "error": None}
                             for n in env})
    obs = _obs(_set("cpu", {"workers": 2, "threads": 2, "cores": 2}), _set("breakdown.step_ms", 80.0),
               _set("loaders", [{"num_workers": 2, "prefetch_factor": 2, "map_style": True}]))
    _envfix.measure_env_fixes(job, obs, run_variants=None)
    assert seen == [(12, 11)] and obs["env_fixes"]["threads"]["steps"] == 12


def test_a_measurement_only_finding_is_dropped_only_where_its_interval_settles_a_loss():
    from torchspeed.doctor.report import interval_verdict
    from torchspeed.doctor.rules._common import env_listed

    def listed(interval, **more):
        entry = {"fix": "omp_passive", "ratios": [1.0] * 5, "speedup": 1.0, "interval": interval, **more}
        return env_listed({"env_fixes": {"omp_passive": entry}}, "omp_passive") is not None
    assert interval_verdict(1.005, 1.4) == "likely-faster"  # above 1.0 but not past 2%: its size not settled
    assert listed([1.005, 1.4]) and listed([0.9, 1.2]) and listed([1.1, 1.3])
    # a settled no-change is listed (low, with its measurement); a settled loss is not
    assert listed([0.9912, 1.0162]) and listed([1.001, 1.015]) and listed([0.95, 0.985])
    assert not listed([0.8, 0.9]) and not listed([0.9, 0.979])
    assert listed([0.5, 3.0], inconclusive=True) and not listed([1.1, 1.3], error="died")
