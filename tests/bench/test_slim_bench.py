"""`torchspeed bench --slim` (T38): the CLI runs the slim bench (not the suite), time to target counts the teacher's
up-front seconds, and a distilled student that is not 0.7x the scratch one's seconds is said not to pay."""

import json

import torchspeed.bench.slim as slim_bench
from torchspeed.bench.slim import _seconds_to, slim_table
from torchspeed.cli.main import main


def test_seconds_to_target_counts_the_teachers_seconds():
    run = {"curve": [[1.0, 0.5], [2.0, 0.9], [3.0, 0.95]]}
    assert _seconds_to(run, 0.9) == 2.0 and _seconds_to(run, 0.99) is None
    assert _seconds_to({**run, "teacher_s": 0.5}, 0.9) == 2.5


def _fake(**kw):
    summary = {"digits_cnn": {"step_speedup": 1.1, "latency_speedup": 1.3, "latency_speedup_batch1": 1.0,
                              "full_acc": 0.98, "finetune_acc": 0.975, "finetune_within_1pt": True,
                              "distil_ratio": 0.9, "distil_pays": False}}
    return {"meta": {"seconds": 1.0, **kw}, "prune": [], "distil": [], "summary": summary}


def test_bench_slim_flag_runs_the_slim_bench_and_writes_its_json(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(slim_bench, "run_slim_bench", lambda **kw: calls.append(kw) or _fake(**kw))
    out = tmp_path / "slim.json"
    assert main(["bench", "--slim", "--quick", "--seeds", "2", "--json", str(out)]) == 0
    assert calls == [{"seeds": (0, 1), "epochs": 4}]
    assert json.loads(out.read_text())["summary"]["digits_cnn"]["distil_pays"] is False
    assert "0.9x (does not pay)" in capsys.readouterr().out
    assert "does not pay" in slim_table(_fake())
