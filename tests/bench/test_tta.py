"""Time to accuracy in `torchspeed bench` (bench/tta.py): behaviour only, never wall-clock speed."""

import json

import pytest

from torchspeed.bench.runner import BenchResult, BenchRow
from torchspeed.bench.tta import DEFAULT_TARGETS, attach_tta, resolve_target, run_tta
from torchspeed.cli.main import main

# A tiny workload: an MLP on a small synthetic set learns past 0.3 accuracy within a few steps.
TINY = dict(model="mlp", data="synthetic", batch_size=32, train_size=256, val_size=128, device="cpu", progress=False,
            busy=False)


def _fake_bench() -> BenchResult:
    rows = [BenchRow(name, 100.0, 1.0, 2.3, 0.1) for name in ("naive", "set_to_none", "all")]
    return BenchResult(device="cpu: test", torch="x", workload="mlp", rows=rows, meta={})


@pytest.fixture(scope="module")
def reached():
    """naive and all on two seeds, trained to a low target (four processes)."""
    return run_tta(target=0.3, seeds=2, lr=0.05, max_steps=30, eval_every=5, **TINY)


def test_both_configs_reach_a_low_target_from_the_same_start(reached):
    res = reached
    assert res.seeds == [0, 1] and res.max_steps == 30 and res.eval_every == 5
    # interleaved: naive seed 0, all seed 0, naive seed 1, all seed 1
    assert [(r.config, r.seed) for r in res.runs] == [("naive", 0), ("all", 0), ("naive", 1), ("all", 1)]
    for r in res.runs:
        assert r.reached and r.val_acc >= 0.3
        assert 0 < r.steps_to_target <= 30 and r.steps_to_target % 5 == 0
        assert r.time_to_target_s > 0 and r.time_to_target_s <= r.train_s + 1e-9
        assert r.steps == r.steps_to_target  # a run stops at the first evaluation at or above the target
    assert res.runs[0].decisions["compile"].startswith("False")
    assert res.runs[1].decisions["optimizer"] != res.runs[0].decisions["optimizer"]  # all is not naive
    # fair: per seed both configs start from the same weights and see the same batches, so they learn alike
    by = {(r.config, r.seed): r for r in res.runs}
    for s in (0, 1):
        n, a = by["naive", s], by["all", s]
        assert n.steps_to_target == a.steps_to_target
        assert abs(n.val_acc - a.val_acc) < 0.03
    assert by["naive", 0].curve != by["naive", 1].curve  # seeds differ
    for name in ("naive", "all"):
        s = res.summary[name]
        assert s["reached"] == 2 and s["time_to_target_s"]["min"] <= s["time_to_target_s"]["mean"]
        assert s["steps_to_target"]["mean"] > 0 and s["val_acc"]["mean"] >= 0.3
    assert res.speedup is not None and res.speedup > 0 and len(res.speedup_runs) == 2
    assert res.message() is None


def test_rows_and_json_carry_time_to_accuracy(reached, tmp_path):
    from torchspeed.bench.runner import write_results

    bench = _fake_bench()
    attach_tta(bench, reached)
    write_results(bench, tmp_path / "b.json", None)
    data = json.loads((tmp_path / "b.json").read_text())
    rows = {r["config"]: r for r in data["rows"]}
    for name in ("naive", "all"):
        r = rows[name]
        assert r["time_to_target_s"] > 0 and r["steps_to_target"] > 0
        assert r["val_acc"] >= 0.3 > 0.1  # above chance (10 classes)
        assert r["rounds_val_acc"] == 0.1  # the throughput rounds' value is kept
        assert len(r["time_to_target_s_runs"]) == len(r["steps_to_target_runs"]) == len(r["val_acc_runs"]) == 2
    assert rows["set_to_none"]["time_to_target_s"] is None and rows["set_to_none"]["val_acc"] == 0.1
    tta = data["tta"]
    assert tta["target"] == 0.3 and tta["seeds"] == [0, 1]
    assert set(tta["summary"]) == {"naive", "all"} and tta["speedup_naive_over_all"] > 0 and tta["speedup_median"] > 0
    from torchspeed.bench.compare import compare_ratios
    ratios = [n / a for n, a in zip(rows["naive"]["time_to_target_s_runs"], rows["all"]["time_to_target_s_runs"])]
    assert tta["speedup_interval"]["verdict"] == compare_ratios(ratios)["verdict"]
    assert {"mean", "min", "max", "std"} <= set(tta["summary"]["all"]["time_to_target_s"])
    assert "commit" in tta["meta"] and len(tta["runs"]) == 4


