"""`torchspeed bench --slim` (T38): the CLI runs the slim bench (not the suite), time to target counts the teacher's
up-front seconds, and a distilled student that is not 0.7x the scratch one's seconds is said not to pay."""

import json

import pytest
import torch

import torchspeed.bench.slim as slim_bench
import torchspeed.bench.slim_workloads as slim_workloads
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


def _curve_runs(monkeypatch, curves: dict, pace: dict | None = None):
    """`_run` faked: each run's curve by (teacher given, epochs); the scratch run's final accuracy is the target;
    an epoch's seconds (`_pace`) 1.0 each way unless `pace` says."""
    monkeypatch.setattr(slim_bench, "_pace", lambda *a, **k: pace or {"scratch": 1.0, "distilled": 1.0})
    calls = []

    def run(model, train, val, *, seed, epochs, **options):
        key = ("teacher" if "teacher" in options else "scratch", epochs)
        calls.append(key)
        curve = curves[key]
        return {"val_acc": curve[-1][1], "curve": curve, "teacher_s": 0.1 if key[0] == "teacher" else 0.0}
    monkeypatch.setattr(slim_bench, "_run", run)
    fake = slim_workloads.SlimWorkload(lambda seed: ((None, None), (None, None)), object, object)
    monkeypatch.setitem(slim_workloads.SLIM_WORKLOADS, "digits_cnn", fake)
    return calls


def test_a_distilled_student_pays_only_where_its_shorter_run_gets_there_and_the_same_run_without_it_does_not(
        monkeypatch):
    """The distilled student trains for PAYS (0.7) of the scratch run's epochs, its schedule its own; the same
    shorter budget without the teacher is the control. Pays: the distilled run reaches the scratch run's final
    accuracy in 0.7x its seconds (the teacher's counted) and the control never does. A control that gets there too
    says the budget did it, not the teacher."""
    scratch = [[1.0, 0.90], [2.0, 0.94], [3.0, 0.95], [4.0, 0.96], [5.0, 0.97], [6.0, 0.97], [7.0, 0.97],
               [8.0, 0.97], [9.0, 0.97], [10.0, 0.975]]
    distilled = [[1.0, 0.92], [2.0, 0.95], [3.0, 0.96], [4.0, 0.97], [5.0, 0.97], [6.0, 0.975], [7.0, 0.98]]
    weak = [[1.0, 0.90], [2.0, 0.93], [3.0, 0.95], [4.0, 0.96], [5.0, 0.96], [6.0, 0.965], [7.0, 0.97]]
    calls = _curve_runs(monkeypatch, {("scratch", 10): scratch, ("teacher", 7): distilled, ("scratch", 7): weak})
    row = slim_bench._distil_rows("digits_cnn", 0, 10, teacher=object())
    assert sorted(calls) == [("scratch", 7), ("scratch", 10), ("teacher", 7)] and row["short_epochs"] == 7
    assert row["ratio"] == round(6.1 / 10.0, 3) and row["pays"] and row["verdict"].startswith("pays")
    _curve_runs(monkeypatch, {("scratch", 10): scratch, ("teacher", 7): distilled, ("scratch", 7): distilled})
    row = slim_bench._distil_rows("digits_cnn", 0, 10, teacher=object())
    assert not row["pays"] and "without the teacher too" in row["verdict"]
    # the same epochs, but an epoch with the teacher timed at 1.5x one without: 6 x 1.5 + 0.1 s against 10 s
    _curve_runs(monkeypatch, {("scratch", 10): scratch, ("teacher", 7): distilled, ("scratch", 7): weak},
                pace={"scratch": 1.0, "distilled": 1.5})
    row = slim_bench._distil_rows("digits_cnn", 0, 10, teacher=object())
    assert row["ratio"] == 0.91 and not row["pays"] and "needs 0.7x or less" in row["verdict"]


def test_an_epoch_is_priced_by_one_epoch_runs_alternated_after_an_untimed_round(monkeypatch):
    """`_pace` times an epoch with and without the teacher side by side (the rows' runs follow one another, and a
    machine whose pace moves between them would move their ratio): one-epoch runs of fresh copies of the untrained
    student, the order alternated round by round, the first round untimed, the medians."""
    calls, seconds = [], iter([9.0, 9.0, 1.0, 2.0, 2.2, 1.2, 1.1, 2.1])  # warm-up, then rounds 1 to 3
    student = torch.nn.Linear(2, 2)

    def run(model, train, val, *, seed, epochs, **options):
        assert epochs == 1 and model is not student
        calls.append(options["teacher"].cache if "teacher" in options else "scratch")
        return {"curve": [[next(seconds), 0.5]]}
    monkeypatch.setattr(slim_bench, "_run", run)
    pace = slim_bench._pace(student, None, None, seed=0, teacher=torch.nn.Linear(2, 2), cache=True)
    assert calls == ["scratch", True, "scratch", True, True, "scratch", "scratch", True]
    assert pace == {"scratch": 1.1, "distilled": 2.1}
    assert slim_bench._seconds_to({"curve": [[5.0, 0.8], [9.0, 0.95]], "teacher_s": 0.3}, 0.9, 2.0) == 4.3


