"""`measure_scaling` / `torchspeed bench --nproc`: 1-process and 2-process torchrun jobs, measured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torchspeed.bench.scaling import measure_scaling


@pytest.mark.timeout(180)
def test_measure_scaling_runs_both_jobs_and_reports_the_ratio():
    r = measure_scaling(nproc=2, model="mlp", batch_size=8, steps=2, warmup=1, rounds=1, windows=1,
                        same_cores_row=False, threads=1)
    assert [(row.nproc, row.threads) for row in r.rows] == [(1, 1), (2, 1)]
    assert all(row.samples_per_s > 0 and len(row.samples) == 1 for row in r.rows)
    assert r.ratios["2 procs / 1 proc"] == pytest.approx(r.rows[1].samples_per_s / r.rows[0].samples_per_s)
    assert all(row.final_loss is not None and row.final_loss == row.final_loss for row in r.rows)  # trained


def test_bench_nproc_rejects_one_process():
    proc = subprocess.run([sys.executable, "-m", "torchspeed", "bench", "--nproc", "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "N >= 2" in proc.stderr and "Traceback" not in proc.stderr