def test_an_unreachable_target_is_reported_not_reached_within_the_step_budget():
    # lr 0: the model never learns, so 0.99 cannot be reached; the budget ends every run.
    res = run_tta(target=0.99, seeds=1, lr=0.0, max_steps=8, eval_every=3, **(TINY | {"busy": True}))
    # all starts as the throughput bench starts it: on a busy CPU, with OpenMP's passive wait
    assert res.runs[1].decisions["omp_wait_policy"] == "PASSIVE" != res.runs[0].decisions["omp_wait_policy"]
    for r in res.runs:
        assert not r.reached and r.time_to_target_s is None and r.steps_to_target is None
        assert r.steps == 8 and [c[0] for c in r.curve] == [3, 6, 8]
        assert 0 <= r.val_acc < 0.99
    assert res.summary["all"]["reached"] == 0 and res.summary["all"]["time_to_target_s"] is None
    assert res.speedup is None and "not reached" in res.message()
    bench = _fake_bench()
    attach_tta(bench, res)
    d = bench.to_dict()
    assert d["rows"][0]["time_to_target_s"] is None and d["rows"][0]["time_to_target_s_runs"] == [None]
    assert "not reached" in d["tta"]["message"]


def test_digits_turns_time_to_accuracy_on_by_default():
    assert resolve_target("digits", None) == DEFAULT_TARGETS["digits"] == 0.9
    assert resolve_target("synthetic", None) is None
    assert resolve_target("synthetic", 0.5) == 0.5
    assert resolve_target("digits", 0.0) is None and resolve_target("digits", None, off=True) is None


def test_bench_cli_runs_tta_for_digits_unless_switched_off(reached, monkeypatch, tmp_path):
    import torchspeed.bench.runner as runner
    import torchspeed.bench.tta as tta

    calls = []
    monkeypatch.setattr(runner, "run_bench", lambda **kw: _fake_bench())
    monkeypatch.setattr(runner, "plot_results", lambda *a, **k: None)

    def fake_tta(**kw):
        calls.append(kw)
        return reached

    monkeypatch.setattr(tta, "run_tta", fake_tta)
    out = tmp_path / "b.json"
    assert main(["bench", "--data", "digits", "--json", str(out)]) == 0
    assert len(calls) == 1 and calls[0]["target"] == 0.9 and calls[0]["data"] == "digits"
    assert calls[0]["model"] == "resnet20"  # the digits' default model
    assert "tta" in json.loads(out.read_text())
    for off in (["--no-tta"], ["--target-acc", "0"]):
        assert main(["bench", "--data", "digits", "--model", "resnet20", "--json", str(out), *off]) == 0
    assert main(["bench", "--data", "synthetic", "--model", "mlp", "--json", str(out)]) == 0
    assert len(calls) == 1 and "tta" not in json.loads(out.read_text())
    assert main(["bench", "--model", "mlp", "--target-acc", "0.5", "--seeds", "2", "--json", str(out)]) == 0
    assert len(calls) == 2 and calls[1]["target"] == 0.5 and calls[1]["seeds"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--target-acc", "1.5"], "between 0 and 1"),
    (["--target-acc", "-0.2"], "between 0 and 1"),
    (["--target-acc", "0.9", "--seeds", "0"], "--seeds must be positive"),
    (["--target-acc", "0.9", "--tta-steps", "0"], "--tta-steps must be positive"),
])
def test_bench_cli_refuses_out_of_range_tta_options(argv, message, capsys):
    assert main(["bench", "--model", "mlp", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_cli_end_to_end_prints_both_tables(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["bench", "--quick", "--model", "mlp", "--configs", "all", "--no-hand", "--target-acc", "0.3",
                 "--seeds", "1", "--tta-steps", "20", "--eval-every", "5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "speed-up" in printed and "time to accuracy" in printed
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"naive", "all"}
    for r in rows.values():
        assert r["steps_to_target"] > 0 and r["time_to_target_s"] > 0 and r["val_acc"] >= 0.3