def test_a_control_that_gets_there_too_must_be_slower_than_the_distilled_run():
    """Where the shorter run without the teacher reaches the target as well, the distilled run pays only where it
    gets there sooner than that control: the teacher, not the shorter budget alone, has to buy time. The row says
    how much (`vs_control`)."""
    ratio, vs_control, pays, verdict = slim_bench._distil_verdict(10.0, 6.5, 8.4, 10, 0.95)
    assert (ratio, vs_control, pays) == (0.65, 0.774, True) and "0.774x the seconds of the same 10-epoch" in verdict
    ratio, vs_control, pays, verdict = slim_bench._distil_verdict(10.0, 6.5, 6.5, 10, 0.95)
    assert (ratio, vs_control, pays) == (0.65, 1.0, False) and "without the teacher too" in verdict
    assert slim_bench._distil_verdict(10.0, 3.0, None, 10, 0.95)[2]
    assert not slim_bench._distil_verdict(10.0, 7.5, None, 10, 0.95)[2]
    assert not slim_bench._distil_verdict(10.0, None, None, 10, 0.95)[2]


def test_digit_pairs_are_two_digits_side_by_side_labelled_as_the_two_digit_number():
    pytest.importorskip("sklearn")
    (x, y), (vx, vy) = slim_workloads.digit_pairs(seed=0, train_size=500, val_size=200)
    (d, dy), _ = slim_workloads._digits(8, 1, 0)
    assert x.shape == (500, 1, 8, 16) and vx.shape == (200, 1, 8, 16) and int(y.max()) <= 99
    left = (x[:, :, :, :8].unsqueeze(1) == d.unsqueeze(0)).flatten(2).all(2)  # which training digit is on the left
    right = (x[:, :, :, 8:].unsqueeze(1) == d.unsqueeze(0)).flatten(2).all(2)
    assert left.any(1).all() and right.any(1).all()
    i, j = left.float().argmax(1), right.float().argmax(1)
    assert torch.equal(y, dy[i] * 10 + dy[j])
    for name in ("digit_pairs_cnn", "digit_pairs_vit"):
        w = slim_workloads.SLIM_WORKLOADS[name]
        full, student = w.full(), w.student()
        assert full(x[:4]).shape == student(x[:4]).shape == (4, 100) and not w.prune
        first = [m.weight.shape[0] for m in (full, student) for m in m.modules()
                 if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]  # each model's first layer's width
        n = len(first) // 2
        assert first[0] == 4 * first[n] and first[n - 1] == first[-1] == 100


def test_a_distillation_only_workload_trains_its_teacher_and_has_no_prune_row(monkeypatch):
    """The digit-pairs workloads run no prune rows: the teacher is trained first, the distil row takes it, and the
    summary and the table show `-` for the prune figures."""
    calls = []
    curve = [[1.0, 0.5], [2.0, 0.9]]

    def run(model, train, val, *, seed, epochs, **options):
        calls.append(("teacher" if "teacher" in options else "fit", type(model).__name__, epochs))
        return {"val_acc": 0.9, "curve": curve, "wall_s": 2.0, "steps": 10}
    monkeypatch.setattr(slim_bench, "_run", run)
    monkeypatch.setattr(slim_bench, "_pace", lambda *a, **k: {"scratch": 1.0, "distilled": 1.0})
    monkeypatch.setattr(slim_bench, "_prune_rows", lambda *a: pytest.fail("no prune rows on a distillation-only one"))
    fake = slim_workloads.SlimWorkload(lambda seed: ((None, None), (None, None)), lambda: torch.nn.Linear(2, 2),
                                       lambda: torch.nn.Identity(), prune=False)
    monkeypatch.setitem(slim_workloads.SLIM_WORKLOADS, "pairs", fake)
    result = slim_bench.run_slim_bench(workloads=("pairs",), seeds=(0,), epochs=10, log=lambda line: None)
    assert calls[0] == ("fit", "Linear", 10) and sorted(calls[1:]) == [("fit", "Identity", 7),
                                                                      ("fit", "Identity", 10),
                                                                      ("teacher", "Identity", 7)]
    assert result["prune"] == [] and result["distil"][0]["teacher"]["val_acc"] == 0.9
    summary = result["summary"]["pairs"]
    assert summary["step_speedup"] is None and summary["full_acc"] == 0.9 and summary["student_acc"] == 0.9
    assert "| pairs | - | - / - | 0.9000 | - | 0.9000 |" in slim_table(result)
