"""`measure_scaling` / `torchspeed bench --nproc`: 1-process and 2-process torchrun jobs, measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchspeed.bench.scaling import ScalingResult, ScalingRow, _torchrun, measure_scaling

ABORT_ONCE = Path(__file__).parent / "scripts" / "abort_once.py"


def test_a_row_derives_its_label_and_median_from_its_samples():
    """The label and the median are read from the row's fields; the JSON rows keep every key, in order."""
    row = ScalingRow(2, 4, [10.0, 14.0, 11.0], final_loss=0.5)
    assert (row.name, row.samples_per_s) == ("2 procs x 4 threads", 11.0)
    assert ScalingRow(1, 8, [5.0]).name == "1 proc x 8 threads"
    assert ScalingResult([row], {}, {}).to_dict()["rows"] == [
        {"name": "2 procs x 4 threads", "nproc": 2, "threads": 4, "samples_per_s": 11.0,
         "samples": [10.0, 14.0, 11.0], "final_loss": 0.5}]
    assert list(ScalingResult([row], {}, {}).to_dict()["rows"][0]) == ["name", "nproc", "threads", "samples_per_s",
                                                                      "samples", "final_loss"]


# Two torchrun jobs of a few seconds each when the machine is idle; a minute each next to other work.
@pytest.mark.timeout(600)
def test_measure_scaling_runs_both_jobs_and_reports_the_ratio():
    r = measure_scaling(nproc=2, model="mlp", batch_size=8, steps=2, warmup=1, rounds=1, windows=1,
                        same_cores_row=False, threads=1, timeout_s=270)
    assert [(row.nproc, row.threads) for row in r.rows] == [(1, 1), (2, 1)]
    assert all(row.samples_per_s > 0 and len(row.samples) == 1 for row in r.rows)
    assert r.ratios["2 procs / 1 proc"] == pytest.approx(r.rows[1].samples_per_s / r.rows[0].samples_per_s)
    assert all(row.final_loss is not None and row.final_loss == row.final_loss for row in r.rows)  # trained
    assert r.meta["jobs_restarted_after_a_crash"] in (0, 1, 2)


@pytest.mark.timeout(600)
def test_a_rank_killed_by_a_signal_restarts_the_job_and_its_stderr_is_quoted(tmp_path):
    result = str(tmp_path / "result.json")
    run = dict(nproc=2, threads=1, result=result, timeout_s=120)
    # rank 1 aborts in the first attempt only: the job runs again from scratch and succeeds
    with pytest.warns(RuntimeWarning, match=r"(?s)attempt 1 of 2.*SIGABRT.*rank 1 stderr.*planted abort"):
        out, attempts = _torchrun([str(ABORT_ONCE), str(tmp_path / "marker"), result], **run)
    assert out == {"world": 2} and attempts == 2
    # a crash in the last attempt is raised, with the rank's own stderr
    with pytest.raises(RuntimeError, match=r"(?s)attempt 1 of 1.*SIGABRT.*planted abort"):
        _torchrun([str(ABORT_ONCE), "always", result], attempts=1, **run)
    # a rank that exits with an error is a bug, not a crash: no second attempt
    with pytest.raises(RuntimeError, match=r"(?s)attempt 1 of 2.*planted error exit"):
        _torchrun([str(ABORT_ONCE), "error", result], **run)


def test_bench_nproc_rejects_one_process():
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "bench", "--nproc", "1"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "N >= 2" in proc.stderr and "Traceback" not in proc.stderr
