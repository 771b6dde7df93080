"""The fault gallery (tests/doctor/faults/fault_train.py): each injected fault is found by the rule that owns it,
read from counts (threads against the usable cores, page faults per step), and the clean twin gets no finding
of those rules and nothing high or medium.

Whether each finding's measured gain recovers the injected cost is a question for the clock:
`benchmarks/bench_doctor.py --verdict FAULT` measures it; here the environment re-runs are injected as no gain.
"""

import os
from pathlib import Path

import pytest

from torchspeed.doctor import DoctorJob, diagnose_many

SCRIPT = Path(__file__).parent / "faults" / "fault_train.py"
FAULTS = {"affinity": "cpu-threads", "malloc": "allocator"}


def _no_gain(job, candidates):
    return {n: {"ratios": [1.0] * 5, "ms": [10.0] * 5, "baseline_ms": [10.0] * 5} for n in candidates}


@pytest.fixture(scope="module")
def reports():
    # each in a process of its own (env={}): a collapsed affinity and malloc settings outlive a script
    jobs = [DoctorJob(script=str(SCRIPT), args=("--fault", f), steps=8, warmup=2, time_limit=120, env={})
            for f in (*FAULTS, "none")]
    return dict(zip((*FAULTS, "none"), diagnose_many(jobs, quiet=True, measure_env=_no_gain)))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="a collapsed affinity needs 2 usable cores to collapse from")
def test_a_collapsed_affinity_is_found_from_the_thread_and_core_counts(reports):
    r = reports["affinity"]
    assert r.status == "stopped", r.traceback
    assert r.observation["cpu_cores"] == 1 and r.observation["threads"] >= 2
    assert "cpu-threads" in r.rules
    f = next(g for f in r.findings for g in (f, *f.also) if g.rule == "cpu-threads")
    assert "affinity allows 1 of the machine's" in f.evidence and f.basis == "measured"  # the injected re-run
    assert r.observation["env_fixes"]["cores"]["env"] == {"OMP_NUM_THREADS": "1"}


def test_glibc_page_fault_churn_is_found_and_the_clean_twin_gets_nothing_ranked(reports):
    r = reports["malloc"]
    assert r.status == "stopped", r.traceback
    if r.observation["env"]["allocator"] == "glibc":  # tcmalloc/jemalloc preloaded: no glibc thresholds to churn
        assert r.observation["breakdown"]["minor_faults_per_step"] >= 1000 and "allocator" in r.rules
    clean = reports["none"]
    assert clean.status == "stopped", clean.traceback
    assert not clean.rules & set(FAULTS.values()), clean.rules
    assert not [f for f in clean.findings if f.severity in ("high", "medium")], clean.findings
    assert clean.observation["breakdown"]["minor_faults_per_step"] < 1000
